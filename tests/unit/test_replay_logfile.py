"""Log files: export a namespace, read it back lazily, import it elsewhere (on fakeredis)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from rollout_bus.events.consume import Consumer, ConsumerConfig
from rollout_bus.events.errors import DecodeError, PayloadMissing
from rollout_bus.events.names import Keys, logical_stream, stream_key
from rollout_bus.events.schema import (
    BatchReady,
    EngineServing,
    Producer,
    TrainerJoined,
    WeightsApplied,
    decode,
    encode,
)
from rollout_bus.replay import logfile
from rollout_bus.replay.exporter import Range, export_log, read_live
from rollout_bus.replay.importer import import_log
from rollout_bus.replay.logfile import LogEntry, LogReader, Payload, decode_entries, is_batch_ready
from rollout_bus.replay.timeline import timeline
from tests.unit.test_timeline import POLICY, publish_scenario, scenario


class DictStore:
    """A payload store in a dict: ``read`` by the ref's key, ``write`` under a new key."""

    def __init__(self, data: dict[str, bytes] | None = None, prefix: str = "") -> None:
        self.data = data if data is not None else {}
        self.prefix = prefix

    def read(self, event: BatchReady) -> bytes:
        try:
            return self.data[event.payload["ref"]]
        except KeyError:
            raise PayloadMissing(event.batch_id) from None

    def write(self, event: BatchReady, data: bytes) -> dict[str, Any]:
        ref = self.prefix + event.batch_id
        self.data[ref] = data
        return {**event.payload, "ref": ref}


@pytest.fixture()
def published(fake_client: redis.Redis, keys: Keys) -> list[str]:
    return publish_scenario(fake_client, keys, scenario())


def payloads_for(ids: list[str]) -> DictStore:
    return DictStore({f"batch-{i}": bytes([i]) * (1000 + i) for i in range(3)})


def test_an_export_holds_every_entry_in_id_order_with_payloads_before_their_batch(
        fake_client: redis.Redis, keys: Keys, published: list[str], tmp_path: Path) -> None:
    path = tmp_path / "run.rblog"
    stats = export_log(fake_client, keys, path, payloads=payloads_for(published))
    assert sum(stats.entries.values()) == len(published) and stats.payloads == 3
    with LogReader(path) as reader:
        assert reader.header.namespace == keys.namespace
        assert {r.stream for r in reader.header.ranges} == {
            "engines", f"weights/{POLICY}", "rollouts", "trainers", f"batches/{POLICY}"}
        records = list(reader)
        assert reader.complete
    entries = [r for r in records if isinstance(r, LogEntry)]
    assert [e.id for e in entries] == sorted(published, key=logfile.id_key)
    for i, rec in enumerate(records):
        if isinstance(rec, Payload):
            nxt = records[i + 1]
            assert isinstance(nxt, LogEntry) and nxt.id == rec.entry_id
            assert rec.data == bytes([int(rec.batch_id[-1])]) * (1000 + int(rec.batch_id[-1]))


def test_importing_into_another_namespace_keeps_ids_and_rebuilds_the_same_timeline(
        fake_client: redis.Redis, keys: Keys, published: list[str], tmp_path: Path) -> None:
    path = tmp_path / "run.rblog"
    export_log(fake_client, keys, path, payloads=payloads_for(published))
    other = Keys(keys.namespace + "-copy")
    sink = DictStore()
    stats = import_log(fake_client, other, path, payloads=sink)
    assert all(stats.ids_preserved.values()) and stats.payloads == 3 and stats.rewritten_refs == 0
    for logical in stats.entries:
        assert [i for i, _ in fake_client.xrange(stream_key(other, logical))] == [
            i for i, _ in fake_client.xrange(stream_key(keys, logical))]
    assert sink.data == payloads_for(published).data
    original = timeline(decode_entries(read_live(fake_client, keys))).to_dict()
    assert timeline(decode_entries(read_live(fake_client, other))).to_dict() == original
    with LogReader(path) as reader:
        assert timeline(reader.events()).to_dict() == original


def test_a_sink_that_stores_under_a_new_reference_gets_the_batch_entry_rewritten(
        fake_client: redis.Redis, keys: Keys, published: list[str], tmp_path: Path) -> None:
    path = tmp_path / "run.rblog"
    export_log(fake_client, keys, path, payloads=payloads_for(published))
    other = Keys(keys.namespace + "-b")
    sink = DictStore(prefix="moved/")
    stats = import_log(fake_client, other, path, payloads=sink)
    assert stats.rewritten_refs == 3
    old = {decode(f).event_id: decode(f) for _, f in fake_client.xrange(keys.batch_stream(POLICY))}
    for _, fields in fake_client.xrange(other.batch_stream(POLICY)):
        event = decode(fields)
        assert isinstance(event, BatchReady) and event.payload["ref"] == "moved/" + event.batch_id
        assert sink.read(event) == payloads_for(published).data[event.batch_id]
        assert event.ts_ms == old[event.event_id].ts_ms


