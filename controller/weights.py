"""Checking published weights before any engine sees them.

A ``WeightsPublished`` uri is a path (or ``file://`` URL) to a ``.safetensors`` file or
to a directory holding ``model.safetensors``. It is refused when it resolves (symlinks
included, for the directory and the file) outside the weights root, when the file is
missing, when its sha256 differs from the published one, or when its tensor names and
shapes differ from the reference model's. Shapes are read from the safetensors header
(8-byte length + JSON), so the controller needs no torch.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from urllib.parse import unquote, urlsplit

from rollout_bus.controller.versions import Target
from rollout_bus.events.errors import Failure
from rollout_bus.lm.files import sha256_file, weights_file

MAX_HEADER_BYTES = 100 << 20

Shapes = dict[str, tuple[str, tuple[int, ...]]]


class BadWeights(Failure):
    """Published weights that must not reach an engine; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def uri_path(uri: str) -> Path:
    if uri.startswith("file://"):
        return Path(unquote(urlsplit(uri).path))
    if "://" in uri:
        raise BadWeights(f"unsupported weights uri {uri!r}: only local paths and file:// are supported")
    return Path(uri)


def read_shapes(path: Path) -> Shapes:
    """Tensor name -> (dtype, shape) from a safetensors header; ``BadWeights`` if unreadable."""
    try:
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise BadWeights(f"{path} is not a safetensors file (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", raw_len)
            if length > MAX_HEADER_BYTES:
                raise BadWeights(f"{path} is not a safetensors file (header of {length} bytes)")
            header = json.loads(f.read(length))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise BadWeights(f"{path} is not a readable safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise BadWeights(f"{path} has a malformed safetensors header")
    out: Shapes = {}
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        out[name] = (str(info.get("dtype")), tuple(int(d) for d in info.get("shape", [])))
    return out


def shape_problems(reference: Shapes, candidate: Shapes, limit: int = 4) -> list[str]:
    problems: list[str] = []
    missing = sorted(set(reference) - set(candidate))
    unexpected = sorted(set(candidate) - set(reference))
    if missing:
        problems.append(f"missing tensors {missing[:limit]}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:limit]}")
    for name in sorted(set(reference) & set(candidate)):
        if reference[name][1] != candidate[name][1]:
            problems.append(f"{name}: shape {list(candidate[name][1])}, expected {list(reference[name][1])}")
    return problems[:limit + 2]


def reference_shapes(model_path: str) -> Shapes | None:
    """Shapes of the model the engines were launched with, when it is a local safetensors model."""
    if not model_path:
        return None
    path = weights_file(Path(model_path))
    return read_shapes(path) if path.is_file() else None


def verify(policy: str, version: int, uri: str, sha256: str, root: Path, reference: Shapes | None) -> Target:
    """The ``Target`` for a publication, or ``BadWeights`` with the reason (blocking: hashes the file)."""
    root = root.resolve()
    raw = uri_path(uri)
    if not raw.is_absolute():
        raw = root / raw
    file = weights_file(raw)
    try:
        resolved_dir = raw.resolve(strict=True)
        resolved_file = file.resolve(strict=True)
    except (FileNotFoundError, NotADirectoryError):
        raise BadWeights(f"weights file missing: {file}") from None
    except OSError as exc:
        raise BadWeights(f"weights path unusable: {file}: {exc}") from None
    for resolved in (resolved_dir, resolved_file):
        if not resolved.is_relative_to(root):
            raise BadWeights(f"weights path {raw} resolves to {resolved}, outside the weights root {root}")
    if not resolved_file.is_file():
        raise BadWeights(f"weights file missing: {file} is not a regular file")
    actual = sha256_file(resolved_file)
    if actual != sha256.lower():
        raise BadWeights(f"checksum mismatch: sha256 of {file} is {actual}, published {sha256}")
    if reference is not None:
        problems = shape_problems(reference, read_shapes(resolved_file))
        if problems:
            raise BadWeights("wrong shapes: " + "; ".join(problems))
    engine_path = str(resolved_dir if resolved_dir.is_dir() else resolved_file)
    return Target(policy, version, uri, actual, engine_path)
