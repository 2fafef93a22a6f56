"""Published weights are checked before any engine sees them: root, existence, sha256, shapes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from rollout_bus.controller.weights import BadWeights, reference_shapes, verify


def write(path: Path, rows: int = 4) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": np.ones((rows, 3), dtype=np.float32), "b": np.zeros(3, dtype=np.float32)}, str(path))
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    write(tmp_path / "root" / "base" / "model.safetensors")
    return tmp_path / "root"


def test_good_weights_become_a_target_with_the_directory_as_engine_path(root: Path) -> None:
    sha = write(root / "v1" / "model.safetensors")
    target = verify("default", 1, str(root / "v1"), sha, root, reference_shapes(str(root / "base")))
    assert (target.version, target.sha256) == (1, sha)
    assert target.engine_path == str((root / "v1").resolve())
    file_target = verify("default", 1, f"file://{root}/v1/model.safetensors", sha, root, None)
    assert file_target.engine_path.endswith("model.safetensors")
    assert verify("default", 1, "v1", sha, root, None).version == 1  # relative to the root


def test_checksum_mismatch_is_refused(root: Path) -> None:
    write(root / "v1" / "model.safetensors")
    with pytest.raises(BadWeights, match="checksum mismatch"):
        verify("default", 1, str(root / "v1"), "0" * 64, root, None)


def test_missing_file_is_refused(root: Path) -> None:
    (root / "v2").mkdir()
    with pytest.raises(BadWeights, match="missing"):
        verify("default", 2, str(root / "v2"), "0" * 64, root, None)
    with pytest.raises(BadWeights, match="missing"):
        verify("default", 2, str(root / "nowhere"), "0" * 64, root, None)


def test_wrong_shapes_are_refused_against_the_reference_model(root: Path) -> None:
    sha = write(root / "v3" / "model.safetensors", rows=5)
    with pytest.raises(BadWeights, match=r"wrong shapes: w: shape \[5, 3\], expected \[4, 3\]"):
        verify("default", 3, str(root / "v3"), sha, root, reference_shapes(str(root / "base")))


def test_paths_outside_the_root_are_refused_even_through_symlinks(root: Path, tmp_path: Path) -> None:
    sha = write(tmp_path / "elsewhere" / "model.safetensors")
    with pytest.raises(BadWeights, match="outside the weights root"):
        verify("default", 4, str(tmp_path / "elsewhere"), sha, root, None)
    with pytest.raises(BadWeights, match="outside the weights root"):
        verify("default", 4, str(root / ".." / "elsewhere"), sha, root, None)
    (root / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(BadWeights, match="outside the weights root"):
        verify("default", 4, str(root / "link"), sha, root, None)
    (root / "v4").mkdir()
    (root / "v4" / "model.safetensors").symlink_to(tmp_path / "elsewhere" / "model.safetensors")
    with pytest.raises(BadWeights, match="outside the weights root"):
        verify("default", 4, str(root / "v4"), sha, root, None)


def test_remote_uris_and_garbage_files_are_refused(root: Path) -> None:
    with pytest.raises(BadWeights, match="unsupported weights uri"):
        verify("default", 5, "s3://bucket/w", "0" * 64, root, None)
    (root / "v5").mkdir()
    (root / "v5" / "model.safetensors").write_bytes(b"not a safetensors file at all")
    sha = hashlib.sha256(b"not a safetensors file at all").hexdigest()
    with pytest.raises(BadWeights, match="not a"):
        verify("default", 5, str(root / "v5"), sha, root, reference_shapes(str(root / "base")))
