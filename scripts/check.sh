#!/usr/bin/env bash
# Static checks, as CI runs them: ruff, the Kubernetes manifests, mypy and the architecture rules (import-linter).
#
# Installed, the top-level folders are the subpackages of one import name, rollout_bus
# (pyproject.toml's package-dir map). mypy and import-linter read packages from disk, so
# build/typecheck/rollout_bus/ lays that map out: a folder per package, a link per module.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || scripts/setup.sh
. .venv/bin/activate

python - <<'PY'
import os, shutil, tomllib
from pathlib import Path

root = Path.cwd()
tree = root / "build" / "typecheck" / "rollout_bus"
shutil.rmtree(tree.parent, ignore_errors=True)
tree.mkdir(parents=True)
mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
for name, folder in mapping.items():
    target = tree.parent.joinpath(*name.split("."))
    for source in (root / folder).rglob("*.py"):
        relative = source.relative_to(root / folder)
        if name == "rollout_bus" and len(relative.parts) > 1:
            continue
        link = target / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(source)
PY

ruff check .
python scripts/validate_k8s.py   # deploy/k8s/ against the Kubernetes and KEDA schemas, offline
mypy
(cd build/typecheck && lint-imports ../../pyproject.toml)
