"""Property: whatever bytes or maps arrive, decoding yields an event or a DecodeError, nothing else."""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rollout_bus.events.errors import DecodeError
from rollout_bus.events.schema import FIELD, SCHEMA_VERSION, Event, Producer, decode, encode, event_types
from tests.unit.test_schema import make

TYPE_NAMES = sorted(event_types())

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), st.binary(max_size=8)), inner, max_size=4)),
    max_leaves=12)

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check(fields: Any) -> None:
    try:
        event = decode(fields)
    except DecodeError as exc:
        assert exc.reason
        assert exc.raw is fields
        return
    assert isinstance(event, Event)
    assert type(event).__name__ in TYPE_NAMES
    assert encode(decode(encode(event))) == encode(event)  # bytes, not ==: a NaN field is legal


@SETTINGS
@given(st.binary(max_size=256))
@example(b"")
@example(b"\xdd\xff\xff\xff\xff")  # array header claiming 4 billion items
@example(b"\xdf\xff\xff\xff\xff")  # map header claiming 4 billion pairs
@example(b"\x91" * 2000)  # nested far deeper than any event
def test_decoding_random_bytes_raises_only_decode_error(raw: bytes) -> None:
    check({FIELD: raw})


@SETTINGS
@given(st.dictionaries(st.one_of(st.text(max_size=8), st.binary(max_size=8)), values, max_size=6))
def test_decoding_random_msgpack_maps_raises_only_decode_error(data: dict[Any, Any]) -> None:
    check({FIELD: msgpack.packb(data, use_bin_type=True)})


@SETTINGS
@given(st.sampled_from(TYPE_NAMES), st.data())
def test_damaging_fields_of_a_valid_event_raises_only_decode_error(type_name: str, data: st.DataObject) -> None:
    good = make(event_types()[type_name]).to_dict()
    names = data.draw(st.lists(st.sampled_from(sorted(good)), min_size=1, max_size=3, unique=True))
    damaged = dict(good)
    for name in names:
        if data.draw(st.booleans()):
            damaged[name] = data.draw(values)
        else:
            del damaged[name]
    check({FIELD: msgpack.packb(damaged, use_bin_type=True)})


@SETTINGS
@given(st.one_of(values, st.dictionaries(st.one_of(st.text(max_size=4), st.binary(max_size=4)), values, max_size=4)))
def test_decoding_arbitrary_entry_fields_raises_only_decode_error(fields: Any) -> None:
    check(fields)


def test_the_producer_is_rebuilt_as_a_producer() -> None:
    data = {"type": "EngineReady", "schema_version": SCHEMA_VERSION, "producer": {"role": "r", "instance": "i"},
            "seq": 7, "engine_id": "e", "url": "http://x"}
    assert decode({FIELD: msgpack.packb(data)}).producer == Producer("r", "i")
