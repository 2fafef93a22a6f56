"""A live run exported, imported into a fresh redis-server, replayed: the same numbers come out."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from rollout_bus.events import schema as s
from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.connection import connect
from rollout_bus.events.consume import Consumer, ConsumerConfig
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import weight_streams
from rollout_bus.events.train_data import TrainData, ragged
from rollout_bus.replay import cli as replay
from rollout_bus.replay.exporter import export_log, read_live
from rollout_bus.replay.feed import feed_batches
from rollout_bus.replay.importer import import_log
from rollout_bus.replay.logfile import LogReader, decode_entries
from rollout_bus.replay.payloads import payload_store
from rollout_bus.replay.timeline import timeline
from rollout_bus.replay.verify import verify
from tests.unit.test_timeline import (
    CTRL,
    POLICY,
    WEIGHTS,
    batch_ready,
    expected_final,
    publish_scenario,
    scenario,
)

pytestmark = pytest.mark.integration


def train_data(rollout_id: int, vmin: int, vmax: int, n: int = 4) -> TrainData:
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]][:n]
    responses = [[11 + i] * (i + 1) for i in range(n)]
    return TrainData(
        tokens=ragged([p + r for p, r in zip(prompts, responses, strict=True)], torch.int32),
        loss_masks=ragged([[1] * len(r) for r in responses], torch.int32),
        rollout_log_probs=ragged([[-0.5] * len(r) for r in responses], torch.float32),
        prompt_lengths=torch.tensor([len(p) for p in prompts], dtype=torch.int64),
        response_lengths=torch.tensor([len(r) for r in responses], dtype=torch.int64),
        rewards=torch.tensor([0.5, -0.5, 1.0, -1.0][:n], dtype=torch.float32),
        raw_reward=torch.tensor([1.0, 0.0, 1.0, 0.0][:n], dtype=torch.float32),
        truncated=torch.zeros(n, dtype=torch.int32),
        sample_indices=torch.arange(n, dtype=torch.int64),
        group_indices=torch.tensor([0, 0, 1, 1][:n], dtype=torch.int64),
        rollout_ids=torch.full((n,), rollout_id, dtype=torch.int64),
        weight_versions=torch.full((n,), vmin, dtype=torch.int64),
        weight_versions_max=torch.full((n,), vmax, dtype=torch.int64),
        metadata={"rollout_id": rollout_id})


class BatchWriter:
    """Publishes each scenario batch through the real ``BatchChannel`` (payload in the redis store)."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.channel = BatchChannel(client, keys)
        self.written: dict[str, TrainData] = {}

    def __call__(self, ev: s.BatchReady) -> str:
        data = train_data(ev.rollout_id, ev.min_weight_version, ev.max_weight_version)
        fields, meta = data.to_tensors()
        self.written[ev.batch_id] = data
        return self.channel.publish(ev.policy, ev.batch_id, fields, meta, rollout_id=ev.rollout_id,
                                    request_id=ev.request_id, min_weight_version=ev.min_weight_version,
                                    max_weight_version=ev.max_weight_version)


@pytest.fixture()
def target() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


def live_timeline(client: redis.Redis, keys: Keys) -> dict[str, object]:
    return timeline(decode_entries(read_live(client, keys))).to_dict()


