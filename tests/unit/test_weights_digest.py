"""The digest of a weights location (``lm.files.tensors_digest``) and of tensors in memory (``lm.hf.state_digest``):
one definition, shared by the engine that serves the weights and the controller that checks them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from rollout_bus.lm.files import INDEX_FILE, WEIGHTS_FILE, WeightsError, tensors_digest
from rollout_bus.lm.hf import read_state, state_digest


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb.weight": torch.randn(8, 4, generator=g), "head.weight": torch.randn(4, 8, generator=g),
            "norm.weight": torch.ones(4, dtype=torch.bfloat16), "scale": torch.tensor(0.5),
            "empty": torch.zeros(0, 3)}


def write(directory: Path, state: dict[str, torch.Tensor], shards: list[list[str]] | None = None) -> Path:
    directory.mkdir(parents=True)
    if shards is None:
        save_file(state, str(directory / WEIGHTS_FILE))
        return directory
    weight_map = {}
    for i, names in enumerate(shards, 1):
        shard = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: state[n] for n in names}, str(directory / shard))
        weight_map.update({n: shard for n in names})
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def test_the_same_tensors_give_the_same_digest_from_files_and_from_memory(tmp_path: Path) -> None:
    a, b = write(tmp_path / "a", tensors()), write(tmp_path / "b", tensors())
    assert tensors_digest(a) == tensors_digest(b) == state_digest(tensors()) == state_digest(read_state(a))
    assert tensors_digest(a / WEIGHTS_FILE) == tensors_digest(a)


def test_the_digest_does_not_depend_on_how_the_tensors_are_sharded(tmp_path: Path) -> None:
    one = write(tmp_path / "one", tensors())
    two = write(tmp_path / "two", tensors(), [["head.weight", "scale"], ["emb.weight", "norm.weight", "empty"]])
    three = write(tmp_path / "three", tensors(), [["empty"], ["norm.weight", "emb.weight"], ["scale", "head.weight"]])
    assert tensors_digest(one) == tensors_digest(two) == tensors_digest(three)


def changed(kind: str) -> dict[str, torch.Tensor]:
    state = tensors()
    if kind == "one value":
        state["emb.weight"] = state["emb.weight"].clone()
        state["emb.weight"][3, 1] += 1e-6
    elif kind == "dtype":
        state["norm.weight"] = state["norm.weight"].to(torch.float16)
    elif kind == "shape":
        state["emb.weight"] = state["emb.weight"].reshape(4, 8)  # the same bytes, another shape
    elif kind == "name":
        state["emb2.weight"] = state.pop("emb.weight")
    elif kind == "missing":
        del state["scale"]
    elif kind == "extra":
        state["bias"] = torch.zeros(1)
    return state


@pytest.mark.parametrize("kind", ["one value", "dtype", "shape", "name", "missing", "extra"])
def test_any_change_to_a_tensor_changes_the_digest(kind: str, tmp_path: Path) -> None:
    base = tensors_digest(write(tmp_path / "base", tensors()))
    other = write(tmp_path / "other", changed(kind))
    assert tensors_digest(other) != base
    assert state_digest(changed(kind)) == tensors_digest(other)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 3), min_size=5, max_size=5), st.integers(0, 2**16))
def test_any_sharding_of_any_tensors_gives_the_in_memory_digest(tmp_path_factory: pytest.TempPathFactory,
                                                                 placement: list[int], seed: int) -> None:
    state = tensors(seed)
    names = sorted(state)
    shards = [[n for n, s in zip(names, placement, strict=True) if s == i] for i in range(4)]
    target = tmp_path_factory.mktemp("sharded") / "w"
    directory = write(target, state, [s for s in shards if s])
    assert tensors_digest(directory) == state_digest(state)


def test_a_tensor_stored_in_two_shards_is_refused(tmp_path: Path) -> None:
    state = tensors()
    directory = write(tmp_path / "twice", state, [list(state), ["scale"]])
    with pytest.raises(WeightsError, match="scale is stored twice"):
        tensors_digest(directory)


def test_a_tensor_whose_offsets_leave_the_file_is_refused(tmp_path: Path) -> None:
    directory = write(tmp_path / "bad", {"w": torch.ones(4)})
    path = directory / WEIGHTS_FILE
    raw = path.read_bytes()
    path.write_bytes(raw[:-4])  # the header still says 16 bytes of data
    with pytest.raises(WeightsError, match="outside the file"):
        tensors_digest(directory)
