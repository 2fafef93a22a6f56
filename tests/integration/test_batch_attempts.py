"""Two live attempts of one rollout job publishing its batch at once, on a real redis-server."""

from __future__ import annotations

import threading

import pytest
import redis
import torch

from rollout_bus.events.batch import EncodedBatch, Ragged
from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.names import Keys
from rollout_bus.events.payload import RedisStore, Reference
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import BatchReady, Producer, decode_as

pytestmark = pytest.mark.integration
POLICY = "p0"


class GatedStore(RedisStore):
    """The real redis store, pausing after it wrote a payload until the test lets it go on."""

    def __init__(self, client: redis.Redis, keys: Keys, wrote: threading.Event, go_on: threading.Event) -> None:
        super().__init__(client, keys, chunk_bytes=4096)
        self.wrote = wrote
        self.go_on = go_on

    def put(self, ref: str, batch: EncodedBatch, ttl_s: int) -> Reference:
        reference = super().put(ref, batch, ttl_s)
        self.wrote.set()
        assert self.go_on.wait(20)
        return reference


def attempt_data(n_rows: int, value: int) -> dict[str, torch.Tensor | Ragged]:
    return {"tokens": Ragged.from_list([torch.full((3 + i,), value, dtype=torch.int32) for i in range(n_rows)]),
            "rewards": torch.full((n_rows,), float(value))}


def test_two_attempts_writing_one_batch_at_once_leave_the_winners_bytes_intact_and_no_copy_behind(
        redis_client: redis.Redis, keys: Keys) -> None:
    redis_client.sadd(keys.registered_groups(keys.batch_stream(POLICY)), "trainer")
    a_wrote, b_wrote, a_published, never = threading.Event(), threading.Event(), threading.Event(), threading.Event()
    never.set()
    store_a = GatedStore(redis_client, keys, a_wrote, b_wrote)   # A waits until B wrote too
    store_b = GatedStore(redis_client, keys, b_wrote, a_published)  # B publishes after A did
    producer = Producer("executor", "x")
    a = BatchChannel(redis_client, keys, store_a, Publisher(redis_client, keys, producer))
    b = BatchChannel(redis_client, keys, store_b, Publisher(redis_client, keys, producer))
    ids: dict[str, str] = {}

    def run_a() -> None:
        ids["a"] = a.publish(POLICY, "batch-r1", attempt_data(2, 1), {"attempt": "a"}, request_id="r1")
        a_published.set()

    def run_b() -> None:
        assert a_wrote.wait(20)  # B starts writing once A's bytes are in Redis, before A's event
        ids["b"] = b.publish(POLICY, "batch-r1", attempt_data(5, 2), {"attempt": "b"}, request_id="r1")

    threads = [threading.Thread(target=run_a), threading.Thread(target=run_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert b_wrote.is_set()  # both attempts really wrote their bytes before either event landed
    assert ids["a"] == ids["b"]  # one entry, the winner's
    (entry,) = redis_client.xrange(keys.batch_stream(POLICY))
    event = decode_as(BatchReady, entry[1])
    batch = a.fetch(event)  # verified against the checksum written with it
    assert batch.meta == {"attempt": "a"} and batch.tensors["rewards"].tolist() == [1.0, 1.0]
    payload_keys = {k.decode() for k in redis_client.scan_iter(match=keys.payload("*"))}
    assert payload_keys == set(store_a.redis_keys(event.payload))  # the loser's copy is gone
    assert [r.decode() for r in redis_client.zrange(keys.payload_index, 0, -1)] == [event.payload["ref"]]
