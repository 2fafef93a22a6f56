"""The shm payload store serves one host: a batch whose readers are on another host is refused at
publish with what to change, or sent through Redis with ``shm?fallback=redis``; a shm reference
from another host is refused at fetch."""

from __future__ import annotations

import socket

import pytest
import redis
import torch

from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.consume import register_group
from rollout_bus.events.errors import InvalidRequest, PayloadMissing
from rollout_bus.events.names import Keys
from rollout_bus.events.payload import make_store
from rollout_bus.events.schema import BatchReady, decode

pytestmark = pytest.mark.integration

TENSORS = {"x": torch.arange(6, dtype=torch.int32)}


def _reader_on(client: redis.Redis, keys: Keys, group: str, host: str) -> None:
    stream = keys.batch_stream("p")
    register_group(client, keys, stream, group, "0")
    if host != socket.gethostname():  # as the trainer on that host would have registered it
        client.hset(keys.group_hosts(stream), group, host)


def test_a_reader_on_this_host_gets_shared_memory(redis_client: redis.Redis, keys: Keys) -> None:
    _reader_on(redis_client, keys, "trainer-a", socket.gethostname())
    channel = BatchChannel(redis_client, keys, make_store("shm", redis_client, keys))
    entry = channel.publish("p", "b0", TENSORS)
    event = decode(redis_client.xrange(keys.batch_stream("p"), entry, entry)[0][1])
    assert isinstance(event, BatchReady) and event.payload["store"] == "shm"
    channel.close()


def test_a_reader_on_another_host_is_refused_at_publish_with_what_to_change(redis_client: redis.Redis,
                                                                           keys: Keys) -> None:
    _reader_on(redis_client, keys, "trainer-a", socket.gethostname())
    _reader_on(redis_client, keys, "trainer-b", "gpu-node-7")
    channel = BatchChannel(redis_client, keys, make_store("shm", redis_client, keys))
    with pytest.raises(InvalidRequest, match=r"group trainer-b on 'gpu-node-7'.*shm\?fallback=redis"):
        channel.publish("p", "b0", TENSORS)
    assert redis_client.xlen(keys.batch_stream("p")) == 0  # nothing published that a reader could not fetch
    channel.close()


def test_with_the_redis_fallback_a_batch_for_another_host_goes_through_redis(redis_client: redis.Redis,
                                                                             keys: Keys) -> None:
    _reader_on(redis_client, keys, "trainer-b", "gpu-node-7")
    channel = BatchChannel(redis_client, keys, make_store("shm?fallback=redis", redis_client, keys))
    entry = channel.publish("p", "b0", TENSORS)
    event = decode(redis_client.xrange(keys.batch_stream("p"), entry, entry)[0][1])
    assert isinstance(event, BatchReady) and event.payload["store"] == "redis"
    reader = BatchChannel(redis_client, keys)  # the reader's side: a plain channel fetches it from Redis
    assert torch.equal(reader.fetch(event).tensor("x"), TENSORS["x"])
    channel.close()
    reader.close()


def test_a_shm_reference_from_another_host_is_refused_at_fetch(redis_client: redis.Redis, keys: Keys) -> None:
    _reader_on(redis_client, keys, "trainer-a", socket.gethostname())
    channel = BatchChannel(redis_client, keys, make_store("shm", redis_client, keys))
    entry = channel.publish("p", "b0", TENSORS)
    event = decode(redis_client.xrange(keys.batch_stream("p"), entry, entry)[0][1])
    assert isinstance(event, BatchReady)
    event.payload["host"] = "gpu-node-7"  # as a reader on this host sees a batch made there
    with pytest.raises(PayloadMissing, match="in shared memory on host 'gpu-node-7'.*redis or file store"):
        channel.fetch(event)
    channel.close()


def test_an_unknown_fallback_is_refused(redis_client: redis.Redis, keys: Keys) -> None:
    with pytest.raises(InvalidRequest, match="the only fallback is redis"):
        make_store("shm?fallback=file", redis_client, keys)
