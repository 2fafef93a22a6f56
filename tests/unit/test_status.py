"""The status view and the bus gauges on a populated namespace (fakeredis)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from rq import Queue
from rq.serializers import JSONSerializer

from rollout_bus import status
from rollout_bus.events.consume import Consumer, ConsumerConfig
from rollout_bus.events.metrics import BusCollector, bus_snapshot, serve_metrics
from rollout_bus.events.names import Keys
from rollout_bus.events.registry import EngineRecord, EngineState, PolicyRecord, Registry
from tests.unit.test_timeline import POLICY, publish_scenario, scenario


@pytest.fixture()
def populated(fake_client: redis.Redis, keys: Keys) -> Keys:
    publish_scenario(fake_client, keys, scenario())
    reg = Registry(fake_client, keys)
    reg.put_engine(EngineRecord("e0", "http://h:1", EngineState.SERVING, versions={POLICY: 2}, load=3))
    reg.put_engine(EngineRecord("e1", "http://h:2", EngineState.PENDING_WEIGHTS, updating={POLICY: 2}))
    reg.put_policy(PolicyRecord(POLICY, published=2, serving=2, uri="file:///w/2"))
    trainer = Consumer(fake_client, keys, keys.batch_stream(POLICY), "trainer-p0", "t0-0",
                       ConsumerConfig(block_ms=1, count=2, auto_ack=False))
    got = trainer.read()
    trainer.ack(got[0].id)  # one acked, one pending, one not yet delivered
    trainer.dead_letter("1-1", {b"e": b"garbage"}, "not msgpack: boom", 1)
    queue = Queue(keys.rollout_queue, connection=fake_client, serializer=JSONSerializer)
    for i in range(3):
        queue.enqueue("builtins.len", [i], job_id=f"req-{i}")
    fake_client.zadd(queue.started_job_registry.key, {"req-9": time.time() + 60})
    fake_client.zadd(queue.failed_job_registry.key, {"req-8": time.time() + 60, "req-7": time.time() + 60})
    return keys


def test_the_snapshot_counts_streams_groups_queues_and_dead_letters(fake_client: redis.Redis, populated: Keys) -> None:
    snap = bus_snapshot(fake_client, populated)
    streams = {st.stream: st for st in snap.streams}
    assert set(streams) == {"engines", f"weights/{POLICY}", "rollouts", "trainers", f"batches/{POLICY}"}
    batches = streams[f"batches/{POLICY}"]
    assert batches.length == 3
    (group,) = batches.groups
    assert (group.name, group.consumers, group.pending, group.lag) == ("trainer-p0", 1, 1, 1)
    rollouts = next(q for q in snap.queues if q.name == populated.rollout_queue)
    assert (rollouts.queued, rollouts.started, rollouts.failed) == (3, 1, 2)
    assert snap.dead_letters == 1 and snap.recent_dead_letters[0]["reason"] == "not msgpack: boom"
    assert snap.engines["e0"].load == 3 and snap.policies[POLICY].serving == 2


def test_the_text_view_shows_every_section(fake_client: redis.Redis, populated: Keys) -> None:
    text = status.render(bus_snapshot(fake_client, populated))
    for heading in ("ENGINES", "POLICIES", "QUEUES", "STREAMS", "DEAD LETTERS 1"):
        assert heading in text
    lines = text.splitlines()
    e0 = next(line for line in lines if line.startswith("e0 "))
    assert "serving" in e0 and "p0=2" in e0 and "http://h:1" in e0
    assert any(line.startswith(f"batches/{POLICY}") and "trainer-p0" in line for line in lines)
    assert any(line.startswith(populated.rollout_queue) and line.split()[1:4] == ["3", "1", "2"] for line in lines)
    assert "not msgpack: boom" in text


def test_the_json_view_is_one_parseable_document(fake_client: redis.Redis, populated: Keys) -> None:
    doc = json.loads(status.as_json(bus_snapshot(fake_client, populated)))
    assert doc["namespace"] == populated.namespace
    assert doc["engines"]["e1"]["state"] == "pending_weights"
    assert doc["dead_letters"] == 1
    assert {q["name"] for q in doc["queues"]} == {populated.rollout_queue, populated.eval_queue}


def test_the_collector_exports_lag_pending_lengths_and_dead_letters(fake_client: redis.Redis, populated: Keys) -> None:
    registry = CollectorRegistry()
    registry.register(BusCollector(fake_client, populated))
    text = generate_latest(registry).decode()
    ns = populated.namespace
    assert f'rollout_bus_redis_up{{namespace="{ns}"}} 1.0' in text
    assert f'rollout_bus_group_lag{{group="trainer-p0",namespace="{ns}",stream="batches/p0"}} 1.0' in text
    assert f'rollout_bus_group_pending{{group="trainer-p0",namespace="{ns}",stream="batches/p0"}} 1.0' in text
    assert f'rollout_bus_stream_length{{namespace="{ns}",stream="batches/p0"}} 3.0' in text
    assert f'rollout_bus_dead_letters{{namespace="{ns}"}} 1.0' in text
    assert f'rollout_bus_queue_jobs{{namespace="{ns}",queue="{populated.rollout_queue}",state="failed"}} 2.0' in text
    assert f'rollout_bus_policy_version{{kind="serving",namespace="{ns}",policy="p0"}} 2.0' in text
    assert f'rollout_bus_engine_weight_version{{engine="e0",namespace="{ns}",policy="p0"}} 2.0' in text
    assert 'rollout_bus_engine_weight_version{engine="e1"' not in text  # no weights yet: no version


def test_an_empty_namespace_shows_empty_tables(fake_client: redis.Redis, keys: Keys) -> None:
    snap = bus_snapshot(fake_client, keys)
    assert snap.streams == [] and snap.dead_letters == 0
    assert "DEAD LETTERS 0" in status.render(snap)


def test_passwords_never_reach_the_output() -> None:
    assert status.redacted("redis://status:s3cret@redis:6379/0") == "redis://status:***@redis:6379/0"
    assert status.redacted("redis://h:1/0") == "redis://h:1/0"
    with pytest.raises(SystemExit):
        status.parse_args(["--watch", "0"])


def test_serve_metrics_serves_a_registry_and_the_multiprocess_one(
        fake_client: redis.Redis, populated: Keys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registry = CollectorRegistry()
    registry.register(BusCollector(fake_client, populated))
    server, _ = serve_metrics(0, addr="127.0.0.1", registry=registry)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5).read().decode()
        assert "rollout_bus_group_lag" in body
    finally:
        server.shutdown()
        server.server_close()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    server, _ = serve_metrics(0, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5) as reply:
            assert reply.status == 200
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("argv", "message"), [
    (["--engine", "e0"], "--engine goes with --check-weights"),
    (["--check-weights", "--watch", "2"], "--check-weights runs once"),
    (["--check-weights", "--engine", "../e0"], "engine id"),
])
def test_check_weights_arguments_that_make_no_sense_fail_saying_why(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        status.parse_args(argv)
    assert message in capsys.readouterr().err
