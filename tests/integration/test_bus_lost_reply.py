"""A reply lost on the real connection path (the consumer's kept ``Lane`` through a TCP proxy)."""

from __future__ import annotations

import pytest
import redis

from rollout_bus.events.connection import Guard, ReconnectPolicy, connect
from rollout_bus.events.consume import Consumer, ConsumerConfig
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import EngineReady, Producer
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.integration
PRODUCER = Producer("test", "0")


def test_a_lost_xreadgroup_reply_counts_as_an_outage_and_its_entries_come_back_on_the_next_read(
        proxy: TcpProxy, redis_client: redis.Redis, keys: Keys) -> None:
    client = connect(proxy.url)
    guard = Guard(client, ReconnectPolicy(base_s=0.01), name="lost reply")
    # a claim idle far beyond the test: only pending recovery can bring the entries back
    c = Consumer(client, keys, keys.engine_stream, "g", "c0",
                 ConsumerConfig(block_ms=50, claim_idle_ms=600_000), guard=guard)
    assert c._lane.direct  # the hot path: packed commands on the kept connection
    c.ensure_group()
    assert c.read() == []  # past the first read, which pages through the (empty) own pending list
    pub = Publisher(redis_client, keys, PRODUCER)
    ids = [pub.publish(keys.engine_stream, EngineReady(producer=PRODUCER, engine_id=f"e{i}", url="u"))
           for i in range(3)]

    proxy.drop_next_reply(b"XREADGROUP")
    assert c.read() == []
    assert proxy.dropped == 1  # the fault happened: Redis delivered, the reply died with the connection
    rows = redis_client.xpending_range(keys.engine_stream, "g", min="-", max="+", count=10)
    assert [(r["message_id"].decode(), r["consumer"]) for r in rows] == [(i, b"c0") for i in ids]
    assert guard.outages == 1  # the lost reply is an outage, not a silent re-send

    again = c.read()
    assert [m.id for m in again] == ids
    assert all(m.deliveries == 2 for m in again)
    client.close()