def test_an_exported_run_imports_into_a_fresh_redis_and_replays_to_the_same_state(
        redis_client: redis.Redis, keys: Keys, target: RedisServer, tmp_path: Path) -> None:
    writer = BatchWriter(redis_client, keys)
    publish_scenario(redis_client, keys, scenario(), writer)
    trainer = Consumer(redis_client, keys, keys.batch_stream(POLICY), "trainer-p0", "t0-0",
                       ConsumerConfig(block_ms=1, count=2, auto_ack=False))
    read = trainer.read()
    trainer.ack(read[0].id)  # the second batch stays pending, the third undelivered

    path = tmp_path / "run.rblog"
    stats = export_log(redis_client, keys, path, payloads=payload_store(redis_client, keys))
    assert stats.payloads == 3 and not stats.missing_payloads

    other = Keys(keys.namespace + "-replayed")
    dest = connect(target.url)
    try:
        imported = import_log(dest, other, path, payloads=payload_store(dest, other), restore_groups=True)
        assert all(imported.ids_preserved.values()) and imported.payloads == 3

        live = live_timeline(redis_client, keys)
        assert live_timeline(dest, other) == live
        with LogReader(path) as reader:
            assert timeline(reader.events()).to_dict() == live
        assert verify(decode_entries(read_live(redis_client, keys))) == []
        assert verify(decode_entries(read_live(dest, other))) == []
        staleness = {b: v["staleness"] for b, v in live["batches"].items()}  # type: ignore[attr-defined]
        assert staleness == expected_final()["staleness"]

        # the imported references resolve, and the trainer's group resumes at its pending batch
        resumed = Consumer(dest, other, other.batch_stream(POLICY), "trainer-p0", "t0-0",
                           ConsumerConfig(block_ms=1, count=10))
        got = resumed.read()
        assert [m.id for m in got] == [m.id for m in read[1:]] + [
            i.decode() for i, _ in redis_client.xrange(keys.batch_stream(POLICY))][2:]
        for msg in got:
            assert isinstance(msg.event, s.BatchReady)
            back = TrainData.from_batch(BatchChannel(dest, other).fetch(msg.event))
            assert torch.equal(back.tokens.values, writer.written[msg.event.batch_id].tokens.values)
            assert BatchChannel(dest, other).readers(msg.event.payload["ref"]) == {"trainer-p0"}
    finally:
        dest.close()

    fed = list(feed_batches(path))
    assert [b for b, _, _ in fed] == ["batch-0", "batch-1", "batch-2"]
    for batch_id, fields, meta in fed:
        ready = meta.pop("batch_ready")
        back = TrainData.from_tensors(fields, meta)
        want = writer.written[batch_id]
        assert torch.equal(back.tokens.values, want.tokens.values) and back.metadata == want.metadata
        assert torch.equal(back.weight_versions_max, want.weight_versions_max)
        assert ready["policy"] == POLICY and ready["request_id"] == batch_id.replace("batch", "req")
    assert [b for b, _, _ in feed_batches(path)] == [b for b, _, _ in fed]  # deterministic


def timeless(value: object) -> object:
    """``value`` without what records when it happened (times, entry ids): what two runs of one scenario share."""
    if isinstance(value, dict):
        return {k: timeless(v) for k, v in value.items() if not (k.endswith("ms") or k.endswith("_id") and
                                                                  isinstance(v, str) and "-" in v)}
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], int):  # a history's (at ms, what)
        return timeless(value[1])
    if isinstance(value, list | tuple):
        return [timeless(v) for v in value]
    return value


