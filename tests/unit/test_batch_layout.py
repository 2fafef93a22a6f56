"""Batches laid out before their tensors exist (``batch.layout``), and the memfd store's spec."""

from __future__ import annotations

from typing import Any

import pytest
import redis
import torch

from rollout_bus.events.batch import FLAG_UNHASHED, RaggedSpec, decode, encode, layout
from rollout_bus.events.errors import ChecksumMismatch, InvalidRequest, PayloadTooLarge
from rollout_bus.events.names import Keys
from rollout_bus.events.payload import MemfdStore, RedisStore, StoreSpec, make_store


def filled(fields: dict[str, Any], meta: dict[str, Any]) -> tuple[bytearray, dict[str, Any]]:
    plan = layout(fields, meta)
    buf = bytearray(plan.nbytes)
    buf[:len(plan.head)] = plan.head
    return buf, plan.tensors(buf)


def test_a_batch_filled_in_place_decodes_like_an_encoded_one_without_its_checksum() -> None:
    buf, t = filled({"a": ((3, 4), torch.float32), "r": RaggedSpec(5, 2, torch.int32)}, {"m": 1})
    t["a"].copy_(torch.arange(12, dtype=torch.float32).view(3, 4))
    t["r"].values.copy_(torch.arange(5))
    t["r"].offsets.copy_(torch.tensor([0, 2, 5]))
    batch = decode(buf, verify=False)
    reference = decode(encode({"a": torch.arange(12, dtype=torch.float32).view(3, 4)}).tobytes())
    assert torch.equal(batch.tensors["a"], reference.tensors["a"]) and batch.meta == {"m": 1}
    assert [r.tolist() for r in batch.ragged["r"].to_list()] == [[0, 1], [2, 3, 4]]
    assert int.from_bytes(buf[6:8], "little") == FLAG_UNHASHED


def test_a_batch_without_a_checksum_cannot_be_verified() -> None:
    buf, _ = filled({"a": ((8,), torch.int64)}, {})
    with pytest.raises(ChecksumMismatch, match="no checksum"):
        decode(buf)


def test_a_layout_over_the_limit_or_with_a_bad_field_is_refused() -> None:
    with pytest.raises(PayloadTooLarge):
        layout({"a": ((1 << 20,), torch.float32)}, max_bytes=1 << 20)
    with pytest.raises(InvalidRequest, match="shape"):
        layout({"a": ((-1,), torch.float32)})
    with pytest.raises(InvalidRequest, match="dtype"):
        layout({"a": ((4,), torch.complex64)})
    with pytest.raises(InvalidRequest, match="RaggedSpec"):
        layout({"a": torch.zeros(3)})  # type: ignore[dict-item]


def test_the_memfd_spec_parses_and_takes_no_path(fake_client: redis.Redis, keys: Keys) -> None:
    assert StoreSpec.parse("memfd?fallback=redis") == StoreSpec("memfd", None, {"fallback": "redis"})
    store = make_store("memfd?fallback=redis", fake_client, keys)
    assert isinstance(store, MemfdStore) and isinstance(store.fallback, RedisStore)
    with pytest.raises(InvalidRequest, match="no path"):
        make_store("memfd:/dev/shm/x", fake_client, keys)
    with pytest.raises(InvalidRequest, match="only fallback"):
        make_store("memfd?fallback=file", fake_client, keys)
