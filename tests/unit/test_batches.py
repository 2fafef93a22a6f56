"""BatchChannel on fakeredis: publish, idempotency, readers, release, expiry, limits."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from rollout_bus.events.batch import EncodedBatch, Ragged
from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.errors import PayloadMissing, PayloadTooLarge
from rollout_bus.events.names import Keys
from rollout_bus.events.payload import FileStore, PayloadStore, RedisStore, Reference, ShmStore
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import BatchReady, Producer, decode_as

POLICY = "pol"


def tensors(seed: int = 0) -> dict[str, torch.Tensor | Ragged]:
    g = torch.Generator().manual_seed(seed)
    return {"tokens": Ragged.from_list([torch.arange(7, dtype=torch.int32), torch.arange(4, dtype=torch.int32)]),
            "rewards": torch.randn(2, generator=g)}


@pytest.fixture(params=["redis", "shm", "file"])
def store(request: pytest.FixtureRequest, fake_client: redis.Redis, keys: Keys, tmp_path: Path) -> PayloadStore:
    if request.param == "redis":
        return RedisStore(fake_client, keys, chunk_bytes=4096)
    if request.param == "shm":
        return ShmStore(keys, tmp_path / "shm")
    return FileStore(tmp_path / "files", keys)


def channel_for(client: redis.Redis, keys: Keys, store: PayloadStore, **kwargs: Any) -> BatchChannel:
    return BatchChannel(client, keys, store, Publisher(client, keys, Producer("executor", "e0")), **kwargs)


def register(client: redis.Redis, keys: Keys, *groups: str) -> None:
    client.sadd(keys.registered_groups(keys.batch_stream(POLICY)), *groups)


def only_event(client: redis.Redis, keys: Keys) -> BatchReady:
    entries = client.xrange(keys.batch_stream(POLICY))
    assert len(entries) == 1
    return decode_as(BatchReady, entries[0][1])


def payload_exists(store: PayloadStore, reference: Reference) -> bool:
    try:
        store.get(reference)
    except PayloadMissing:
        return False
    return True


def test_publish_appends_a_batch_ready_whose_payload_fetches_back(fake_client: redis.Redis, keys: Keys,
                                                                   store: PayloadStore) -> None:
    channel = channel_for(fake_client, keys, store)
    entry_id = channel.publish(POLICY, "b1", tensors(), {"k": 1}, rollout_id=3, request_id="r1",
                               min_weight_version=4, max_weight_version=5)
    event = only_event(fake_client, keys)
    assert fake_client.xrange(keys.batch_stream(POLICY))[0][0].decode() == entry_id
    assert (event.batch_id, event.rollout_id, event.request_id, event.n_samples) == ("b1", 3, "r1", 2)
    assert (event.min_weight_version, event.max_weight_version) == (4, 5)
    assert event.payload["store"] == store.name and event.bytes > 0
    batch = channel.fetch(event)
    assert batch.meta == {"k": 1}
    assert batch.ragged["tokens"][0].tolist() == list(range(7))
    ref = event.payload["ref"]
    assert ref.startswith("pol:b1:")  # the attempt's own ref
    assert fake_client.zscore(keys.payload_index, ref) is not None
    assert fake_client.hget(keys.payload_stores, ref) is not None  # where it lives, for the janitor


def test_a_repeated_publish_adds_no_entry_and_writes_no_second_payload(fake_client: redis.Redis, keys: Keys,
                                                                       store: PayloadStore,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    channel = channel_for(fake_client, keys, store)
    puts: list[str] = []
    real_put = store.put

    def counting_put(ref: str, batch: EncodedBatch, ttl_s: int) -> Reference:
        puts.append(ref)
        return real_put(ref, batch, ttl_s)
    monkeypatch.setattr(store, "put", counting_put)
    first = channel.publish(POLICY, "b1", tensors())
    assert channel.publish(POLICY, "b1", tensors(1)) == first
    assert fake_client.xlen(keys.batch_stream(POLICY)) == 1
    assert [r.rsplit(":", 1)[0] for r in puts] == ["pol:b1"]


def test_the_readers_are_the_groups_registered_when_the_batch_was_published(fake_client: redis.Redis,
                                                                            keys: Keys, store: PayloadStore) -> None:
    channel = channel_for(fake_client, keys, store)
    register(fake_client, keys, "trainer-a", "trainer-b")
    channel.publish(POLICY, "b1", tensors())
    register(fake_client, keys, "late")
    assert channel.readers(only_event(fake_client, keys).payload["ref"]) == {"trainer-a", "trainer-b"}


def test_the_payload_lives_until_the_last_group_releases_it(fake_client: redis.Redis, keys: Keys,
                                                            store: PayloadStore) -> None:
    channel = channel_for(fake_client, keys, store)
    register(fake_client, keys, "a", "b")
    channel.publish(POLICY, "b1", tensors())
    event = only_event(fake_client, keys)
    assert channel.release(event, "a") is False
    assert channel.release(event, "a") is False  # a repeated release changes nothing
    assert channel.release(event, "stranger") is False
    assert payload_exists(store, event.payload)
    assert channel.release(event, "b") is True
    assert not payload_exists(store, event.payload)
    assert fake_client.zscore(keys.payload_index, event.payload["ref"]) is None
    assert fake_client.hlen(keys.payload_stores) == 0
    assert not fake_client.exists(keys.payload_readers(event.payload["ref"]))
    with pytest.raises(PayloadMissing, match=r"batch b1 of policy pol"):
        channel.fetch(event)


def test_a_re_publish_after_the_batch_was_released_does_not_resurrect_its_payload(
        fake_client: redis.Redis, keys: Keys, store: PayloadStore) -> None:
    channel = channel_for(fake_client, keys, store)
    register(fake_client, keys, "a")
    channel.publish(POLICY, "b1", tensors())
    event = only_event(fake_client, keys)
    channel.release(event, "a")
    channel.publish(POLICY, "b1", tensors())
    assert not payload_exists(store, event.payload)
    assert fake_client.zcard(keys.payload_index) == 0


def test_a_concurrent_duplicate_that_lost_the_race_drops_its_copy(fake_client: redis.Redis, keys: Keys,
                                                                  store: PayloadStore,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    winner = channel_for(fake_client, keys, store)
    loser = channel_for(fake_client, keys, store)
    register(fake_client, keys, "a")
    real_put = store.put

    def racing_put(ref: str, batch: EncodedBatch, ttl_s: int) -> Reference:
        monkeypatch.setattr(store, "put", real_put)
        winner.publish(POLICY, "b1", tensors())  # wins, is read and released in full meanwhile
        winner.release(only_event(fake_client, keys), "a")
        return real_put(ref, batch, ttl_s)
    monkeypatch.setattr(store, "put", racing_put)
    entry = loser.publish(POLICY, "b1", tensors())
    event = only_event(fake_client, keys)
    assert fake_client.xrange(keys.batch_stream(POLICY))[0][0].decode() == entry
    assert not payload_exists(store, event.payload)
    assert fake_client.zcard(keys.payload_index) == 0


def test_delete_expired_deletes_payloads_that_outlived_their_readers(fake_client: redis.Redis, keys: Keys,
                                                            store: PayloadStore) -> None:
    channel = channel_for(fake_client, keys, store)
    register(fake_client, keys, "dead-group")
    channel.publish(POLICY, "b1", tensors())
    event = only_event(fake_client, keys)
    assert channel.delete_expired(max_age_s=3600) == 0
    assert payload_exists(store, event.payload)
    assert channel.delete_expired(max_age_s=0) >= 1
    assert not payload_exists(store, event.payload)
    assert fake_client.zcard(keys.payload_index) == 0 and fake_client.hlen(keys.payload_stores) == 0
    assert not fake_client.exists(keys.payload_readers(event.payload["ref"]))


def test_delete_expired_also_removes_a_payload_whose_publish_crashed_before_the_event(
        fake_client: redis.Redis, keys: Keys, store: PayloadStore, monkeypatch: pytest.MonkeyPatch) -> None:
    channel = channel_for(fake_client, keys, store)

    class Died(Exception):
        pass

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise Died("the producer died between the payload and the event")
    monkeypatch.setattr(channel, "_publish", crash)
    with pytest.raises(Died):
        channel.publish(POLICY, "b1", tensors())
    assert fake_client.xlen(keys.batch_stream(POLICY)) == 0
    (ref,) = [r.decode() for r in fake_client.zrange(keys.payload_index, 0, -1)]  # indexed before it was written
    assert written(fake_client, keys, store, ref)
    channel.delete_expired(max_age_s=0)
    assert fake_client.zcard(keys.payload_index) == 0
    assert not written(fake_client, keys, store, ref)


def written(client: redis.Redis, keys: Keys, store: PayloadStore, ref: str) -> bool:
    if isinstance(store, FileStore):
        return store.path(ref).exists()
    return bool(client.exists(keys.payload_chunk(ref, 0)))


def test_a_batch_over_the_limit_is_refused_before_redis_is_touched(fake_client: redis.Redis, keys: Keys,
                                                                   store: PayloadStore) -> None:
    channel = channel_for(fake_client, keys, store, max_bytes=1024)
    with pytest.raises(PayloadTooLarge, match="max_bytes=1024"):
        channel.publish(POLICY, "b1", {"x": torch.zeros(1024)})
    assert fake_client.keys("*") == []


def test_a_channel_reads_payloads_of_another_store_kind(fake_client: redis.Redis, keys: Keys,
                                                        tmp_path: Path) -> None:
    producer = channel_for(fake_client, keys, RedisStore(fake_client, keys))
    producer.publish(POLICY, "b1", tensors())
    reader = BatchChannel(fake_client, keys, FileStore(tmp_path, keys))
    assert reader.fetch(only_event(fake_client, keys)).ragged["tokens"][1].tolist() == [0, 1, 2, 3]
    assert os.listdir(tmp_path / keys.namespace) == []


def test_sweeping_deletes_payloads_of_every_store_kind_through_a_store_of_that_kind(
        fake_client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    register(fake_client, keys, "a-group-that-died")
    stores = [RedisStore(fake_client, keys, chunk_bytes=4096), ShmStore(keys, tmp_path / "shm"),
              FileStore(tmp_path / "files", keys)]
    events = []
    for i, store in enumerate(stores):
        channel_for(fake_client, keys, store).publish(POLICY, f"b{i}", tensors(i))
        events.append(decode_as(BatchReady, fake_client.xrange(keys.batch_stream(POLICY))[-1][1]))
    janitor = BatchChannel(fake_client, keys, RedisStore(fake_client, keys))  # its own kind is redis
    swept = janitor.sweep(0, roots=[str(tmp_path / "shm"), str(tmp_path / "files")])
    assert swept.payloads == {"redis": 1, "shm": 1, "file": 1} and swept.unreachable == 0
    for store, event in zip(stores, events, strict=True):
        assert not payload_exists(store, event.payload), store.name
    assert fake_client.zcard(keys.payload_index) == 0 and fake_client.hlen(keys.payload_stores) == 0


def test_a_payload_in_a_store_the_sweeper_was_not_given_is_left_indexed_not_orphaned(
        fake_client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    store = FileStore(tmp_path / "files", keys)
    channel_for(fake_client, keys, store).publish(POLICY, "b1", tensors())
    event = only_event(fake_client, keys)
    swept = BatchChannel(fake_client, keys, RedisStore(fake_client, keys)).sweep(0)
    assert swept.unreachable == 1 and swept.total == 0
    assert payload_exists(store, event.payload) and fake_client.zcard(keys.payload_index) == 1
