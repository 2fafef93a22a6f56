"""A restarted consumer pages through its own pending entries once, then reads new ones."""

from __future__ import annotations

import redis

from rollout_bus.events.consume import Consumer, ConsumerConfig
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import EngineStopped, Producer


def publish(pub: Publisher, keys: Keys, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        pub.publish(keys.engine_stream, EngineStopped(producer=pub.producer, engine_id=f"e{i}", reason="test"))


def test_held_pending_entries_are_handed_out_once_on_recovery_then_new_ones_flow(fake_client: redis.Redis) -> None:
    keys = Keys("recovery")
    pub = Publisher(fake_client, keys, Producer("test", "0"))
    config = ConsumerConfig(count=2, auto_ack=False, claim_idle_ms=60_000)
    publish(pub, keys, 3)
    first = Consumer(fake_client, keys, keys.engine_stream, "g", "c0", config)
    held = [m.id for m in first.read(block_ms=10, count=3)]
    assert len(held) == 3

    publish(pub, keys, 2, start=3)
    restarted = Consumer(fake_client, keys, keys.engine_stream, "g", "c0", config)
    seen: list[str] = []
    for _ in range(5):
        seen += [m.id for m in restarted.read(block_ms=10)]
    assert seen[:3] == held
    assert len(seen) == 5 and len(set(seen)) == 5


def test_recovery_reports_the_delivery_count_of_re_read_entries(fake_client: redis.Redis) -> None:
    keys = Keys("recovery2")
    pub = Publisher(fake_client, keys, Producer("test", "0"))
    config = ConsumerConfig(auto_ack=False, claim_idle_ms=60_000)
    publish(pub, keys, 1)
    Consumer(fake_client, keys, keys.engine_stream, "g", "c0", config).read(block_ms=10)
    (again,) = Consumer(fake_client, keys, keys.engine_stream, "g", "c0", config).read(block_ms=10)
    assert again.deliveries == 2
