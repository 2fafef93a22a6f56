#!/usr/bin/env bash
# Static checks, as CI runs them, each on the tree as it stands at the root: ruff, the Kubernetes
# manifests, mypy, the architecture rules (lint-imports) and pyright (no unresolved import).
#
# rollout_bus/ links each top-level package folder (rollout_bus/events -> ../events), so every
# import path rollout_bus.X.Y is a file in the checkout and no tool needs a tree built for it.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || scripts/setup.sh
. .venv/bin/activate

ruff check .
python scripts/validate_k8s.py   # deploy/k8s/ against the Kubernetes and KEDA schemas, offline
mypy
lint-imports
python scripts/check_imports.py  # pyright at the root: every import resolves (the optional extras' aside)
