"""Redis Sentinel: a primary, one replica and three sentinels as local ``redis-server`` processes.

Durable writes (``Publisher.publish(durable=True)``, ``BatchChannel.publish``) are acknowledged
only once the replica has them; the primary is SIGKILLed at a seeded random moment while they
run, and every write acknowledged to its caller is on the new primary afterwards. Bad input gets
a clear error in bounded time: an unknown master name, a plain Redis given as a sentinel, a
replica that never acknowledges.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.connection import connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.errors import InvalidRequest, ReplicationTimeout
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import Producer, TrainerJoined, decode
from tests.support.sentinel import MASTER, SentinelCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SEED = int(os.environ.get("ROLLOUT_BUS_SENTINEL_SEED", "1414"))


@pytest.fixture()
def cluster() -> Iterator[SentinelCluster]:
    with SentinelCluster() as c:
        yield c


def _event(i: int) -> TrainerJoined:
    return TrainerJoined(producer=Producer("trainer", "t0"), policy="p", trainer_id=f"t{i}", group="g")


def test_a_sentinel_client_writes_to_the_primary_and_durable_writes_reach_the_replica(
        cluster: SentinelCluster, keys: Keys) -> None:
    client = connect(cluster.url)
    publisher = Publisher(client, keys, Producer("trainer", "t0"))
    assert publisher.durability.replicas == 1  # a Sentinel deployment has a replica to wait for
    entry = publisher.publish(keys.weight_stream("default"), _event(0), durable=True)
    replica = next(s for s in cluster.servers if s.port != cluster.primary_port())
    import redis

    # acknowledged means the replica has it already: read it there, no waiting
    assert redis.Redis(port=replica.port).xrange(keys.weight_stream("default"))[0][0].decode() == entry
    publisher.close()
    client.close()


def test_an_unknown_master_name_is_refused_at_once_naming_the_known_ones(cluster: SentinelCluster) -> None:
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match=rf"no Sentinel knows a master named 'nosuch' .*'{MASTER}'"):
        connect(cluster.url.replace(f"/{MASTER}/", "/nosuch/"))
    assert time.monotonic() - started < 3


def test_a_plain_redis_given_as_a_sentinel_is_refused(redis_server: RedisServer) -> None:
    with pytest.raises(InvalidRequest, match="is not a Redis Sentinel"):
        connect(f"redis+sentinel://127.0.0.1:{redis_server.port}/{MASTER}/0")


def test_a_replica_that_never_acknowledges_is_a_clear_error_within_bounded_time(
        cluster: SentinelCluster, keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_BUS_WAIT_TIMEOUT_MS", "200")
    monkeypatch.setenv("ROLLOUT_BUS_WAIT_ATTEMPTS", "2")
    monkeypatch.setenv("ROLLOUT_BUS_WAIT_DEGRADED_S", "0")  # no degraded wait: the error at once
    client = connect(cluster.url)
    publisher = Publisher(client, keys, Producer("trainer", "t0"))
    channel = BatchChannel(client, keys, publisher=publisher)
    replica = next(s for s in cluster.servers if s.port != cluster.primary_port())
    assert replica.proc is not None
    os.kill(replica.proc.pid, signal.SIGSTOP)  # alive and connected, but it acknowledges nothing
    try:
        assert publisher.publish(keys.weight_stream("default"), _event(1))  # a write that need not survive is not held up
        started = time.monotonic()
        with pytest.raises(ReplicationTimeout, match=r"only 0 of 1 replica\(s\) acknowledged .* within 200 ms"):
            publisher.publish(keys.weight_stream("default"), _event(2), durable=True)
        assert time.monotonic() - started < 2  # two tries of 200 ms, and the round trips
        with pytest.raises(ReplicationTimeout, match="BatchReady p/b1"):
            channel.publish("p", "b1", {"x": torch.arange(4, dtype=torch.int32)})
    finally:
        os.kill(replica.proc.pid, signal.SIGCONT)
    # once the replica answers again, the retried publish is acknowledged and adds no second entry
    entry = publisher.publish(keys.weight_stream("default"), _event(2), durable=True, idempotency_key="e2")
    assert publisher.publish(keys.weight_stream("default"), _event(2), durable=True, idempotency_key="e2") == entry
    assert channel.publish("p", "b1", {"x": torch.arange(4, dtype=torch.int32)})
    assert client.xlen(keys.batch_stream("p")) == 1
    channel.close()
    publisher.close()
    client.close()


def test_every_acknowledged_durable_write_survives_a_primary_killed_at_a_random_moment(
        cluster: SentinelCluster, keys: Keys) -> None:
    rng = random.Random(SEED)
    kill_after = rng.uniform(0.3, 1.5)
    client = connect(cluster.url)
    publisher = Publisher(client, keys, Producer("trainer", "t0"))
    channel = BatchChannel(client, keys, publisher=publisher)
    acked: list[tuple[str, str]] = []  # (event id, entry id) acknowledged to the writer
    batches: list[str] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        i = 0
        try:
            while not stop.is_set():
                event = _event(i)
                acked.append((event.event_id, publisher.publish(keys.weight_stream("default"), event, durable=True)))
                channel.publish("p", f"b{i}", {"x": torch.full((8,), i, dtype=torch.int32)})
                batches.append(f"b{i}")
                i += 1
        except BaseException as exc:
            errors.append(exc)

    writer = threading.Thread(target=write, name="writer")
    writer.start()
    time.sleep(kill_after)
    before = len(acked)
    victim = cluster.kill_primary()  # asserts it died of SIGKILL
    new_port = cluster.wait_failover(victim.port)
    assert new_port != victim.port
    cluster.rejoin(victim, new_port)  # back on its port as a replica: durable writes have one to wait for
    deadline = time.monotonic() + 30
    while len(acked) < before + 20 and not errors and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    writer.join(30)
    assert not errors, errors
    assert len(acked) >= before + 20, "no writes acknowledged after the failover"
    print(f"seed {SEED}: killed the primary after {kill_after:.2f}s; {before} writes before, {len(acked)} in all; "
          f"new primary on port {new_port}")

    import redis

    primary = redis.Redis(port=new_port)
    stored = {decode(f).event_id: i.decode() for i, f in primary.xrange(keys.weight_stream("default"))}
    missing = [(e, i) for e, i in acked if e not in stored]
    assert not missing, f"{len(missing)} acknowledged events lost: {missing[:5]}"
    assert len(stored) <= len(acked) + 1  # beyond the acknowledged ones, at most the one in flight at the end
    events = [decode(f) for _, f in primary.xrange(keys.batch_stream("p"))]
    assert [e.batch_id for e in events][:len(batches)] == batches  # type: ignore[attr-defined]  # once each, in order
    for event in events:  # every acknowledged batch's payload is there, with its own bytes
        batch = channel.fetch(event)  # type: ignore[arg-type]
        assert int(batch.tensor("x")[0]) == int(event.batch_id[1:])  # type: ignore[attr-defined]
    channel.close()
    publisher.close()
    client.close()
