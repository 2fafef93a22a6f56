"""A durable write its replicas cannot confirm waits, visibly and within a bound, instead of failing its role:
on a real redis-server whose replica is missing (``WAIT`` comes back short), then attached."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from rollout_bus.events.connection import DURABLE_WAITING, Durability, connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.errors import ReplicationTimeout
from rollout_bus.events.metrics import bus_snapshot
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import EngineReady, Producer
from rollout_bus.status import render
from tests.support.procs import wait_for

pytestmark = pytest.mark.integration
PRODUCER = Producer("trainer", "t0")


@pytest.fixture()
def primary() -> Iterator[RedisServer]:
    """A primary of this test's own: a replica attached to it must not outlive the test."""
    with RedisServer() as server:
        yield server


def test_a_durable_write_short_of_replicas_waits_with_a_visible_status_and_completes_once_a_replica_attaches(
        primary: RedisServer, keys: Keys) -> None:
    client = connect(primary.url)
    publisher = Publisher(client, keys, PRODUCER)
    publisher.durability = Durability(replicas=1, timeout_ms=50, attempts=2, wait_s=60)
    outcome: dict[str, Any] = {}

    def write() -> None:
        try:
            outcome["id"] = publisher.publish(keys.weight_stream("default"), EngineReady(producer=PRODUCER, engine_id="e",
                                                                              url="u"), durable=True)
        except Exception as exc:
            outcome["error"] = exc
    writer = threading.Thread(target=write)
    writer.start()
    replica = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(primary.port)])
    try:
        wait_for("the write to report itself degraded", lambda: client.hexists(keys.durability_status, str(PRODUCER)))
        assert writer.is_alive() and not outcome  # waiting, not failed: its tries (2 x 50 ms) are long spent
        assert DURABLE_WAITING._value.get() == 1
        shown = render(bus_snapshot(client, keys))
        assert "DURABILITY DEGRADED" in shown and f"publish to {keys.weight_stream('default')}" in shown and "0/1" in shown
        replica.start()
        writer.join(30)
        assert not writer.is_alive() and "error" not in outcome, outcome
        assert client.xrange(keys.weight_stream("default"))[0][0].decode() == outcome["id"]  # one entry: the retries added none
        assert client.xlen(keys.weight_stream("default")) == 1
        assert not client.hexists(keys.durability_status, str(PRODUCER))  # the status is gone with the wait
        assert DURABLE_WAITING._value.get() == 0
        assert "DURABILITY DEGRADED" not in render(bus_snapshot(client, keys))
    finally:
        writer.join(60)
        replica.stop()
        publisher.close()
        client.close()


def test_a_durable_write_still_unconfirmed_at_its_bound_fails_with_the_reason(
        redis_client: redis.Redis, keys: Keys) -> None:
    publisher = Publisher(redis_client, keys, PRODUCER)
    publisher.durability = Durability(replicas=1, timeout_ms=20, attempts=1, wait_s=0.8)
    started = time.monotonic()
    with pytest.raises(ReplicationTimeout, match=r"only 0 of 1 replica.*1 tries and 0.8s degraded"):
        publisher.publish(keys.weight_stream("default"), EngineReady(producer=PRODUCER, engine_id="e", url="u"), durable=True)
    assert 0.8 <= time.monotonic() - started < 5
    assert not redis_client.hexists(keys.durability_status, str(PRODUCER))
    publisher.close()
