"""The wire schema: every event type survives a round trip; anything malformed is a DecodeError."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

import msgpack
import pytest

from rollout_bus.events.errors import DecodeError, InvalidRequest
from rollout_bus.events.schema import (
    FIELD,
    ID_FIELDS,
    MAX_EVENT_BYTES,
    SCHEMA_VERSION,
    BatchReady,
    EngineLaunching,
    EngineOffloaded,
    Event,
    GroupExpired,
    OffloadEngines,
    Producer,
    RolloutCompleted,
    decode,
    decode_as,
    encode,
    encode_bytes,
    event_types,
    seq_slot,
)

PRODUCER = Producer("tester", "host-0")


def sample(hint: Any) -> Any:
    """A non-trivial value of type ``hint``."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return {"nested": [1, "two", 3.5, None, b"\x00\xff"]}
    if origin in (Union, types.UnionType):
        return sample(next(h for h in typing.get_args(hint) if h is not type(None)))
    if origin is list:
        (item,) = typing.get_args(hint)
        return [sample(item), sample(item)]
    if origin is dict:
        key_t, val_t = typing.get_args(hint)
        return {"k1": sample(val_t), "k2": sample(val_t)} if key_t is str else {sample(key_t): sample(val_t)}
    return {str: "text-ü", int: 42, float: 2.5, bool: True, bytes: b"\x00raw\xff"}[hint]


def make(cls: type[Event]) -> Event:
    hints = typing.get_type_hints(cls)
    kwargs = {f.name: f"{f.name}-0_x" if f.name in ID_FIELDS else sample(hints[f.name])
              for f in dataclasses.fields(cls) if f.name not in ("producer", "event_id", "ts_ms")}
    return cls(producer=PRODUCER, **kwargs)


def packed(data: dict[str, Any]) -> dict[bytes, bytes]:
    return {FIELD: msgpack.packb(data, use_bin_type=True)}


def valid_dict() -> dict[str, Any]:
    return make(EngineLaunching).to_dict()


