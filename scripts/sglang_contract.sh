#!/usr/bin/env bash
# Build (or reuse) the venv of the SGLang contract lane: the real sglang==0.5.23 package, imported on
# a CPU-only machine, so tests/contract/ can drive SGLang's own request parsing, HTTP app, auth
# middleware and ServerArgs parser with the project's requests. No server, no GPU.
#
#   SGLANG_VENV    where the venv goes (default: <repo root>/.venv-sglang, gitignored)
#   SGLANG_PYTHON  interpreter to build it with (default: python3.11)
#
# Exit status: 0 ready (built now, or up to date), 3 skipped because the package registry cannot be
# reached (the reason on stdout, "skipped: ..."), 2 unusable environment, 1 anything else.
#
# Recipe (measured on a CPU-only machine: ~100 s cold, 2.4 GB): a constraints file pins the CPU torch
# (sglang's metadata pins a CUDA torch of ~3 GB: a constraint makes pip fail instead), the pure-Python
# dependencies that sglang's imports need are installed, then sglang itself with --no-deps.
# torchvision from the registry does not import beside the CPU torch, and sglang imports it only for
# names: an import-only stand-in package goes on sys.path. The HTTP stack is pinned to the versions the
# contract was read against (status codes and error bodies come from fastapi/pydantic, not sglang).
# A stamp (hash of this script and the interpreter) makes a repeated run return at once; the project
# itself is installed editable (--no-deps) and reinstalled only when pyproject.toml changes.
set -Eeuo pipefail

SGLANG_VERSION=0.5.23
TORCH_PIN=2.13.0+cpu
TRITON_PIN=3.8.0

