"""The weights-directory format: atomic versions with a manifest, checks from headers and raw bits, adapters."""

from __future__ import annotations

import json
from pathlib import Path

import fakeredis
import pytest
import torch
from safetensors.torch import save_file

from rollout_bus.events.names import Keys
from rollout_bus.events.schema import Producer
from rollout_bus.lm import hf
from rollout_bus.lm.files import (
    INDEX_FILE,
    MANIFEST_FILE,
    WeightsError,
    adapter_problems,
    layout_files,
    nonfinite_tensors,
    read_manifest,
    tensor_shapes,
    verify_weights_dir,
    write_weights_dir,
)
from rollout_bus.trainer.weights import WeightPublisher
from tests.support.models import LLAMA_TARGETS, lora


def test_a_version_is_invisible_until_complete_and_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    final = tmp_path / "policy" / "v000001"
    seen_during: list[bool] = []

    def fill(tmp: Path) -> None:
        seen_during.append(final.exists())
        save_file({"w": torch.ones(2, 2)}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text("{}")

    digest = write_weights_dir(final, fill)
    assert seen_during == [False]
    manifest, actual = read_manifest(final)
    assert actual == digest and manifest.kind == "full" and set(manifest.files) == {"model.safetensors", "config.json"}
    assert verify_weights_dir(final, digest) == manifest
    with pytest.raises(FileExistsError):
        write_weights_dir(final, fill)

    def broken(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_weights_dir(tmp_path / "policy" / "v000002", broken)
    assert sorted(p.name for p in (tmp_path / "policy").iterdir()) == ["v000001"]  # no temporary left behind


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nan_and_infinity_are_found_from_the_raw_bits_of_every_float_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    clean, nan, inf = torch.ones(64, 64, dtype=dtype), torch.ones(64, 64, dtype=dtype), torch.ones(3, dtype=dtype)
    nan[7, 9] = float("nan")
    inf[2] = float("-inf")
    save_file({"clean": clean, "nan": nan, "inf": inf, "ids": torch.arange(10)}, str(tmp_path / "w.safetensors"))
    assert sorted(nonfinite_tensors(tmp_path / "w.safetensors")) == ["inf", "nan"]


def test_a_header_whose_offsets_or_shape_do_not_fit_its_data_is_a_weights_error(tmp_path: Path) -> None:
    """Crafted headers: offsets past the data, offsets that split an element, a negative dimension."""
    def crafted(info: dict[str, object], data: int = 16) -> Path:
        header = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], **info}}).encode()
        path = tmp_path / "w.safetensors"
        path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(data))
        return path

    cases: list[tuple[dict[str, object], str]] = [
        ({"data_offsets": [0, 15]}, r"\[0, 15\]: 15 bytes, not a whole number of 4-byte"),
        ({"data_offsets": [0, 64]}, r"\[0, 64\] outside the file's 16 bytes"),
        ({"data_offsets": [8, 4]}, "outside"), ({"data_offsets": "0-16"}, "expected \\[start, end\\]")]
    for info, message in cases:
        with pytest.raises(WeightsError, match=message):
            nonfinite_tensors(crafted(info))
    with pytest.raises(WeightsError, match="malformed safetensors header: shape entry -2"):
        tensor_shapes(crafted({"data_offsets": [0, 16], "shape": [-2, 2]}))


def test_the_manifest_names_the_policy_and_version_it_publishes(tmp_path: Path) -> None:
    def fill(tmp: Path) -> None:
        save_file({"w": torch.ones(2)}, str(tmp / "model.safetensors"))

    write_weights_dir(tmp_path / "p" / "v000007", fill, policy="p", version=7)
    manifest, _ = read_manifest(tmp_path / "p" / "v000007")
    assert (manifest.policy, manifest.version) == ("p", 7)
    write_weights_dir(tmp_path / "model", fill)  # a model directory, not a publication
    assert (read_manifest(tmp_path / "model")[0].policy, read_manifest(tmp_path / "model")[0].version) == (None, None)


def test_shapes_are_read_across_shards_and_an_index_must_match_them(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2, 3)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(4)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    assert layout_files(tmp_path) == sorted(weight_map.values())
    assert tensor_shapes(tmp_path) == {"a": ("F32", (2, 3)), "b": ("F32", (4,))}
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {**weight_map, "c": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(WeightsError, match=r"names tensors no shard holds: \['c'\]"):
        tensor_shapes(tmp_path)
    (tmp_path / INDEX_FILE).unlink()
    with pytest.raises(WeightsError, match="shards but no model.safetensors.index.json"):
        layout_files(tmp_path)


def test_an_adapter_fits_a_base_only_through_its_targets_input_and_output_sizes() -> None:
    base = {"m.q.weight": ("F32", (8, 4)), "m.o.weight": ("F32", (4, 8))}
    good = {"base_model.model.m.q.lora_A.weight": ("F32", (2, 4)), "base_model.model.m.q.lora_B.weight": ("F32", (8, 2))}
    assert adapter_problems(good, base) == []
    wrong = {"base_model.model.m.q.lora_A.weight": ("F32", (2, 5)), "base_model.model.m.o.lora_B.weight": ("F32", (8, 2)),
             "base_model.model.m.k.lora_A.weight": ("F32", (2, 4))}
    problems = " ".join(adapter_problems(wrong, base))
    assert "m.q.lora_A.weight: input size 5" in problems and "m.o.lora_B.weight: output size 8" in problems
    assert "the base model has no m.k.weight" in problems
    assert adapter_problems({}, base) == ["the adapter holds no LoRA tensors (lora_A / lora_B)"]


def test_the_publisher_writes_sharded_hf_versions_and_peft_adapters_the_checks_accept(tmp_path: Path, keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    launch = hf.write_random_llama(tmp_path / "launch", seed=0)
    full = WeightPublisher(client, keys, "default", tmp_path / "root", Producer("trainer", "t"))
    published = full.publish(hf.random_llama(259, seed=1), 3, tokenizer=hf.byte_tokenizer(), max_shard_size="60KB")
    directory = Path(published.uri)
    assert len(layout_files(directory)) >= 4 and (directory / "tokenizer.json").is_file()
    assert verify_weights_dir(directory, published.sha256).kind == "full"
    assert tensor_shapes(directory) == tensor_shapes(launch)
    adapter = WeightPublisher(client, keys, "math", tmp_path / "root", Producer("trainer", "t"))
    published = adapter.publish(lora(hf.load_model(launch), LLAMA_TARGETS, seed=0, scale=0.1), 1)
    directory = Path(published.uri)
    assert sorted(p.name for p in directory.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                           MANIFEST_FILE]
    assert verify_weights_dir(directory, published.sha256).kind == "adapter"
    assert adapter_problems(tensor_shapes(directory / "adapter_model.safetensors"), tensor_shapes(launch)) == []