@pytest.mark.parametrize("cls", sorted(event_types().values(), key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_every_event_type_survives_an_encode_decode_round_trip(cls: type[Event]) -> None:
    event = make(cls)
    fields = encode(event)
    assert list(fields) == [FIELD]
    back = decode(fields)
    assert back == event
    assert type(back) is cls
    assert back.type == cls.__name__
    assert decode_as(cls, fields) == event


def test_the_catalogue_covers_the_design_brief() -> None:
    names = set(event_types())
    assert {"EngineLaunching", "EngineReady", "EngineUnhealthy", "EngineRestarting", "EngineStopped",
            "EngineOffloaded", "EngineOnloaded", "WeightsPublished", "WeightUpdateStarted", "WeightsApplied",
            "WeightUpdateFailed", "WeightVersionServing", "RolloutRequested", "RolloutStarted",
            "RolloutCompleted", "RolloutFailed", "BatchReady", "TrainerJoined", "BatchConsumed",
            "TrainStepDone"} <= names


def test_the_header_is_on_the_wire_and_defaults_are_filled_in() -> None:
    event = EngineOffloaded(producer=PRODUCER, engine_id="e1", tags=["kv"])
    data = msgpack.unpackb(encode(event)[FIELD])
    assert data["type"] == "EngineOffloaded"
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["producer"] == {"role": "tester", "instance": "host-0"}
    assert data["event_id"] == event.event_id and len(event.event_id) == 32
    assert isinstance(data["ts_ms"], int)
    defaulted = {k: v for k, v in make(OffloadEngines).to_dict().items() if k != "engine_ids"}
    assert decode(packed(defaulted)).engine_ids is None  # type: ignore[attr-defined]


def test_a_string_keyed_fields_map_decodes_too() -> None:
    event = make(RolloutCompleted)
    assert decode({"e": encode(event)[FIELD]}) == event


def test_an_int_where_a_float_is_expected_is_accepted() -> None:
    data = make(RolloutCompleted).to_dict() | {"duration_ms": 3}
    assert decode(packed(data)).duration_ms == 3  # type: ignore[attr-defined]


def _without(key: str) -> dict[str, Any]:
    data = valid_dict()
    del data[key]
    return data


MALFORMED: dict[str, tuple[Any, str]] = {
    "unknown type": (packed(valid_dict() | {"type": "EngineExploded"}), "unknown event type 'EngineExploded'"),
    "no type": (packed(_without("type")), "unknown event type None"),
    "base class as type": (packed(valid_dict() | {"type": "Event"}), "unknown event type 'Event'"),
    "newer schema version": (packed(valid_dict() | {"schema_version": SCHEMA_VERSION + 1}),
                             f"schema_version {SCHEMA_VERSION + 1}, expected 1 or 2"),
    "version 2 without seq": (packed(_without("seq")), "missing field 'seq'"),
    "version 1 with seq": (packed(valid_dict() | {"schema_version": 1}), "schema_version 1 has no field 'seq'"),
    "negative seq": (packed(valid_dict() | {"seq": -3}), "field 'seq' is -3"),
    "path in an id field": (packed(make(BatchReady).to_dict() | {"batch_id": "../x"}), "field 'batch_id' is '../x'"),
    "dot-dot as an id": (packed(make(BatchReady).to_dict() | {"batch_id": ".."}), "field 'batch_id' is '..': character '.' at position 1 is not allowed"),
    "slash in a policy": (packed(make(BatchReady).to_dict() | {"policy": "a/b"}), "field 'policy'"),
    "housekeeping event at version 1": (packed({k: v for k, v in make(GroupExpired).to_dict().items() if k != "seq"}
                                               | {"schema_version": 1}), "expected 2"),
    "schema version as string": (packed(valid_dict() | {"schema_version": "1"}), "schema_version '1'"),
    "no schema version": (packed(_without("schema_version")), "schema_version None"),
    "missing field": (packed(_without("engine_id")), "missing field 'engine_id'"),
    "missing producer": (packed(_without("producer")), "missing field 'producer'"),
    "wrong field type": (packed(valid_dict() | {"engine_id": 7}), "field 'engine_id' has int"),
    "bool where int": (packed(make(RolloutCompleted).to_dict() | {"n_samples": True}), "field 'n_samples' has bool"),
    "bad list item": (packed(make(EngineOffloaded).to_dict() | {"tags": ["a", 1]}), "field 'tags' has list"),
    "bad map value": (packed(make(RolloutCompleted).to_dict() | {"metrics": {"loss": "x"}}), "field 'metrics'"),
    "producer not a map": (packed(valid_dict() | {"producer": "me"}), "producer must be"),
    "producer missing instance": (packed(valid_dict() | {"producer": {"role": "r"}}), "producer must be"),
    "non-msgpack bytes": ({FIELD: b"\xc1\xc1\xc1 not msgpack"}, "not msgpack"),
    "truncated msgpack": ({FIELD: encode(make(EngineLaunching))[FIELD][:-3]}, "not msgpack"),
    "trailing bytes": ({FIELD: encode(make(EngineLaunching))[FIELD] + b"\x00"}, "not msgpack"),
    "msgpack not a map": ({FIELD: msgpack.packb([1, 2, 3])}, "not a msgpack map"),
    "int map keys": ({FIELD: msgpack.packb({1: 2})}, "not msgpack"),
    "oversize": ({FIELD: b"\x00" * (MAX_EVENT_BYTES + 1)}, "exceeds the 1048576-byte limit"),
    "no event field": ({b"x": b"y"}, "no 'e' field"),
    "empty entry": ({}, "no 'e' field"),
    "event field not bytes": ({FIELD: 12}, "not bytes"),
    "fields not a map": ([(FIELD, b"")], "must be a map"),
    "fields none": (None, "must be a map"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_entry_raises_only_decode_error_with_a_clear_reason(case: str) -> None:
    fields, reason = MALFORMED[case]
    with pytest.raises(DecodeError) as info:
        decode(fields)
    assert type(info.value) is DecodeError
    assert reason in info.value.reason
    assert info.value.raw is fields


def test_decode_as_rejects_another_event_type() -> None:
    with pytest.raises(DecodeError, match="expected RolloutCompleted, got EngineLaunching"):
        decode_as(RolloutCompleted, encode(make(EngineLaunching)))


def test_an_event_too_large_for_consumers_is_refused_at_encode() -> None:
    event = EngineOffloaded(producer=PRODUCER, engine_id="e", tags=["x" * MAX_EVENT_BYTES])
    with pytest.raises(InvalidRequest, match="exceeds"):
        encode(event)


def test_an_event_of_schema_version_1_still_decodes_with_an_unknown_sequence_number() -> None:
    data = {k: v for k, v in valid_dict().items() if k != "seq"} | {"schema_version": 1}
    event = decode(packed(data))
    assert isinstance(event, EngineLaunching) and event.seq == 0
    assert decode(encode(event)) == event  # and goes out again as version 2, seq 0


def test_an_event_has_no_sequence_number_until_published_and_its_slot_is_found_in_any_map_size() -> None:
    small = EngineOffloaded(producer=PRODUCER, engine_id="e", tags=[])
    assert small.seq == 0 and decode(encode(small)).seq == 0
    big = msgpack.packb({"seq": 0, **{f"k{i}": i for i in range(20)}})  # a map of 16 or more: 3-byte header
    for raw in (encode_bytes(small), encode_bytes(dataclasses.replace(make(GroupExpired), seq=0)), big):
        slot = seq_slot(raw)
        assert slot > 0 and raw[slot - 1] == 0
        stamped = raw[:slot - 1] + b"\xcd\x01\x2c" + raw[slot:]  # what the publish script writes: 300
        assert msgpack.unpackb(stamped)["seq"] == 300
        assert seq_slot(stamped) == 0  # a numbered event keeps its number
    with pytest.raises(ValueError, match="seq must be >= 0"):
        EngineOffloaded(producer=PRODUCER, engine_id="e", tags=[], seq=-1)
