"""Replay: page through a stream from an id or a time, or read it all again through a fresh group."""

from __future__ import annotations

import dataclasses
import time

import pytest
import redis

from rollout_bus.events.consume import Consumer, ConsumerConfig, Message
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page, page_since
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import EngineReady, Event, Producer, decode

pytestmark = pytest.mark.integration
PRODUCER = Producer("test", "0")


def publish(client: redis.Redis, keys: Keys, names: list[str]) -> tuple[list[str], list[Event]]:
    """The entry ids and the events as they read back: the publish script numbers a producer's events 1, 2, ..."""
    pub = Publisher(client, keys, PRODUCER)
    events: list[Event] = [EngineReady(producer=PRODUCER, engine_id=n, url="u") for n in names]
    ids = [pub.publish(keys.engine_stream, e) for e in events]
    return ids, [dataclasses.replace(e, seq=i) for i, e in enumerate(events, 1)]


def test_paging_from_an_id_yields_every_later_entry_in_order(redis_client: redis.Redis, keys: Keys) -> None:
    ids, events = publish(redis_client, keys, [f"e{i}" for i in range(23)])
    got = list(page(redis_client, keys.engine_stream, ids[5], count=4))
    assert [i for i, _ in got] == ids[5:]
    assert [decode(f) for _, f in got] == events[5:]
    assert [i for i, _ in page(redis_client, keys.engine_stream, "(" + ids[5], ids[9], count=2)] == ids[6:10]
    assert [i for i, _ in page(redis_client, keys.engine_stream, count=5)] == ids
    assert [i for i, _ in page(redis_client, keys.engine_stream, count=23)] == ids  # the last page is full
    assert list(page(redis_client, keys.rollout_stream)) == []


def test_paging_from_a_time_yields_the_entries_added_since(redis_client: redis.Redis, keys: Keys) -> None:
    before, _ = publish(redis_client, keys, [f"a{i}" for i in range(7)])
    time.sleep(0.005)
    since_ms = time.time_ns() // 1_000_000
    time.sleep(0.005)
    after, _ = publish(redis_client, keys, [f"b{i}" for i in range(9)])
    assert [i for i, _ in page_since(redis_client, keys.engine_stream, since_ms, count=4)] == after
    assert [i for i, _ in page_since(redis_client, keys.engine_stream, 0, since_ms, count=3)] == before
    last_ms = int(after[-1].split("-")[0])
    assert [i for i, _ in page_since(redis_client, keys.engine_stream, last_ms, last_ms)] == [
        i for i in after if i.startswith(f"{last_ms}-")]


def test_a_fresh_group_reads_the_whole_stream_again(redis_client: redis.Redis, keys: Keys) -> None:
    cfg = ConsumerConfig(block_ms=10, count=6)
    live = Consumer(redis_client, keys, keys.engine_stream, "live", "live-0", cfg)
    live.ensure_group()
    ids, events = publish(redis_client, keys, [f"e{i}" for i in range(20)])
    assert live.run_until_idle(lambda m: None) == 20

    replayed: list[Message] = []
    replayer = Consumer(redis_client, keys, keys.engine_stream, "replay-1", "r-0", cfg)
    assert replayer.run_until_idle(replayed.append) == 20
    assert [m.id for m in replayed] == ids
    assert [m.event for m in replayed] == events

    from_id: list[str] = []
    partial = Consumer(redis_client, keys, keys.engine_stream, "replay-2", "r-0",
                       ConsumerConfig(block_ms=10, start_id=ids[11]))
    partial.run_until_idle(lambda m: from_id.append(m.id))
    assert from_id == ids[12:]  # a group starts after the id it is created at
    assert live.run_until_idle(lambda m: None) == 0  # replays do not disturb the live group