def test_a_log_from_before_per_policy_weight_streams_imports_and_replays_like_one_of_now(
        redis_client: redis.Redis, keys: Keys, target: RedisServer, tmp_path: Path) -> None:
    """The same run logged twice: as the release before wrote it (every policy's weight events on the one
    ``weights`` stream) and as now (``weights/<policy>``). Each imports with its ids, the old one's weight events
    onto the legacy stream (which the controller still reads), and both replay to the same timeline."""
    old_keys, new_keys = Keys(keys.namespace + "-old"), Keys(keys.namespace + "-new")
    now = scenario()
    before = [("weights" if stream == WEIGHTS else stream, ev) for stream, ev in now]
    assert before != now
    publish_scenario(redis_client, old_keys, before)
    publish_scenario(redis_client, new_keys, now)
    logs = {name: tmp_path / f"{name}.rblog" for name in ("old", "new")}
    export_log(redis_client, old_keys, logs["old"])
    export_log(redis_client, new_keys, logs["new"])
    with LogReader(logs["old"]) as reader:
        assert "weights" in {r.stream for r in reader.header.ranges} and WEIGHTS not in {
            r.stream for r in reader.header.ranges}

    dest = connect(target.url)
    try:
        timelines = {}
        for name, path in logs.items():
            copy = Keys(f"{name}-copy")
            imported = import_log(dest, copy, path, restore_groups=True)
            assert all(imported.ids_preserved.values())
            timelines[name] = live_timeline(dest, copy)
            with LogReader(path) as reader:
                assert timeline(reader.events()).to_dict() == timelines[name]
            assert verify(decode_entries(read_live(dest, copy))) == []
            held = {st: dest.xlen(st) for st in weight_streams(dest, copy)}
            if name == "old":  # where the controller reads the publications of before
                assert list(held) == [copy.legacy_weight_stream] and held[copy.legacy_weight_stream] == len(
                    [st for st, _ in before if st == "weights"])
            else:
                assert list(held) == [copy.weight_stream(POLICY)]
        assert timeless(timelines["old"]) == timeless(timelines["new"])  # the same run: only its clock differs
        staleness = {b: v["staleness"] for b, v in timelines["old"]["batches"].items()}  # type: ignore[attr-defined]
        assert staleness == expected_final()["staleness"]
    finally:
        dest.close()


def test_the_cli_exports_imports_replays_and_flags_planted_violations(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys, target: RedisServer,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    publish_scenario(redis_client, keys, scenario(), BatchWriter(redis_client, keys))
    path = str(tmp_path / "cli.rblog")
    src = ["--redis-url", redis_server.url, "--namespace", keys.namespace]
    assert replay.main(["export", path, *src]) == 0
    assert json.loads(capsys.readouterr().out)["payloads"] == 3
    dst = ["--redis-url", target.url, "--namespace", "copy"]
    assert replay.main(["import", path, *dst]) == 0
    assert json.loads(capsys.readouterr().out)["payloads"] == 3

    assert replay.main(["timeline", path, "--json"]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert replay.main(["timeline", "--live", *dst, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == from_file
    assert replay.main(["timeline", path]) == 0
    assert "ENGINES" in capsys.readouterr().out
    assert replay.main(["verify", path]) == 0
    assert "ok: no violations" in capsys.readouterr().out
    assert replay.main(["feed", path, "--limit", "2"]) == 0
    assert [json.loads(line)["batch_id"] for line in capsys.readouterr().out.splitlines()] == ["batch-0", "batch-1"]

    writer = BatchWriter(redis_client, keys)
    publish_scenario(redis_client, keys, [
        ("engines", s.EngineServing(producer=CTRL, engine_id="e0", url="u", versions={POLICY: 9})),
        (f"batches/{POLICY}", batch_ready("batch-1b", "req-1", 1, 1, 1)),
        (WEIGHTS, s.WeightsPublished(producer=CTRL, policy=POLICY, version=1, uri="u", sha256="x"))], writer)
    fields, meta = train_data(4, 2, 5).to_tensors()  # its event claims versions 2..2; a sample has 5
    writer.channel.publish(POLICY, "batch-4", fields, meta, rollout_id=4, request_id="req-4",
                           min_weight_version=2, max_weight_version=2)
    bad = str(tmp_path / "bad.rblog")
    assert replay.main(["export", bad, *src]) == 0
    capsys.readouterr()
    assert replay.main(["verify", bad, "--json"]) == 1
    found = json.loads(capsys.readouterr().out)
    assert sorted(v["kind"] for v in found) == [
        "duplicate_batch", "version_backwards", "version_not_published", "version_not_published"]
    assert all(v["entries"] for v in found)
    sampled = next(v for v in found if v["ids"].get("batch_id") == "batch-4")
    assert sampled["ids"]["version"] == 5
    assert replay.main(["verify", bad, "--json", "--no-samples"]) == 1
    assert len(json.loads(capsys.readouterr().out)) == 3
    assert replay.main(["verify", "--live", *src]) == 1
    assert "duplicate_batch: request req-1 has 2 batches" in capsys.readouterr().out
