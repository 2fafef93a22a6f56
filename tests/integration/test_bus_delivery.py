"""Delivery on a real redis-server: fan-out, dead letters, reclaiming, trimmed pending entries."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import msgpack
import pytest
import redis

from rollout_bus.events.consume import Consumer, ConsumerConfig, Message
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import EngineReady, Producer

pytestmark = pytest.mark.integration
PRODUCER = Producer("test", "0")


def publish(client: redis.Redis, keys: Keys, n: int, prefix: str = "e") -> list[str]:
    pub = Publisher(client, keys, PRODUCER)
    return [pub.publish(keys.engine_stream, EngineReady(producer=PRODUCER, engine_id=f"{prefix}{i}", url="u"))
            for i in range(n)]


def dead_letters(client: redis.Redis, keys: Keys) -> dict[str, dict[str, Any]]:
    out = {}
    for _, fields in client.xrange(keys.dead_letters):
        record = {k.decode(): v for k, v in fields.items()}
        out[record["entry_id"].decode()] = record
    return out


def test_fan_out_to_three_groups_gives_each_every_entry_exactly_once(
        redis_client: redis.Redis, keys: Keys) -> None:
    cfg = ConsumerConfig(block_ms=20, count=7)
    groups = {g: [Consumer(redis_client, keys, keys.engine_stream, g, f"{g}-{i}", cfg) for i in range(2)]
              for g in ("trainer-a", "trainer-b", "metrics")}
    for members in groups.values():
        members[0].ensure_group()
    ids = publish(redis_client, keys, 50)
    seen: dict[str, Counter[str]] = {g: Counter() for g in groups}
    for g, members in groups.items():
        while sum(seen[g].values()) < len(ids):  # the two members of a group take turns
            if not sum(m.process(lambda msg, g=g: seen[g].update([msg.id])) for m in members):
                break
    for g in groups:
        assert seen[g] == Counter(ids), g
        assert int(redis_client.xpending(keys.engine_stream, g)["pending"]) == 0


def test_a_poison_entry_ends_in_the_dead_letter_stream_after_n_deliveries_and_later_entries_flow(
        redis_client: redis.Redis, keys: Keys) -> None:
    cfg = ConsumerConfig(block_ms=10, claim_idle_ms=30, claim_every_ms=0, max_deliveries=3)
    consumer = Consumer(redis_client, keys, keys.engine_stream, "g", "c0", cfg)
    consumer.ensure_group()
    first = publish(redis_client, keys, 2, "ok")
    (poison,) = publish(redis_client, keys, 1, "poison")
    garbage = redis_client.xadd(keys.engine_stream, {b"e": b"\x92\xc1garbage"}).decode()
    wrong_version = redis_client.xadd(keys.engine_stream, {b"e": msgpack.packb(
        {"type": "EngineReady", "schema_version": 99})}).decode()
    later = publish(redis_client, keys, 3, "ok-later")
    attempts: list[int] = []
    handled: list[str] = []

    def handler(msg: Message) -> None:
        if msg.event.engine_id == "poison0":  # type: ignore[attr-defined]
            attempts.append(msg.deliveries)
            raise RuntimeError("always fails")
        handled.append(msg.id)

    consumer.process(handler)  # one read: garbage is dead-lettered at once, good entries pass it
    assert handled == first + later
    letters = dead_letters(redis_client, keys)
    assert set(letters) == {garbage, wrong_version}
    assert b"not msgpack" in letters[garbage]["reason"]
    assert letters[wrong_version]["reason"] == b"EngineReady: schema_version 99, expected 1 or 2"

    deadline = time.monotonic() + 10
    while poison not in dead_letters(redis_client, keys) and time.monotonic() < deadline:
        consumer.process(handler)
    letter = dead_letters(redis_client, keys)[poison]
    assert attempts == [1, 2, 3]
    assert letter["reason"] == b"delivered 4 times (max 3)"
    assert (letter["source"], letter["group"], letter["deliveries"]) == (keys.engine_stream.encode(), b"g", b"4")
    assert consumer.dead_lettered == 3
    assert int(redis_client.xpending(keys.engine_stream, "g")["pending"]) == 0
    after = publish(redis_client, keys, 2, "after")
    assert consumer.run_until_idle(handler) == 2
    assert handled[-2:] == after


def test_a_pending_entry_trimmed_away_is_acked_not_dead_lettered(redis_client: redis.Redis, keys: Keys) -> None:
    ids = publish(redis_client, keys, 3)
    cfg = ConsumerConfig(block_ms=10)
    assert len(Consumer(redis_client, keys, keys.engine_stream, "g", "c0", cfg).read()) == 3  # then "dies"
    redis_client.xdel(keys.engine_stream, ids[1])
    handled: list[str] = []
    restarted = Consumer(redis_client, keys, keys.engine_stream, "g", "c0", cfg)
    restarted.run_until_idle(lambda m: handled.append(m.id))
    assert handled == [ids[0], ids[2]]
    assert redis_client.xlen(keys.dead_letters) == 0
    assert int(redis_client.xpending(keys.engine_stream, "g")["pending"]) == 0


def test_idle_entries_behind_a_long_run_of_busy_ones_are_still_reclaimed(
        redis_client: redis.Redis, keys: Keys) -> None:
    ids = publish(redis_client, keys, 40)
    stream = keys.engine_stream
    busy = Consumer(redis_client, keys, stream, "g", "busy", ConsumerConfig(block_ms=10, count=40))
    assert len(busy.read()) == 40
    time.sleep(0.08)
    redis_client.xclaim(stream, "g", "busy", 0, ids[:30])  # the first 30 are fresh again; the last 10 idle
    helper = Consumer(redis_client, keys, stream, "g", "helper",
                      ConsumerConfig(block_ms=0, count=1, claim_idle_ms=60, claim_every_ms=0))
    helper._recovering = False
    claimed: list[str] = []
    for _ in range(6):  # XAUTOCLAIM scans 10 * COUNT entries a call: a scan from 0-0 each time finds none
        claimed += [m.id for m in helper.read()]
    assert claimed and set(claimed) <= set(ids[30:])
    assert claimed[0] == ids[30]
