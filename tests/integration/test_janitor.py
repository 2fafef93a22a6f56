"""The janitor on a real redis-server: retention that respects live groups, expired groups, every
payload kind swept, what it removed reported as events; and the active controller running it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis
import torch

from rollout_bus.controller.config import ControllerConfig
from rollout_bus.controller.service import InferenceController
from rollout_bus.events.batch import Ragged
from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.consume import Consumer, ConsumerConfig
from rollout_bus.events.janitor import Janitor, JanitorConfig
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.payload import FileStore, RedisStore, ShmStore
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import (
    BatchReady,
    EngineReady,
    GroupExpired,
    PayloadsSwept,
    Producer,
    StreamsTrimmed,
    decode,
    decode_as,
)
from tests.engine_proc import make_weights_dir
from tests.support.controller_driver import wait_until

pytestmark = pytest.mark.integration
PRODUCER = Producer("test", "janitor")


def housekeeping(client: redis.Redis, keys: Keys) -> list:  # type: ignore[type-arg]
    return [decode(f) for _, f in page(client, keys.housekeeping_stream)]


def tensors(i: int) -> dict[str, torch.Tensor | Ragged]:
    return {"tokens": Ragged.from_list([torch.arange(5, dtype=torch.int32)]), "x": torch.full((1,), float(i))}


def test_retention_trims_every_stream_but_never_past_an_unacked_entry_of_a_live_group(
        redis_client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(redis_client, keys, PRODUCER)
    for i in range(30):
        pub.publish(keys.engine_stream, EngineReady(producer=PRODUCER, engine_id=f"e{i}", url="u"))
    reader = Consumer(redis_client, keys, keys.weight_stream("default"), "slow", "c0", ConsumerConfig(block_ms=1, count=10))
    reader.ensure_group()
    ids = [pub.publish(keys.weight_stream("default"), EngineReady(producer=PRODUCER, engine_id=f"w{i}", url="u"))
           for i in range(30)]
    got = reader.read()
    reader.ack(*[m.id for m in got[:4]])  # acks 4, holds 6 unacked, 20 never delivered
    report = Janitor(redis_client, keys, pub, JanitorConfig(max_len=5)).run_once()
    assert redis_client.xlen(keys.engine_stream) == 5  # no group: trimmed to the limit
    assert [e[0].decode() for e in redis_client.xrange(keys.weight_stream("default"))] == ids[4:]  # stops at the first unacked
    assert report.trimmed == {"engines": 25, "weights/default": 4}
    (event,) = [e for e in housekeeping(redis_client, keys) if isinstance(e, StreamsTrimmed)]
    assert event.entries == {"engines": 25, "weights/default": 4}


def test_a_group_that_stopped_beating_expires_and_stops_holding_entries_and_payloads(
        redis_client: redis.Redis, keys: Keys) -> None:
    stream = keys.batch_stream("p0")
    cfg = ConsumerConfig(block_ms=1, group_ttl_s=0.3)
    gone = Consumer(redis_client, keys, stream, "left-trainer", "c0", cfg)
    live = Consumer(redis_client, keys, stream, "live-trainer", "c0", ConsumerConfig(block_ms=1, group_ttl_s=60))
    gone.ensure_group()
    live.ensure_group()
    channel = BatchChannel(redis_client, keys, RedisStore(redis_client, keys), Publisher(redis_client, keys, PRODUCER))
    for i in range(3):
        channel.publish("p0", f"b{i}", tensors(i))
    for msg in live.read():  # the live trainer reads, uses and releases all three
        channel.release(decode_as(BatchReady, msg.fields), "live-trainer")
        live.ack(msg.id)
    assert redis_client.zcard(keys.payload_index) == 3  # the group that left still holds every payload
    pub = Publisher(redis_client, keys, PRODUCER)
    assert Janitor(redis_client, keys, pub, JanitorConfig(max_len=0)).run_once().expired == []  # not lapsed yet
    gone.close()  # its consumers are gone: no beat
    time.sleep(0.4)
    live.read()  # the live group beats (a read)
    report = Janitor(redis_client, keys, pub, JanitorConfig(max_len=0)).run_once()
    assert [(e.stream, e.group, e.payloads_released) for e in report.expired] == [("batches/p0", "left-trainer", 3)]
    assert redis_client.smembers(keys.registered_groups(stream)) == {b"live-trainer"}
    assert [g["name"] for g in redis_client.xinfo_groups(stream)] == [b"live-trainer"]
    assert redis_client.zcard(keys.payload_index) == 0 and not list(redis_client.scan_iter(keys.payload("*")))
    assert redis_client.xlen(stream) == 0  # and retention could move on
    assert [type(e) for e in housekeeping(redis_client, keys)] == [GroupExpired, StreamsTrimmed]


def test_payloads_of_every_store_kind_older_than_the_limit_are_swept_and_reported(
        redis_client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    redis_client.sadd(keys.registered_groups(keys.batch_stream("p0")), "never-reads")
    pub = Publisher(redis_client, keys, PRODUCER)
    stores = [RedisStore(redis_client, keys), ShmStore(keys, tmp_path / "shm"), FileStore(tmp_path / "files", keys)]
    for i, store in enumerate(stores):
        BatchChannel(redis_client, keys, store, pub).publish("p0", f"b{i}", tensors(i))
    janitor = Janitor(redis_client, keys, pub, JanitorConfig(
        max_len=None, payload_max_age_s=0.001, payload_roots=(str(tmp_path / "shm"), str(tmp_path / "files"))))
    time.sleep(0.01)
    report = janitor.run_once()
    assert report.swept.payloads == {"redis": 1, "shm": 1, "file": 1}
    assert redis_client.zcard(keys.payload_index) == 0
    assert list((tmp_path / "files" / keys.namespace).iterdir()) == []
    assert [p.name for p in (tmp_path / "shm" / keys.namespace).iterdir() if p.is_file()] == []
    (event,) = [e for e in housekeeping(redis_client, keys) if isinstance(e, PayloadsSwept)]
    assert event.payloads == {"redis": 1, "shm": 1, "file": 1}


def test_the_active_controller_runs_the_janitor_on_a_timer_and_counts_what_it_removed(
        redis_client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    pub = Publisher(redis_client, keys, PRODUCER)
    for i in range(40):  # an engine log from earlier runs: a restarted controller would read it all
        pub.publish(keys.engine_stream, EngineReady(producer=PRODUCER, engine_id=f"old-{i}", url="u"))
    make_weights_dir(tmp_path / "root" / "base", seed=0)
    cfg = ControllerConfig(namespace=keys.namespace, num_engines=1, model_path=str(tmp_path / "root" / "base"),
                           weights_root=str(tmp_path / "root"), log_dir=str(tmp_path / "logs"),
                           janitor_interval_s=0.2, retention_max_len=10)

    async def scenario() -> float:
        ctl = InferenceController(cfg, redis_client)
        await ctl.start()
        counter = ctl.core.metrics.janitor_removed.labels("stream_entries", "engines")
        try:  # the counter moves once the pass is over, after the trim itself
            await asyncio.to_thread(wait_until, "the janitor's trim counted", lambda: counter._value.get() >= 30, 20)
            assert redis_client.xlen(keys.engine_stream) <= 10
            return float(counter._value.get())
        finally:
            await ctl.stop()

    removed = asyncio.run(scenario())
    assert removed >= 30
    trimmed = [e for e in housekeeping(redis_client, keys) if isinstance(e, StreamsTrimmed)]
    assert sum(e.entries.get("engines", 0) for e in trimmed) >= removed  # a pass cut short by the stop still reports