cd "$(dirname "$0")/.."
repo=$(pwd)
PY=${SGLANG_PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || { echo "sglang_contract: $PY not found" >&2; exit 2; }
VENV=${SGLANG_VENV:-$repo/.venv-sglang}
case "$VENV" in /*) ;; *) VENV=$repo/$VENV ;; esac
VPY=$VENV/bin/python
script_hash=$( { cat "$0"; "$PY" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-32)
project_hash=$(sha256sum pyproject.toml | cut -c1-32)

install_project() {
  "$VPY" -m pip install -q --no-input --no-deps -e "$repo" >/dev/null 2>&1 \
    || { echo "sglang_contract: installing the project into $VENV failed" >&2; exit 1; }
  echo "$project_hash" >"$VENV/.project-stamp"
}

up_to_date() { [[ -x $VPY && -f $VENV/.sglang-stamp && "$(<"$VENV/.sglang-stamp")" == "$script_hash" ]]; }

finish() {
  [[ -f $VENV/.project-stamp && "$(<"$VENV/.project-stamp")" == "$project_hash" ]] || install_project
  echo "sglang contract venv ready: $VENV"
  exit 0
}

up_to_date && finish

lock=${TMPDIR:-/tmp}/sglang-contract-$(printf %s "$VENV" | sha256sum | cut -c1-16).lock
exec 9>"$lock"
flock 9
up_to_date && finish  # another run built it while this one waited

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

index=$("$PY" -m pip config get global.index-url 2>/dev/null || true)
index=${PIP_INDEX_URL:-${index:-https://pypi.org/simple}}
fail() {  # $1: what failed; a skip (3) when the index cannot be reached, else a loud failure
  if ! reason=$("$PY" - "$index" 2>&1 <<'PY'
import sys, urllib.request
url = sys.argv[1].rstrip("/") + "/sglang/"
try:
    urllib.request.urlopen(url, timeout=15).read(1)
except Exception as exc:
    print(f"{url}: {type(exc).__name__}: {exc}")
    sys.exit(1)
PY
  ); then
    echo "skipped: package registry unreachable ($reason)"
    exit 3
  fi
  grep -v 'is ignored: it is neither' "$work/log" >&2 || true
  echo "sglang_contract: $1 failed (the registry is reachable)" >&2
  exit 1
}

# The sglang wheel is needed anyway: fetching it first is also the reachability probe.
"$PY" -m pip download -q --no-deps --retries 1 --timeout 20 -d "$work/wheel" "sglang==$SGLANG_VERSION" \
  >"$work/log" 2>&1 || fail "pip download sglang==$SGLANG_VERSION"

if [[ -e $VENV && ! -f $VENV/pyvenv.cfg && -n "$(ls -A "$VENV" 2>/dev/null)" ]]; then
  echo "sglang_contract: $VENV exists and is not a venv; refusing to clear it" >&2
  exit 1
fi
echo "building the sglang contract venv in $VENV (a few minutes, ~2.4 GB)"
rm -f "$VENV/.sglang-stamp"
"$PY" -m venv --clear "$VENV"
cat >"$VENV/constraints.txt" <<EOF
torch==$TORCH_PIN
triton==$TRITON_PIN
transformers==5.19.0
tokenizers==0.23.2
apache-tvm-ffi==0.1.11
sentencepiece==0.2.1
compressed-tensors==0.18.0
openai==2.8.0
xgrammar==0.2.7
soundfile==0.13.1
fastapi==0.165.0
starlette==1.10.0
pydantic==2.14.4
pydantic-core==2.50.5
msgspec==0.23.0
uvicorn==0.54.0
anyio==4.16.0
orjson==3.13.0
httpx==0.28.1
httpx2==2.16.2
EOF
pipi() {
  nice -n 10 "$VPY" -m pip install -q --no-input -c "$VENV/constraints.txt" "$@" >"$work/log" 2>&1 \
    || fail "pip install $*"
}
pipi "torch==${TORCH_PIN%+cpu}"
[[ $("$VPY" -m pip show torch | sed -n 's/^Version: //p') == "$TORCH_PIN" ]] \
  || { echo "sglang_contract: torch is not $TORCH_PIN" >&2; exit 1; }
pipi "triton==$TRITON_PIN"
# what sglang's imports need (its own metadata is not used: --no-deps below)
pipi numpy msgspec pyzmq pydantic orjson psutil pybase64 requests packaging pillow fastapi tqdm IPython \
     aiohttp transformers dill apache-tvm-ffi sentencepiece compressed-tensors gguf openai partial_json_parser \
     'uvicorn>=0.51' uvloop setproctitle einops jsonschema xgrammar soundfile python-multipart httpx httpx2
# what the lane's tests need from the project's side
pipi pytest pytest-timeout 'fakeredis[lua]' redis hiredis rq msgpack xxhash prometheus-client safetensors
"$VPY" -m pip install -q --no-input --no-deps "$work/wheel"/sglang-"$SGLANG_VERSION"-*.whl >"$work/log" 2>&1 \
  || fail "installing the sglang wheel"

# import-only torchvision stand-in: the names transformers and sglang touch at import time
site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
stub=$VENV/stand-ins/torchvision
mkdir -p "$stub/io" "$stub/transforms/v2"
cat >"$stub/__init__.py" <<'EOF'
"""Import-only stand-in for torchvision (the registry's wheel does not import beside the CPU torch).
sglang and transformers import a few names from it at import time; using any of them raises."""
import enum

__version__ = "0.29.1+standin"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def unusable(name):
    def call(*args, **kwargs):
        raise NotImplementedError(f"{name}: torchvision is an import-only stand-in in the sglang contract venv")
    return call
EOF
cat >"$stub/io/__init__.py" <<'EOF'
from torchvision import ImageReadMode, unusable

decode_image = unusable("torchvision.io.decode_image")
EOF
cat >"$stub/transforms/__init__.py" <<'EOF'
from torchvision import InterpolationMode
from torchvision.transforms import functional
EOF
cat >"$stub/transforms/functional.py" <<'EOF'
from torchvision import InterpolationMode, unusable

pil_to_tensor = unusable("torchvision.transforms.functional.pil_to_tensor")
to_tensor = unusable("torchvision.transforms.functional.to_tensor")
EOF
: >"$stub/transforms/v2/__init__.py"
: >"$stub/transforms/v2/functional.py"
echo "$VENV/stand-ins" >"$site/zz-torchvision-stand-in.pth"

if ! "$VPY" - >"$work/log" 2>&1 <<'PY'
import importlib.metadata as md
import warnings
warnings.simplefilter("ignore")
import sglang.srt.entrypoints.http_server as http_server
from sglang.srt.server_args import ServerArgs
assert md.version("torch") == "2.13.0+cpu", md.version("torch")
assert md.version("sglang") == "0.5.23", md.version("sglang")
assert hasattr(http_server, "app") and hasattr(http_server, "set_global_state")
PY
then
  cat "$work/log" >&2
  echo "sglang_contract: the import check failed in $VENV" >&2
  exit 1
fi
echo "$script_hash" >"$VENV/.sglang-stamp"
install_project
echo "sglang contract venv ready: $VENV ($(du -sh "$VENV" | cut -f1))"
