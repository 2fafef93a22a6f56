"""Published weights are checked before any engine sees them: root, manifest, every file's sha256,
finite values, shapes against the served model, and adapters against it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from rollout_bus.controller.weights import BadWeights, reference_shapes, verify
from rollout_bus.lm.files import INDEX_FILE, write_weights_dir


def tensors(rows: int = 4, value: float = 1.0) -> dict[str, np.ndarray]:
    return {"w": np.full((rows, 3), value, dtype=np.float32), "b": np.zeros(3, dtype=np.float32)}


def named(path: Path) -> dict[str, object]:
    """The policy and version a test directory publishes: ``<root>/<policy>/v<version>``."""
    return {"policy": path.parent.name, "version": int(path.name[1:]) if path.name[1:].isdigit() else 0}


def full(path: Path, rows: int = 4, value: float = 1.0, sharded: bool = False) -> str:
    """A full-weights version directory (one file, or two shards with an index); its manifest sha256."""
    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps({"model_type": "toy"}))
        data = tensors(rows, value)
        if not sharded:
            save_file(data, str(tmp / "model.safetensors"))
            return
        save_file({"w": data["w"]}, str(tmp / "model-00001-of-00002.safetensors"))
        save_file({"b": data["b"]}, str(tmp / "model-00002-of-00002.safetensors"))
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": {
            "w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))

    return write_weights_dir(path, fill, **named(path))  # type: ignore[arg-type]


def adapter(path: Path, in_size: int = 3, out_size: int = 4) -> str:
    def fill(tmp: Path) -> None:
        (tmp / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
        save_file({"base_model.model.w.lora_A.weight": np.ones((2, in_size), dtype=np.float32),
                   "base_model.model.w.lora_B.weight": np.ones((out_size, 2), dtype=np.float32)},
                  str(tmp / "adapter_model.safetensors"))

    return write_weights_dir(path, fill, **named(path))  # type: ignore[arg-type]


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    full(tmp_path / "root" / "base")
    return tmp_path / "root"


def test_good_weights_become_a_target_with_the_directory_as_engine_path(root: Path) -> None:
    reference = reference_shapes(str(root / "base"))
    for version, sharded in ((1, False), (2, True)):
        name = f"default/v{version}"
        sha = full(root / name, sharded=sharded)
        target = verify("default", version, str(root / name), sha, root, reference)
        assert (target.version, target.sha256, target.kind) == (version, sha, "full")
        assert target.engine_path == str((root / name).resolve())
    sha = full(root / "default" / "v3")
    assert verify("default", 3, f"file://{root}/default/v3", sha, root, None).version == 3
    assert verify("default", 3, "default/v3", sha, root, None).engine_path.endswith("/v3")  # relative to the root


def test_a_manifest_that_does_not_hash_to_the_published_sha256_is_refused(root: Path) -> None:
    full(root / "default" / "v1")
    with pytest.raises(BadWeights, match="manifest mismatch: sha256 of .*manifest.json"):
        verify("default", 1, str(root / "default" / "v1"), "0" * 64, root, None)


def test_a_file_changed_added_or_removed_after_publication_is_refused(root: Path) -> None:
    sha = full(root / "default" / "v1", sharded=True)
    shard = root / "default" / "v1" / "model-00002-of-00002.safetensors"
    original = shard.read_bytes()
    shard.write_bytes(original[:-4] + b"\x00\x00\x80\x3f")  # the last value becomes 1.0
    with pytest.raises(BadWeights, match="manifest mismatch: sha256 of model-00002-of-00002.safetensors"):
        verify("default", 1, str(root / "default" / "v1"), sha, root, None)
    shard.unlink()
    with pytest.raises(BadWeights, match=r"missing shard\(s\) listed in the manifest: \['model-00002-of-00002"):
        verify("default", 1, str(root / "default" / "v1"), sha, root, None)
    shard.write_bytes(original)
    (root / "default" / "v1" / "extra.safetensors").write_bytes(original)
    with pytest.raises(BadWeights, match=r"files not in the manifest: \['extra.safetensors'\]"):
        verify("default", 1, str(root / "default" / "v1"), sha, root, None)


def test_an_index_naming_a_shard_that_was_never_written_is_refused(root: Path) -> None:
    def fill(tmp: Path) -> None:
        save_file(tensors(), str(tmp / "model-00001-of-00002.safetensors"))
        (tmp / INDEX_FILE).write_text(json.dumps({"weight_map": {
            "w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))

    sha = write_weights_dir(root / "default" / "v1", fill, policy="default", version=1)
    with pytest.raises(BadWeights, match=r"missing shard\(s\) named by the layout: \['model-00002-of-00002"):
        verify("default", 1, str(root / "default" / "v1"), sha, root, None)


def test_non_finite_values_are_refused(root: Path) -> None:
    sha = full(root / "default" / "v1", value=float("nan"))
    with pytest.raises(BadWeights, match=r"non-finite values \(NaN or infinity\) in model.safetensors: \['w'\]"):
        verify("default", 1, str(root / "default" / "v1"), sha, root, None)
    sha = full(root / "default" / "v2", value=float("-inf"))
    with pytest.raises(BadWeights, match="non-finite"):
        verify("default", 2, str(root / "default" / "v2"), sha, root, None)


def test_wrong_shapes_are_refused_against_the_reference_model(root: Path) -> None:
    sha = full(root / "default" / "v3", rows=5)
    with pytest.raises(BadWeights, match=r"wrong shapes: w: shape \[5, 3\], expected \[4, 3\]"):
        verify("default", 3, str(root / "default" / "v3"), sha, root, reference_shapes(str(root / "base")))


def test_an_adapter_is_checked_against_the_served_base_model(root: Path) -> None:
    reference = {"w.weight": ("F32", (4, 3)), "b": ("F32", (3,))}
    target = verify("math", 1, str(root / "math" / "v1"), adapter(root / "math" / "v1"), root, reference)
    assert target.kind == "adapter"
    sha = adapter(root / "math" / "v2", in_size=5)
    with pytest.raises(BadWeights, match="the adapter does not fit the served base model: .*input size 5"):
        verify("math", 2, str(root / "math" / "v2"), sha, root, reference)


def test_paths_outside_the_root_are_refused_even_through_symlinks(root: Path, tmp_path: Path) -> None:
    sha = full(tmp_path / "elsewhere")
    with pytest.raises(BadWeights, match="outside the weights root"):
        verify("default", 4, str(tmp_path / "elsewhere"), sha, root, None)
    with pytest.raises(BadWeights, match="outside the weights root"):
        verify("default", 4, str(root / ".." / "elsewhere"), sha, root, None)
    (root / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(BadWeights, match="outside the weights root"):
        verify("default", 4, str(root / "link"), sha, root, None)
    sha = full(root / "default" / "v4")
    os.replace(root / "default" / "v4" / "model.safetensors", tmp_path / "moved.safetensors")
    (root / "default" / "v4" / "model.safetensors").symlink_to(tmp_path / "moved.safetensors")
    with pytest.raises(BadWeights, match="is not a regular file"):
        verify("default", 4, str(root / "default" / "v4"), sha, root, None)


def test_missing_directories_remote_uris_and_bare_files_are_refused(root: Path) -> None:
    with pytest.raises(BadWeights, match="missing"):
        verify("default", 2, str(root / "nowhere"), "0" * 64, root, None)
    with pytest.raises(BadWeights, match="unsupported weights uri"):
        verify("default", 5, "s3://bucket/w", "0" * 64, root, None)
    full(root / "default" / "v5")
    with pytest.raises(BadWeights, match="is not a directory"):
        verify("default", 5, str(root / "default" / "v5" / "model.safetensors"), "0" * 64, root, None)
    (root / "default" / "v6").mkdir()
    with pytest.raises(BadWeights, match="no readable manifest.json"):
        verify("default", 6, str(root / "default" / "v6"), "0" * 64, root, None)


def test_a_manifest_must_name_the_policy_and_version_the_event_announces_in_that_policys_folder(root: Path) -> None:
    sha = full(root / "default" / "v4")
    with pytest.raises(BadWeights, match="publishes 'default' v4, but the event announces 'default' v999999"):
        verify("default", 999999, str(root / "default" / "v4"), sha, root, None)
    with pytest.raises(BadWeights, match="outside .*/math: a policy publishes only under its own folder"):
        verify("math", 4, str(root / "default" / "v4"), sha, root, None)
    sha = write_weights_dir(root / "math" / "v4", lambda tmp: save_file(tensors(), str(tmp / "model.safetensors")),
                            policy="default", version=4)  # written into another policy's folder
    with pytest.raises(BadWeights, match="publishes 'default' v4, but the event announces 'math' v4"):
        verify("math", 4, str(root / "math" / "v4"), sha, root, None)
    sha = write_weights_dir(root / "default" / "v5", lambda tmp: save_file(tensors(), str(tmp / "model.safetensors")))
    with pytest.raises(BadWeights, match="names no policy and version .*publish it again"):
        verify("default", 5, str(root / "default" / "v5"), sha, root, None)
