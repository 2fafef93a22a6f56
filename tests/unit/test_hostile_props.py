"""Properties: hostile values at every event decoder, the train-data check and the replay log reader are
refused with the project's error (``DecodeError``) or accepted, never another exception."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rollout_bus.events.batch import Ragged, decode, encode
from rollout_bus.events.errors import DecodeError
from rollout_bus.events.schema import FIELD, Event, decode_as, event_types
from rollout_bus.events.schema import encode as encode_event
from rollout_bus.events.train_data import RAGGED_FIELDS, SCALAR_FIELDS, TrainData
from rollout_bus.replay.logfile import FORMAT, LogReader, LogWriter, decode_entries
from rollout_bus.replay.records import ReadLimits
from rollout_bus.replay.timeline import timeline
from tests.unit.test_schema import make
from tests.unit.test_schema_props import values

TYPES = sorted(event_types())
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                               HealthCheck.function_scoped_fixture])

hostile = st.one_of(
    st.sampled_from([0, -1, 2**63 - 1, -(2**63), 2**64 - 1, math.nan, math.inf, -math.inf, -0.0, 1e308, "", b"",
                     True, None, [], {}, "\x00", "../../etc", "a.b", "é" * 64, " ", "\n"]),
    st.text(max_size=300), st.binary(max_size=300), values,
    st.recursive(st.none(), lambda inner: st.lists(inner, max_size=2), max_leaves=60),  # deep, narrow nesting
)


# --- event decoders ----------------------------------------------------------------------------

@SETTINGS
@given(st.sampled_from(TYPES), st.data())
def test_hostile_field_values_at_every_event_decoder_are_refused_or_round_trip(type_name: str,
                                                                               data: st.DataObject) -> None:
    cls = event_types()[type_name]
    good = make(cls).to_dict()
    names = data.draw(st.lists(st.sampled_from(sorted(good)), min_size=1, max_size=4, unique=True))
    damaged = dict(good, **{name: data.draw(hostile) for name in names})
    try:
        raw = msgpack.packb(damaged, use_bin_type=True)
    except (OverflowError, ValueError):
        return  # not even msgpack: nothing could send it
    fields = {FIELD: raw}
    try:
        event = decode_as(cls, fields)
    except DecodeError as exc:
        assert exc.reason and exc.raw is fields
        return
    assert isinstance(event, cls)
    assert encode_event(decode_as(cls, encode_event(event))) == encode_event(event)


@SETTINGS
@given(st.sampled_from(TYPES), st.sampled_from(TYPES))
def test_an_event_of_another_type_is_refused_by_decode_as(asked: str, given_type: str) -> None:
    fields = encode_event(make(event_types()[given_type]))
    cls = event_types()[asked]
    if asked == given_type:
        assert isinstance(decode_as(cls, fields), Event)
    else:
        with pytest.raises(DecodeError, match=f"expected {asked}"):
            decode_as(cls, fields)


# --- the train-data check ----------------------------------------------------------------------

floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
ints = st.integers(-(2**31), 2**31 - 1)


@st.composite
def train_fields(draw: st.DrawFn) -> dict[str, Any]:
    """Wire fields of a batch of ``n`` samples, each value drawn to be plausible or hostile."""
    n = draw(st.integers(0, 4))
    prompts = draw(st.lists(st.integers(-2, 4), min_size=n, max_size=n))
    responses = draw(st.lists(st.integers(-2, 4), min_size=n, max_size=n))
    out: dict[str, Any] = {}
    for name, dtype in RAGGED_FIELDS.items():
        rows = [max(0, p) + max(0, r) for p, r in zip(prompts, responses, strict=True)] if name == "tokens" \
            else [max(0, r) for r in responses]
        if draw(st.booleans()):  # lengths that do not add up
            rows = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
        total = sum(rows)
        element = floats if dtype.is_floating_point else ints
        vals = draw(st.lists(element, min_size=total, max_size=total))
        offsets = torch.tensor([0, *torch.tensor(rows, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)
        out[name] = Ragged(torch.tensor(vals, dtype=dtype), offsets)
    for name, dtype in SCALAR_FIELDS.items():
        if name == "prompt_lengths":
            column: list[Any] = prompts
        elif name == "response_lengths":
            column = responses
        else:
            column = draw(st.lists(floats if dtype.is_floating_point else ints, min_size=n, max_size=n))
        size = draw(st.sampled_from([n, n, n, n + 1]))  # now and then a column of the wrong length
        out[name] = torch.tensor((column + [0] * size)[:size], dtype=dtype)
    return out


@SETTINGS
@given(train_fields(), st.sampled_from([None, "rewards", "tokens", "prompt_lengths"]))
def test_the_train_data_check_refuses_hostile_batches_or_accepts_only_sound_ones(
        fields: dict[str, Any], drop: str | None) -> None:
    if drop is not None:
        fields.pop(drop)
    try:
        data = TrainData.from_batch(decode(encode(fields, {}).tobytes()))
    except DecodeError as exc:
        assert exc.reason
        return
    for t in (data.rewards, data.raw_reward, data.rollout_log_probs.values):
        assert bool(torch.isfinite(t).all())
    assert bool((data.prompt_lengths >= 1).all()) and bool((data.response_lengths >= 0).all())
    assert data.tokens.values.numel() == 0 or int(data.tokens.values.min()) >= 0
    try:
        data.check_vocab(64)
    except DecodeError:
        assert int(data.tokens.values.max()) >= 64


# --- the replay log reader ---------------------------------------------------------------------

HEADER = {"kind": "header", "format": FORMAT, "format_version": 1, "namespace": "n", "created_ms": 0,
          "ranges": [{"stream": "engines", "start": "-", "end": "+", "length": 1, "groups": []}]}


def valid_log() -> bytes:
    from rollout_bus.replay.logfile import Header, LogEntry, StreamRange

    out = io.BytesIO()
    writer = LogWriter(out, Header("n", 0, [StreamRange("engines")]))
    for i, name in enumerate(TYPES[:6]):
        writer.entry(LogEntry("engines", f"{1000 + i}-0", encode_event(make(event_types()[name]))))
    writer.close()
    return out.getvalue()


VALID = valid_log()
record_values = st.dictionaries(st.sampled_from(["kind", "stream", "id", "fields", "entry_id", "batch_id", "ref",
                                                 "size", "sha256", "part", "parts", "data", "x"]),
                                st.one_of(hostile, st.sampled_from(["entry", "payload", "end", "engines", "1-0"])),
                                max_size=8)


def check_refused_or_read(tmp: Path, raw: bytes) -> None:
    path = tmp / "hostile.rblog"
    path.write_bytes(raw)
    try:
        with LogReader(path, allow_truncated=True, limits=ReadLimits(max_record_bytes=1 << 16,
                                                                     max_payload_bytes=1 << 16)) as reader:
            records = list(reader)
    except DecodeError as exc:
        assert exc.reason.startswith(str(path)) and "\n" not in exc.reason
        return
    timeline(decode_entries(r for r in records if not hasattr(r, "data")))


@SETTINGS
@given(st.lists(record_values, max_size=4), st.booleans())
@example([{"kind": "entry", "stream": "engines", "id": "18446744073709551615-18446744073709551615",
           "fields": {}}], True)
def test_hostile_records_after_a_valid_header_are_refused_or_read(tmp_path: Path, records: list[dict[str, Any]],
                                                                  end: bool) -> None:
    raw = msgpack.packb(HEADER, use_bin_type=True)
    try:
        raw += b"".join(msgpack.packb(r, use_bin_type=True) for r in records)
    except (OverflowError, ValueError):
        return
    check_refused_or_read(tmp_path, raw + (msgpack.packb({"kind": "end"}) if end else b""))


@SETTINGS
@given(st.data())
@example(None)
def test_damaged_or_cut_valid_logs_are_refused_or_read(tmp_path: Path, data: st.DataObject | None) -> None:
    raw = bytearray(VALID)
    if data is not None:
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    check_refused_or_read(tmp_path, bytes(raw))


@SETTINGS
@given(st.binary(max_size=512))
@example(b"\xdd\xff\xff\xff\xff")
@example(b"\x91" * 2000)
def test_random_bytes_after_a_valid_header_are_refused_or_read(tmp_path: Path, tail: bytes) -> None:
    check_refused_or_read(tmp_path, msgpack.packb(HEADER, use_bin_type=True) + tail)
