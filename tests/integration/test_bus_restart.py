"""Redis restarted under a running publisher and consumer, with AOF on.

Both keep going on their own (their Guards reconnect); nothing acknowledged to the publisher
is lost, nothing is published twice, and entries pending before the restart are still
pending, to the same consumer, after it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rollout_bus.events.connection import Guard, ReconnectPolicy, connect
from rollout_bus.events.consume import Consumer, ConsumerConfig, Message
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import EngineReady, Producer, decode
from tests.support.procs import wait_for

pytestmark = pytest.mark.integration
PRODUCER = Producer("test", "0")
POLICY = ReconnectPolicy(max_wait_s=30, base_s=0.02, cap_s=0.2)
N_EVENTS = 300


class PublisherThread(threading.Thread):
    """Publishes ``N_EVENTS`` events one by one, recording what Redis acknowledged."""

    def __init__(self, url: str, keys: Keys) -> None:
        super().__init__(name="publisher", daemon=True)
        self.client = connect(url)
        self.publisher = Publisher(self.client, keys, PRODUCER, guard=Guard(self.client, POLICY, "publisher"))
        self.stream = keys.rollout_stream
        self.acked: dict[str, str] = {}  # event id -> entry id
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for i in range(N_EVENTS):
                event = EngineReady(producer=PRODUCER, engine_id=f"e{i}", url="u")
                self.acked[event.event_id] = self.publisher.publish(self.stream, event)
                time.sleep(0.001)
        except BaseException as exc:
            self.error = exc
        finally:
            self.client.close()


class ConsumerThread(threading.Thread):
    def __init__(self, url: str, keys: Keys) -> None:
        super().__init__(name="consumer", daemon=True)
        self.client = connect(url)
        self.consumer = Consumer(self.client, keys, keys.rollout_stream, "live", "live-0",
                                 ConsumerConfig(block_ms=100, count=16),
                                 guard=Guard(self.client, POLICY, "consumer"))
        self.consumer.ensure_group()
        self.seen: set[str] = set()
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.consumer.run(self.handle, self.stop)
        except BaseException as exc:
            self.error = exc
        finally:
            self.client.close()

    def handle(self, msg: Message) -> None:
        self.seen.add(msg.id)


@pytest.fixture()
def keys() -> Keys:
    return Keys("restart")


@pytest.fixture(params=[("shutdown", "everysec"), ("kill", "always")], ids=["shutdown-everysec", "kill-always"])
def aof_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[RedisServer, str]]:
    how, fsync = request.param
    server = RedisServer(appendonly=True, appendfsync=fsync, data_dir=tmp_path).start()
    yield server, how
    server.stop()


def test_publishers_and_consumers_ride_out_a_redis_restart_and_nothing_acknowledged_is_lost(
        aof_server: tuple[RedisServer, str], keys: Keys, caplog: pytest.LogCaptureFixture) -> None:
    server, how = aof_server
    caplog.set_level(logging.WARNING, logger="events")
    client = connect(server.url)
    stream = keys.rollout_stream

    holder = Consumer(client, keys, stream, "holders", "holder-0", ConsumerConfig(block_ms=10))
    holder.ensure_group()
    seed = Publisher(client, keys, PRODUCER)
    held_ids = [seed.publish(stream, EngineReady(producer=PRODUCER, engine_id=f"held{i}", url="u"))
                for i in range(5)]
    assert [m.id for m in holder.read()] == held_ids  # delivered, never acked: pending across the restart

    consumer = ConsumerThread(server.url, keys)
    publisher = PublisherThread(server.url, keys)
    consumer.start()
    publisher.start()
    try:
        wait_for("some events published", lambda: len(publisher.acked) >= 60)
        assert publisher.is_alive(), "the publisher finished before the outage: the test proved nothing"
        client.close()
        if how == "shutdown":
            server.shutdown()
        else:
            server.kill()
        time.sleep(0.3)  # publisher and consumer are both retrying now
        server.restart()
        publisher.join(30)
        assert not publisher.is_alive() and publisher.error is None, publisher.error
        acked_ids = set(publisher.acked.values())
        assert len(acked_ids) == N_EVENTS
        wait_for("the consumer to see every acknowledged entry", lambda: acked_ids <= consumer.seen)
    finally:
        consumer.stop.set()
        consumer.join(10)
    assert consumer.error is None, consumer.error

    entries = client.xrange(stream)
    in_stream = {e[0].decode(): decode(e[1]).event_id for e in entries}
    assert acked_ids <= set(in_stream)  # nothing acknowledged to the publisher is lost
    assert {in_stream[i] for i in acked_ids} == set(publisher.acked)
    assert len(in_stream) == N_EVENTS + len(held_ids)  # and nothing was published twice

    rows = client.xpending_range(stream, "holders", "-", "+", 100)
    assert [(r["message_id"].decode(), r["consumer"]) for r in rows] == [(i, b"holder-0") for i in held_ids]
    restarted_holder = Consumer(client, keys, stream, "holders", "holder-0", ConsumerConfig(block_ms=10))
    assert [(m.id, m.deliveries) for m in restarted_holder.read()] == [(i, 2) for i in held_ids]

    assert publisher.publisher.guard.outages >= 1 and consumer.consumer.guard.outages >= 1
    lines = [r.getMessage() for r in caplog.records]
    for who in ("publisher", "consumer"):
        assert any(line.startswith(f"{who}: connection to Redis lost") for line in lines), lines
        assert any(line.startswith(f"{who}: connection to Redis is back") for line in lines), lines
    assert not any("is gone" in line for line in lines), lines  # the group survived: no recreation
    client.close()


def test_a_restarted_server_comes_back_on_the_same_port_with_its_data(tmp_path: Path) -> None:
    with RedisServer(appendonly=True, appendfsync="always", data_dir=tmp_path) as server:
        port = server.port
        client = connect(server.url)
        client.set("k", "v")
        client.close()
        server.kill()
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(server.url, socket_connect_timeout=1).ping()
        server.restart()
        assert server.port == port
        client = connect(server.url)
        assert client.get("k") == b"v"
        with pytest.raises(RuntimeError, match="still running"):
            server.restart()
        client.close()
