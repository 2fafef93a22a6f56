"""Forged ``BatchReady`` events on a real redis-server: a huge declared size or another batch's payload is
dead-lettered with its reason before anything is allocated or trained, and the trainer's client goes on."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import redis
import torch

from rollout_bus.events import schema as s
from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.errors import DecodeError, PayloadTooLarge
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.payload import FileStore, RedisStore, ShmStore
from rollout_bus.events.publish import Publisher
from rollout_bus.trainer.client import ClientConfig, RolloutClient
from tests.support.fake_rollouts import fake_batch

pytestmark = pytest.mark.integration

FORGER = s.Producer("trainer", "forger")


def client_of(redis_client: redis.Redis, keys: Keys, policy: str, **config: object) -> RolloutClient:
    rc = RolloutClient(redis_client, keys, ClientConfig(policy=policy, trainer_id=f"t-{policy}", group=f"g-{policy}",
                                                        start_id="0", block_ms=50, **config),  # type: ignore[arg-type]
                       s.Producer("trainer", f"t-{policy}"))
    rc.start()
    return rc


def publish(channel: BatchChannel, policy: str, rollout_id: int) -> s.BatchReady:
    fields, meta = fake_batch(2, 2, rollout_id=rollout_id, version=0, rng=random.Random(rollout_id)).to_tensors()
    entry = channel.publish(policy, f"b-{policy}-{rollout_id}", fields, meta, rollout_id=rollout_id,
                            request_id=f"q-{policy}-{rollout_id}")
    rows = channel.client.xrange(channel.keys.batch_stream(policy), min=entry, max=entry)
    return s.decode_as(s.BatchReady, rows[0][1])


def forge(redis_client: redis.Redis, keys: Keys, stream_policy: str, event: s.BatchReady) -> None:
    Publisher(redis_client, keys, FORGER).publish(keys.batch_stream(stream_policy), event)


def dead_letters(redis_client: redis.Redis, keys: Keys) -> list[str]:
    return [fields[b"reason"].decode() for _, fields in page(redis_client, keys.dead_letters)]


def received(rc: RolloutClient, want: int) -> list[str]:
    for _ in range(40):
        rc.poll()
        if len(rc.buffered()) >= want:
            break
    return [b.batch_id for b in rc.buffered()]


def test_a_batch_declaring_a_tebibyte_is_dead_lettered_before_any_allocation(redis_client: redis.Redis,
                                                                            keys: Keys) -> None:
    channel = BatchChannel(redis_client, keys)
    rc = client_of(redis_client, keys, "pa")
    try:
        real = publish(channel, "pa", 0)
        assert isinstance(channel.store, RedisStore) and channel.store._conn is not None  # the raw RESP path
        huge = 1 << 40
        ref = f"pa:b-pa-forged:{'ab' * 6}"
        forge(redis_client, keys, "pa", s.BatchReady(
            producer=FORGER, policy="pa", batch_id="b-pa-forged", rollout_id=1, request_id="q-pa-1", n_samples=4,
            min_weight_version=0, max_weight_version=0, bytes=1000,
            payload={"store": "redis", "ref": ref, "nbytes": huge, "chunks": huge // (1 << 20),
                     "chunk_bytes": 1 << 20}))
        publish(channel, "pa", 2)
        assert received(rc, 2) == [real.batch_id, "b-pa-2"]  # no MemoryError: the client went on
        reasons = dead_letters(redis_client, keys)
        assert len(reasons) == 1 and "b-pa-forged" in reasons[0] and "maximum batch size" in reasons[0]
        assert [b.batch_id for b in rc.refused()] == ["b-pa-forged"]
        assert redis_client.xpending(keys.batch_stream("pa"), "g-pa")["pending"] == 2  # the forged one is acked
    finally:
        rc.stop()
        channel.close()


def test_a_batch_pointing_at_another_policys_payload_is_refused_and_that_payload_survives(
        redis_client: redis.Redis, keys: Keys) -> None:
    channel = BatchChannel(redis_client, keys)
    ra, rb = client_of(redis_client, keys, "pa"), client_of(redis_client, keys, "pb")
    try:
        theirs = publish(channel, "pb", 0)
        # on A's stream: an event of A's pointing at B's bytes, and B's own event copied over
        forge(redis_client, keys, "pa", s.BatchReady(
            producer=FORGER, policy="pa", batch_id="b-pa-9", rollout_id=9, request_id="q-pa-9", n_samples=4,
            min_weight_version=0, max_weight_version=0, bytes=theirs.bytes, payload=theirs.payload))
        forge(redis_client, keys, "pa", theirs)
        publish(channel, "pa", 1)
        assert received(ra, 1) == ["b-pa-1"]  # A trains on its own batch only
        reasons = dead_letters(redis_client, keys)
        assert len(reasons) == 2
        assert "does not belong to batch 'b-pa-9' of policy 'pa'" in reasons[0]
        assert "a batch of policy 'pb' on the stream of 'pa'" in reasons[1]
        assert received(rb, 1) == [theirs.batch_id]  # B's payload was neither read for A nor released by A
        got = rb.buffered()[0].data
        assert got is not None and torch.equal(got.rewards, rb.payloads.fetch(theirs).rewards)
    finally:
        ra.stop()
        rb.stop()
        channel.close()


def test_every_store_checks_the_declared_size_against_the_channels_maximum(
        redis_client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    fields, meta = fake_batch(2, 2, rollout_id=0, version=0, rng=random.Random(0)).to_tensors()
    for store in (RedisStore(redis_client, keys), FileStore(tmp_path / "files", keys),
                  ShmStore(keys, tmp_path / "shm")):
        channel = BatchChannel(redis_client, keys, store)
        entry = channel.publish("pc", f"b-{store.name}", fields, meta)
        event = s.decode_as(s.BatchReady, redis_client.xrange(keys.batch_stream("pc"), min=entry, max=entry)[0][1])
        assert channel.fetch(event).nbytes == event.bytes
        huge = 1 << 40
        lying = dict(event.payload, nbytes=huge)
        if store.name == "redis":
            lying["chunks"] = -(-huge // lying["chunk_bytes"])
        with pytest.raises(DecodeError if store.name == "file" else PayloadTooLarge):  # a file has its own size
            store.get(lying)
        channel.max_bytes = store.max_bytes = 256  # smaller than the batch: refused before it is read
        with pytest.raises(PayloadTooLarge, match="maximum batch size"):
            store.get(event.payload)
        with pytest.raises(PayloadTooLarge, match="maximum batch size"):
            channel.fetch(event)
        channel.close()


def test_releasing_held_payloads_skips_an_event_that_points_at_another_policys_payload(
        redis_client: redis.Redis, keys: Keys) -> None:
    from rollout_bus.replay.exporter import hold_payloads, release_payloads

    hold_payloads(redis_client, keys, ["pa", "pb"])
    channel = BatchChannel(redis_client, keys)
    try:
        theirs = publish(channel, "pb", 0)
        forge(redis_client, keys, "pa", s.BatchReady(
            producer=FORGER, policy="pa", batch_id="b-pa-7", rollout_id=7, request_id="q-pa-7", n_samples=4,
            min_weight_version=0, max_weight_version=0, bytes=theirs.bytes, payload=theirs.payload))
        assert release_payloads(redis_client, keys, ["pa"]) == 0  # no error, and B's payload is not touched
        assert channel.fetch(theirs).nbytes == theirs.bytes
        assert release_payloads(redis_client, keys, ["pb"]) == 1
    finally:
        channel.close()
