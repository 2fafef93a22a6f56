"""The batch wire format: round trips, zero copies, ragged fields, checksums, limits, malformed input."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
import torch

import rollout_bus.events.batch as batch_mod
from rollout_bus.events.batch import (
    ALIGN,
    MAGIC,
    Ragged,
    checksum_views,
    decode,
    encode,
    pack_ragged,
    unpack_ragged,
)
from rollout_bus.events.errors import ChecksumMismatch, DecodeError, InvalidRequest, PayloadTooLarge


def sample_fields() -> dict[str, torch.Tensor | Ragged]:
    g = torch.Generator().manual_seed(1)
    return {
        "tokens": Ragged.from_list([torch.arange(5, dtype=torch.int32), torch.arange(0, dtype=torch.int32),
                                    torch.arange(3, dtype=torch.int32)]),
        "rewards": torch.randn(3, generator=g),
        "sample_indices": torch.arange(3, dtype=torch.int64),
        "log_probs": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "truncated": torch.tensor([True, False, True]),
        "bytes": torch.tensor([1, 2, 255], dtype=torch.uint8),
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(42, dtype=torch.int64),
    }


def address(buf: bytearray | np.ndarray) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def test_a_batch_round_trips_every_dtype_shape_and_its_meta() -> None:
    fields = sample_fields()
    meta = {"policy": "p", "rollout_id": 7, "metrics": {"reward": 0.5}, "ids": [1, 2, 3]}
    batch = decode(encode(fields, meta).tobytes())
    assert batch.meta == meta
    assert set(batch.tensors) == {"rewards", "sample_indices", "log_probs", "truncated", "bytes", "empty", "scalar"}
    for name, value in fields.items():
        if isinstance(value, Ragged):
            got = batch.ragged[name]
            assert torch.equal(got.values, value.values) and torch.equal(got.offsets, value.offsets)
        else:
            got_t = batch.tensors[name]
            assert got_t.dtype == value.dtype and got_t.shape == value.shape
            assert torch.equal(got_t, value)
    assert batch.tensors["log_probs"].dtype == torch.bfloat16


def test_encode_hands_out_views_of_the_tensors_not_copies() -> None:
    t = torch.arange(1000, dtype=torch.int64)
    enc = encode({"t": t})
    views = [b for b in enc.buffers if isinstance(b, memoryview)]
    assert len(views) == 1
    assert int(np.frombuffer(views[0], dtype=np.uint8).ctypes.data) == t.data_ptr()
    assert enc.nbytes == sum(len(b) if not isinstance(b, memoryview) else b.nbytes for b in enc.buffers)


def test_decode_shares_memory_with_the_buffer_and_aligns_every_field_to_64_bytes() -> None:
    enc = encode(sample_fields())
    buf = bytearray(enc.tobytes())
    base = address(buf)
    batch = decode(buf)
    for t in [*batch.tensors.values(), *(r.values for r in batch.ragged.values())]:
        if t.numel():
            assert base <= t.data_ptr() < base + len(buf)
            assert (t.data_ptr() - base) % ALIGN == 0
    batch.tensors["rewards"][0] = 123.0  # writable buffer: the tensor writes through to it
    assert decode(buf, verify=False).tensors["rewards"][0] == 123.0


def test_decoding_a_read_only_buffer_raises_no_warning() -> None:
    data = encode({"x": torch.ones(4)}).tobytes()
    assert torch.equal(decode(data).tensors["x"], torch.ones(4))  # filterwarnings=error would fail here


def test_non_contiguous_and_sliced_tensors_are_encoded_by_value() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    fields = {"t": base.t(), "s": base[1:3, 2:5], "v": base.reshape(-1)[5:9]}
    batch = decode(encode(fields).tobytes())
    for name, value in fields.items():
        assert torch.equal(batch.tensors[name], value)


def test_pack_and_unpack_ragged_are_inverse() -> None:
    rows = [torch.tensor([1, 2, 3]), torch.tensor([], dtype=torch.int64), torch.tensor([4])]
    values, offsets = pack_ragged(rows)
    assert offsets.dtype == torch.int64 and offsets.tolist() == [0, 3, 3, 4]
    assert values.tolist() == [1, 2, 3, 4]
    back = unpack_ragged(values, offsets)
    assert [r.tolist() for r in back] == [[1, 2, 3], [], [4]]
    assert back[0].data_ptr() == values.data_ptr()  # views, not copies


def test_ragged_helpers_cover_lengths_indexing_and_an_empty_list() -> None:
    r = Ragged.from_list([torch.ones(2), torch.ones(5)], dtype=torch.bfloat16)
    assert len(r) == 2 and r.lengths.tolist() == [2, 5] and r.values.dtype == torch.bfloat16
    assert r[1].shape == (5,)
    empty = Ragged.from_list([], dtype=torch.int32)
    assert len(empty) == 0 and empty.values.dtype == torch.int32 and empty.offsets.tolist() == [0]
    assert decode(encode({"e": empty}).tobytes()).ragged["e"].to_list() == []


def test_a_flipped_data_byte_raises_checksum_mismatch() -> None:
    t = torch.arange(100, dtype=torch.int32)
    buf = bytearray(encode({"t": t}).tobytes())
    buf[-5] ^= 0x40
    with pytest.raises(ChecksumMismatch, match="checksum"):
        decode(buf)
    assert decode(buf, verify=False).tensors["t"][-2] != t[-2]


def test_the_parallel_checksum_equals_the_serial_one(monkeypatch: pytest.MonkeyPatch) -> None:
    views = [memoryview(np.arange(n, dtype=np.uint8)) for n in (70_000, 0, 131_072, 5)]
    monkeypatch.setattr(batch_mod, "PARALLEL_HASH_MIN_BYTES", 1 << 40)
    serial = checksum_views(views, chunk=4096)
    monkeypatch.setattr(batch_mod, "PARALLEL_HASH_MIN_BYTES", 0)
    monkeypatch.setattr(batch_mod, "MAX_HASH_THREADS", 3)
    assert checksum_views(views, chunk=4096) == serial


def test_a_batch_over_max_bytes_is_refused_with_a_clear_message() -> None:
    with pytest.raises(PayloadTooLarge, match=r"max_bytes=4096.*split it or raise the limit"):
        encode({"t": torch.zeros(2048, dtype=torch.int32)}, max_bytes=4096)
    assert encode({"t": torch.zeros(16, dtype=torch.int32)}, max_bytes=4096).nbytes < 4096


def test_unsupported_dtypes_meta_and_values_are_invalid_requests() -> None:
    with pytest.raises(InvalidRequest, match="complex64"):
        encode({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(InvalidRequest, match="msgpack"):
        encode({"t": torch.zeros(1)}, {"obj": object()})
    with pytest.raises(InvalidRequest, match="tensor or Ragged"):
        encode({"x": [1, 2, 3]})  # type: ignore[dict-item]
    with pytest.raises(InvalidRequest, match="offsets"):
        encode({"r": Ragged(torch.zeros(3), torch.tensor([0, 3], dtype=torch.int32))})


def _header(buf: bytes) -> tuple[dict, int]:
    _, _, _, n = struct.unpack_from("<4sHHI", buf, 0)
    return msgpack.unpackb(buf[12:12 + n]), n


def _rebuild(header: dict, data: bytes) -> bytes:
    raw = msgpack.packb(header)
    prefix = struct.pack("<4sHHI", MAGIC, 1, 0, len(raw)) + raw
    return prefix + bytes(-len(prefix) % ALIGN) + data


@pytest.mark.parametrize("mutate", [
    pytest.param(lambda b: b[:-1], id="truncated"),
    pytest.param(lambda b: b + b"\0", id="trailing byte"),
    pytest.param(lambda b: b"XXXX" + b[4:], id="bad magic"),
    pytest.param(lambda b: b[:4] + b"\x09\x00" + b[6:], id="future version"),
    pytest.param(lambda b: b[:8] + b"\xff\xff\xff\x7f" + b[12:], id="header length past the end"),
    pytest.param(lambda b: b[:12] + b"\xc1" * 20 + b[32:], id="header not msgpack"),
    pytest.param(lambda b: b"", id="empty"),
    pytest.param(lambda b: b[:10], id="shorter than the prefix"),
])
def test_malformed_buffers_raise_decode_error(mutate: object) -> None:
    good = encode({"t": torch.arange(64, dtype=torch.int32)}, {"k": "v"}).tobytes()
    with pytest.raises(DecodeError):
        decode(mutate(good))  # type: ignore[operator]


@pytest.mark.parametrize("edit", [
    pytest.param(lambda h: h["fields"][0].update(dtype="complex128"), id="unknown dtype"),
    pytest.param(lambda h: h["fields"][0].update(shape=[1000]), id="shape larger than its bytes"),
    pytest.param(lambda h: h["fields"][0].update(offset=10**9), id="offset past the data"),
    pytest.param(lambda h: h["fields"][0].update(shape=[-1, -64]), id="negative shape"),
    pytest.param(lambda h: h.update(fields="nope"), id="fields not a list"),
    pytest.param(lambda h: h.update(checksum=None), id="no checksum"),
    pytest.param(lambda h: h.update(hash_chunk=3), id="bad hash chunk"),
    pytest.param(lambda h: h["fields"].append(dict(h["fields"][0])), id="duplicate field"),
    pytest.param(lambda h: h["fields"][0].update(ragged="values"), id="ragged without offsets"),
])
def test_a_tampered_header_raises_decode_error(edit: object) -> None:
    good = encode({"t": torch.arange(64, dtype=torch.int32)}).tobytes()
    header, n = _header(good)
    data = good[-256:]
    edit(header)  # type: ignore[operator]
    with pytest.raises(DecodeError):
        decode(_rebuild(header, data))


def test_ragged_offsets_that_do_not_cover_the_values_are_rejected() -> None:
    enc = encode({"r": Ragged.from_list([torch.ones(2), torch.ones(3)])}).tobytes()
    header, _ = _header(enc)
    start = len(enc) - header["data_nbytes"]
    buf = bytearray(enc)
    off = next(f for f in header["fields"] if f.get("ragged") == "offsets")
    struct.pack_into("<q", buf, start + off["offset"] + 8, 9)  # offsets [0, 9, 5]
    with pytest.raises(DecodeError, match="offsets"):
        decode(buf, verify=False)


def test_a_deferred_checksum_is_filled_into_the_header_when_the_batch_is_finished(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_mod, "MAX_HASH_THREADS", 3)
    fields = {"a": torch.arange(3_000_000, dtype=torch.int32), "b": torch.ones(5)}
    eager = encode(fields, {"k": 1})
    deferred = encode(fields, {"k": 1}, defer_checksum=True)
    assert bytes(deferred.buffers[0]) != bytes(eager.buffers[0])  # no checksum yet
    deferred.start_checksum()
    assert deferred.finish() == eager.checksum
    assert deferred.tobytes() == eager.tobytes()
    out = bytearray(eager.nbytes)
    encode(fields, {"k": 1}, defer_checksum=True).write_into(memoryview(out))
    assert decode(out).checksum == eager.checksum


def test_write_into_hashes_each_piece_as_copied_to_the_same_checksum() -> None:
    # fields over several 2 MiB pieces, with odd sizes (padding between them) and an empty one
    g = torch.Generator().manual_seed(7)
    tensors = {"a": torch.randint(0, 1 << 30, ((5 << 20) // 4 + 3,), dtype=torch.int32, generator=g),
               "empty": torch.zeros(0, dtype=torch.int64),
               "b": torch.randn(700_001, generator=g).to(torch.bfloat16)}
    reference = encode(tensors, {"k": 1}).tobytes()  # hashed by the background hasher
    fresh = encode(tensors, {"k": 1}, defer_checksum=True)
    out = bytearray(fresh.nbytes + 16)
    fresh.write_into(out, 16)  # hashed piece by piece from ``out``
    assert bytes(out[16:]) == reference
    batch = decode(memoryview(out)[16:])  # verifies
    assert torch.equal(batch.tensors["a"], tensors["a"]) and torch.equal(batch.tensors["b"], tensors["b"])
    started = encode(tensors, {"k": 1}, defer_checksum=True)
    started.start_checksum()  # the background hash has begun: write_into finishes that one instead
    again = bytearray(started.nbytes)
    started.write_into(again)
    assert bytes(again) == reference


def test_write_into_on_several_threads_copies_and_hashes_as_one_thread_does(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(3)
    tensors = {"a": torch.randint(0, 1 << 30, ((9 << 20) // 4 + 5,), dtype=torch.int32, generator=g),
               "b": torch.randn(1_300_001, generator=g)}
    reference = encode(tensors, {"k": 2}).tobytes()
    monkeypatch.setattr(batch_mod, "PARALLEL_HASH_MIN_BYTES", 0)
    monkeypatch.setattr(batch_mod, "MAX_HASH_THREADS", 3)
    monkeypatch.setattr(batch_mod, "COPY_STEP", 100_000)  # steps that do not divide a piece
    out = bytearray(len(reference))
    encode(tensors, {"k": 2}, defer_checksum=True).write_into(out)
    assert bytes(out) == reference


def test_write_into_raises_what_a_helper_thread_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_mod, "PARALLEL_HASH_MIN_BYTES", 0)
    monkeypatch.setattr(batch_mod, "MAX_HASH_THREADS", 3)
    enc = encode({"a": torch.zeros(3 << 20, dtype=torch.uint8)}, defer_checksum=True)
    with pytest.raises(ValueError):
        enc.write_into(bytearray(enc.nbytes - 1))  # too small: every thread's last piece fails
