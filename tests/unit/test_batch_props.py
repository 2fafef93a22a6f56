"""Properties of the batch wire format: any batch round-trips; any bytes decode or raise DecodeError."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_bus.events.batch import DTYPES, Ragged, decode, encode
from rollout_bus.events.errors import DecodeError

NAMES = st.text(alphabet="abcdefghij_.", min_size=1, max_size=8)
SHAPES = st.lists(st.integers(0, 5), min_size=0, max_size=3)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype_name = draw(st.sampled_from(sorted(DTYPES)))
    dtype = DTYPES[dtype_name]
    shape = draw(SHAPES)
    n = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    if dtype == torch.bool:
        return torch.tensor([b & 1 for b in raw], dtype=torch.bool).reshape(shape)
    flat = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    return flat.reshape(shape).clone()


@st.composite
def ragged(draw: st.DrawFn) -> Ragged:
    rows = draw(st.lists(st.integers(0, 6), max_size=5))
    dtype = DTYPES[draw(st.sampled_from(["int32", "float32", "bfloat16"]))]
    return Ragged.from_list([torch.arange(n).to(dtype) for n in rows], dtype)


META = st.dictionaries(
    st.text(max_size=6),
    st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
                 | st.text(max_size=10) | st.binary(max_size=10),
                 lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                 max_leaves=8),
    max_size=4)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(a.reshape(-1).view(torch.uint8).numpy()) == bytes(b.reshape(-1).view(torch.uint8).numpy())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(NAMES, tensors(), max_size=5), st.dictionaries(NAMES, ragged(), max_size=2), META)
def test_any_batch_round_trips_bit_for_bit(plain: dict[str, torch.Tensor], rows: dict[str, Ragged],
                                           meta: dict[str, object]) -> None:
    fields: dict[str, torch.Tensor | Ragged] = {**plain, **{f"r{k}": v for k, v in rows.items()}}
    batch = decode(encode(fields, meta).tobytes())
    assert batch.meta == meta
    for name, value in fields.items():
        if isinstance(value, Ragged):
            got = batch.ragged[name]
            assert same_bytes(got.values, value.values) and torch.equal(got.offsets, value.offsets)
        else:
            assert same_bytes(batch.tensors[name], value)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_raise_only_decode_error(data: bytes) -> None:
    assert_decodes_or_says_why(data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupted_encodings_decode_or_raise_only_decode_error(data: st.DataObject) -> None:
    good = bytearray(encode({"t": torch.arange(40, dtype=torch.int32), "r": Ragged.from_list(
        [torch.ones(3), torch.ones(1)])}, {"k": [1, 2]}).tobytes())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(good) - 1))
        good[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(good)))
    buf = bytes(good[:cut]) if data.draw(st.booleans()) else good
    assert_decodes_or_says_why(buf)


def assert_decodes_or_says_why(buf: bytes | bytearray) -> None:
    """Decoding either succeeds or raises DecodeError with a reason; any other exception fails the test."""
    try:
        batch = decode(buf)
    except DecodeError as exc:
        assert exc.reason
    else:
        assert batch.nbytes <= len(buf)
