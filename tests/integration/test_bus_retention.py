"""Retention trims acked entries by length and by age and keeps every entry a group still needs."""

from __future__ import annotations

import time

import pytest
import redis

from rollout_bus.events.consume import Consumer, ConsumerConfig
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.retention import StreamId, safe_trim_point, trim
from rollout_bus.events.schema import EngineReady, Producer, encode

pytestmark = pytest.mark.integration
PRODUCER = Producer("test", "0")
CFG = ConsumerConfig(block_ms=10, count=100)


def publish(client: redis.Redis, keys: Keys, n: int) -> list[str]:
    pub = Publisher(client, keys, PRODUCER)
    return [pub.publish(keys.engine_stream, EngineReady(producer=PRODUCER, engine_id=f"e{i}", url="u"))
            for i in range(n)]


def remaining(client: redis.Redis, stream: str) -> list[str]:
    return [e[0].decode() for e in client.xrange(stream)]


def group(client: redis.Redis, keys: Keys, name: str) -> Consumer:
    c = Consumer(client, keys, keys.engine_stream, name, f"{name}-0", CFG)
    c.ensure_group()
    return c


def test_trimming_by_length_removes_acked_entries_and_keeps_pending_ones(
        redis_client: redis.Redis, keys: Keys) -> None:
    c = group(redis_client, keys, "g")
    ids = publish(redis_client, keys, 10)
    c.read()  # all ten delivered
    c.ack(*ids[:6])
    assert trim(redis_client, keys, keys.engine_stream, max_len=0) == 6
    assert remaining(redis_client, keys.engine_stream) == ids[6:]
    c.ack(*ids[6:8])
    assert trim(redis_client, keys, keys.engine_stream, max_len=1) == 2
    assert remaining(redis_client, keys.engine_stream) == ids[8:]


def test_trimming_keeps_entries_a_group_has_not_read_yet(redis_client: redis.Redis, keys: Keys) -> None:
    fast, slow = group(redis_client, keys, "fast"), group(redis_client, keys, "slow")
    ids = publish(redis_client, keys, 10)
    fast.run_until_idle(lambda m: None)
    slow_msgs = slow.read(count=4)
    slow.ack(*[m.id for m in slow_msgs])
    assert trim(redis_client, keys, keys.engine_stream, max_len=2) == 4
    assert remaining(redis_client, keys.engine_stream) == ids[4:]
    assert [m.id for m in slow.read()] == ids[4:]


def test_the_oldest_pending_entry_of_any_group_bounds_the_trim(redis_client: redis.Redis, keys: Keys) -> None:
    a, b = group(redis_client, keys, "a"), group(redis_client, keys, "b")
    ids = publish(redis_client, keys, 8)
    a.run_until_idle(lambda m: None)
    b.read()
    b.ack(*(ids[:2] + ids[3:]))  # ids[2] stays pending in b, delivered but never acked
    assert safe_trim_point(redis_client, keys, keys.engine_stream) == StreamId.parse(ids[2])
    assert trim(redis_client, keys, keys.engine_stream, max_len=0) == 2
    assert remaining(redis_client, keys.engine_stream) == ids[2:]


def test_a_registered_group_that_does_not_exist_yet_keeps_everything(redis_client: redis.Redis, keys: Keys) -> None:
    a = group(redis_client, keys, "a")
    publish(redis_client, keys, 5)
    a.run_until_idle(lambda m: None)
    redis_client.sadd(keys.registered_groups(keys.engine_stream), "late-trainer")
    assert trim(redis_client, keys, keys.engine_stream, max_len=0) == 0
    assert redis_client.xlen(keys.engine_stream) == 5


def test_with_no_group_trimming_by_length_keeps_the_newest(redis_client: redis.Redis, keys: Keys) -> None:
    ids = publish(redis_client, keys, 10)
    assert trim(redis_client, keys, keys.engine_stream, max_len=7) == 3
    assert remaining(redis_client, keys.engine_stream) == ids[3:]
    assert trim(redis_client, keys, keys.engine_stream, max_len=2) == 5  # the short end is fetched from the top
    assert remaining(redis_client, keys.engine_stream) == ids[8:]
    assert trim(redis_client, keys, keys.engine_stream, max_len=5) == 0
    assert trim(redis_client, keys, keys.rollout_stream, max_len=0) == 0  # no such stream


def test_trimming_by_age_removes_old_acked_entries_and_keeps_old_unacked_ones(
        redis_client: redis.Redis, keys: Keys) -> None:
    stream = keys.engine_stream
    c = group(redis_client, keys, "g")
    now_ms = time.time_ns() // 1_000_000
    old = [redis_client.xadd(stream, encode(EngineReady(producer=PRODUCER, engine_id=f"old{i}", url="u")),  # type: ignore[arg-type]
                             id=f"{now_ms - 600_000 + i}-0").decode() for i in range(4)]
    new = publish(redis_client, keys, 3)
    msgs = c.read(count=2)  # old[0] and old[1] delivered; old[2:] not even read
    c.ack(msgs[0].id)
    assert trim(redis_client, keys, stream, max_age_ms=60_000) == 1
    assert remaining(redis_client, stream) == old[1:] + new
    c.run_until_idle(lambda m: None)  # reads and acks the rest; old[1] is still pending
    assert trim(redis_client, keys, stream, max_age_ms=60_000) == 0
    c.ack(msgs[1].id)
    assert trim(redis_client, keys, stream, max_age_ms=60_000) == 3
    assert remaining(redis_client, stream) == new
    assert trim(redis_client, keys, stream, max_age_ms=60_000, max_len=1) == 2
    assert remaining(redis_client, stream) == new[2:]
