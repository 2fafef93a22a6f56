"""File helpers shared by everything that handles weight files (no torch import).

A weights location is a ``.safetensors`` file or a directory holding ``model.safetensors``;
its ``config.json`` sits beside the weights file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def weights_file(path: str | os.PathLike[str]) -> Path:
    """The safetensors file meant by ``path``: the file itself, or ``model.safetensors`` in a directory."""
    path = Path(path)
    return path if path.suffix == ".safetensors" else path / WEIGHTS_FILE


def config_file(path: str | os.PathLike[str]) -> Path:
    """The ``config.json`` that describes the weights at ``path`` (it sits beside the weights file)."""
    return weights_file(path).parent / CONFIG_FILE


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks: the checksum carried by ``WeightsPublished``."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
