#!/usr/bin/env bash
# Run the test suite (unit tests on fakeredis, integration tests on private redis-servers).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q "$@"