def test_a_stream_that_already_holds_newer_entries_gets_new_ids_in_the_same_order(
        fake_client: redis.Redis, keys: Keys, published: list[str], tmp_path: Path) -> None:
    path = tmp_path / "run.rblog"
    export_log(fake_client, keys, path, streams=[keys.engine_stream])
    other = Keys(keys.namespace + "-n")
    newer = fake_client.xadd(other.engine_stream, {b"e": b"already here"})
    stats = import_log(fake_client, other, path, restore_groups=True)
    assert stats.ids_preserved == {"engines": False}
    rows = fake_client.xrange(other.engine_stream)
    assert rows[0][0] == newer
    assert [decode(f).event_id for _, f in rows[1:]] == [
        decode(f).event_id for _, f in fake_client.xrange(keys.engine_stream)]


def test_an_import_cut_short_resumes_without_duplicates(
        fake_client: redis.Redis, keys: Keys, published: list[str], tmp_path: Path) -> None:
    path = tmp_path / "run.rblog"
    export_log(fake_client, keys, path, payloads=payloads_for(published))
    data = path.read_bytes()
    cut = tmp_path / "cut.rblog"
    cut.write_bytes(data[: len(data) * 2 // 3])
    other = Keys(keys.namespace + "-r")
    first = import_log(fake_client, other, cut, payloads=DictStore(), allow_truncated=True)
    second = import_log(fake_client, other, path, payloads=DictStore())
    assert second.skipped == sum(first.entries.values()) and all(second.ids_preserved.values())
    again = import_log(fake_client, other, path)
    assert again.skipped == len(published) and again.entries == {}
    assert timeline(decode_entries(read_live(fake_client, other))).to_dict() == timeline(
        decode_entries(read_live(fake_client, keys))).to_dict()


def test_a_time_range_exports_only_the_entries_in_it(
        fake_client: redis.Redis, keys: Keys, published: list[str]) -> None:
    ordered = sorted(published, key=logfile.id_key)
    lo, hi = logfile.id_ms(ordered[5]), logfile.id_ms(ordered[20])
    buf = io.BytesIO()
    export_log(fake_client, keys, buf, rng=Range.by_time(lo, hi))
    path_entries = list(read_back(buf))
    assert [e.id for e in path_entries] == [i for i in ordered if lo <= logfile.id_ms(i) <= hi]


def read_back(buf: io.BytesIO) -> list[LogEntry]:
    unpacker = msgpack.Unpacker(io.BytesIO(buf.getvalue()), raw=False, strict_map_key=False)
    return [LogEntry(r["stream"], r["id"], r["fields"]) for r in unpacker if r["kind"] == "entry"]


def test_a_missing_payload_is_reported_and_its_entry_still_exported(
        fake_client: redis.Redis, keys: Keys, published: list[str], tmp_path: Path) -> None:
    store = payloads_for(published)
    del store.data["batch-1"]
    stats = export_log(fake_client, keys, tmp_path / "x.rblog", payloads=store)
    assert stats.missing_payloads == ["batch-1"] and stats.payloads == 2
    assert stats.entries[f"batches/{POLICY}"] == 3


def test_big_payloads_travel_in_parts_and_come_back_whole(
        fake_client: redis.Redis, keys: Keys, published: list[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logfile, "PART_BYTES", 100)
    store = payloads_for(published)
    store.data["batch-2"] = bytes(range(256)) * 3
    path = tmp_path / "big.rblog"
    export_log(fake_client, keys, path, payloads=store)
    with LogReader(path) as reader:
        got = {p.batch_id: p.data for p in reader if isinstance(p, Payload)}
    assert got == store.data


def test_truncated_corrupt_or_foreign_files_raise_decode_errors(
        fake_client: redis.Redis, keys: Keys, published: list[str], tmp_path: Path) -> None:
    path = tmp_path / "run.rblog"
    export_log(fake_client, keys, path, payloads=payloads_for(published))
    data = path.read_bytes()
    cut = tmp_path / "cut.rblog"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(DecodeError, match="truncated"), LogReader(cut) as reader:
        list(reader)
    with LogReader(cut, allow_truncated=True) as reader:
        assert 0 < len(list(reader.entries())) < len(published)
        assert not reader.complete
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(msgpack.packb({"kind": "header", "format": "other"}))
    with pytest.raises(DecodeError, match="not a rollout-bus-log"):
        LogReader(foreign)
    corrupt = tmp_path / "corrupt.rblog"
    corrupt.write_bytes(data.replace(bytes([1]) * 1001, bytes([9]) * 1001))
    with pytest.raises(DecodeError, match="payload of batch batch-1 is corrupt"), LogReader(corrupt) as reader:
        list(reader)


def test_groups_are_recreated_at_their_first_unacknowledged_entry(
        fake_client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    steps = [st for st in scenario() if st[0] == f"batches/{POLICY}"]
    publish_scenario(fake_client, keys, steps)
    group = Consumer(fake_client, keys, keys.batch_stream(POLICY), "trainer-p0", "t0-0",
                     ConsumerConfig(block_ms=1, count=2, auto_ack=False))
    first_two = group.read()
    group.ack(first_two[0].id)  # the second stays pending
    path = tmp_path / "g.rblog"
    export_log(fake_client, keys, path)
    other = Keys(keys.namespace + "-g")
    stats = import_log(fake_client, other, path, restore_groups=True)
    assert stats.groups and fake_client.sismember(other.registered_groups(other.batch_stream(POLICY)), "trainer-p0")
    resumed = Consumer(fake_client, other, other.batch_stream(POLICY), "trainer-p0", "t0-0",
                       ConsumerConfig(block_ms=1, count=10))
    assert [m.id for m in resumed.read()] == [first_two[1].id, *[i.decode() for i, _ in
                                                                  fake_client.xrange(keys.batch_stream(POLICY))][2:]]


def test_logical_names_map_to_keys_and_back() -> None:
    keys = Keys("ns1")
    for logical in ("engines", "weights", "weights/p-0_x", "commands", "rollouts", "trainers", "dead-letters",
                    "batches/p-0_x"):
        assert logical_stream(keys, stream_key(keys, logical)) == logical
    assert stream_key(keys, "weights") == keys.legacy_weight_stream  # a log from before: where the controller reads
    with pytest.raises(ValueError):
        stream_key(keys, "weights/p.1")  # a policy name the grammar refuses never becomes a key
    with pytest.raises(ValueError):
        logical_stream(keys, Keys("ns2").engine_stream)
    with pytest.raises(ValueError):
        stream_key(keys, "nope")
    assert is_batch_ready(LogEntry("engines", "1-0", {})) is None


class LosesOneReply:
    """A client whose first pipeline is applied by the server but its reply is lost."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.lost = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = self.client.pipeline(*args, **kwargs)
        execute = pipe.execute

        def lose_once(**kw: Any) -> Any:
            result = execute(**kw)
            if not self.lost:
                self.lost = True
                raise redis.ConnectionError("reply lost")
            return result
        pipe.execute = lose_once  # type: ignore[method-assign]
        return pipe


def test_a_pipeline_resent_after_a_lost_reply_adds_each_entry_once(
        fake_client: redis.Redis, keys: Keys, published: list[str], tmp_path: Path) -> None:
    path = tmp_path / "run.rblog"
    export_log(fake_client, keys, path)
    other = Keys(keys.namespace + "-l")
    flaky = LosesOneReply(fake_client)
    stats = import_log(flaky, other, path)  # type: ignore[arg-type]
    assert flaky.lost and sum(stats.entries.values()) == len(published)
    assert sum(fake_client.xlen(stream_key(other, s)) for s in stats.entries) == len(published)


def test_events_of_one_millisecond_go_in_their_producers_order_live_and_in_the_exported_file(
        fake_client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    controller, trainer = Producer("controller", "c-1"), Producer("trainer", "t-1")
    applied = WeightsApplied(producer=controller, policy=POLICY, version=1, engine_id="e0", duration_ms=1.0, seq=4)
    joined = TrainerJoined(producer=trainer, policy=POLICY, trainer_id="t", group="t", seq=1)
    serving = EngineServing(producer=controller, engine_id="e0", url="u", versions={POLICY: 1}, seq=5)
    # one millisecond: the ids' sequence parts (one counter per stream) put them the other way round
    fake_client.xadd(keys.engine_stream, encode(serving), id="1000-0")  # type: ignore[arg-type]
    fake_client.xadd(keys.trainer_stream, encode(joined), id="1000-1")  # type: ignore[arg-type]
    fake_client.xadd(keys.weight_stream(POLICY), encode(applied), id="1000-7")  # type: ignore[arg-type]
    live = [e.event for e in decode_entries(read_live(fake_client, keys))]
    assert live == [joined, applied, serving]  # the controller's order; the rest keeps its place
    export_log(fake_client, keys, tmp_path / "run.rblog")
    with LogReader(tmp_path / "run.rblog") as reader:
        assert [e.event for e in reader.events()] == live


def test_the_cli_says_what_is_wrong_with_a_missing_or_damaged_log(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from rollout_bus.replay import cli

    assert cli.main(["verify", str(tmp_path / "missing.rblog")]) == 2
    assert "cannot use" in capsys.readouterr().err
    damaged = tmp_path / "damaged.rblog"
    damaged.write_bytes(b"\xc1 not msgpack \x00" * 8)
    for command in ("verify", "timeline", "feed"):
        assert cli.main([command, str(damaged)]) == 2
        assert "not a rollout-bus event log, or a damaged one" in capsys.readouterr().err
