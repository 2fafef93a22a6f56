"""Sequence numbers are given out by the publish scripts, per producer, as events are appended: against
fakeredis' Lua and a real redis-server's."""

from __future__ import annotations

import pytest
import redis
import torch

from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.names import Keys
from rollout_bus.events.payload import RedisStore
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import EngineReady, Event, Producer, decode

CONTROLLER = Producer("controller", "c-0")
EXECUTOR = Producer("executor", "x-0")


@pytest.fixture(params=["fakeredis", "redis-server"])
def client(request: pytest.FixtureRequest) -> redis.Redis:
    name = "fake_client" if request.param == "fakeredis" else "redis_client"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


def ready(producer: Producer = CONTROLLER) -> EngineReady:
    return EngineReady(producer=producer, engine_id="e1", url="http://127.0.0.1:30000")


def seqs(client: redis.Redis, stream: str) -> list[tuple[str, int]]:
    events: list[Event] = [decode(fields) for _, fields in client.xrange(stream)]
    return [(str(e.producer), e.seq) for e in events]


def test_each_producer_numbers_what_it_publishes_and_a_deduplicated_publish_takes_no_number(
        client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(client, keys, CONTROLLER)
    pub.publish(keys.engine_stream, ready(), idempotency_key="a")
    pub.publish(keys.engine_stream, ready(), idempotency_key="a")  # deduplicated
    event = ready()
    pub.publish(keys.weight_stream("default"), event)
    pub.publish(keys.weight_stream("default"), event)  # the guard's re-send after a lost reply
    pub.publish_many(keys.engine_stream, [ready(EXECUTOR), ready(), ready(EXECUTOR)])
    pub.publish_fields(keys.command_stream, {b"x": b"1"})  # raw fields: no event, no number
    assert ready().seq == 0  # a number only once published
    assert seqs(client, keys.engine_stream)[:4] == [("controller/c-0", 1), ("executor/x-0", 1),
                                                    ("controller/c-0", 3), ("executor/x-0", 2)]
    assert seqs(client, keys.weight_stream("default")) == [("controller/c-0", 2)]
    # the same producer name in a new process (a restart) goes on from its last number
    Publisher(client, keys, CONTROLLER).publish(keys.engine_stream, ready(), durable=True)
    assert decode(client.xrange(keys.engine_stream)[-1][1]).seq == 4


def test_a_batch_ready_takes_the_next_number_of_its_producer_once(client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(client, keys, EXECUTOR)
    pub.publish(keys.rollout_stream, ready(EXECUTOR))
    channel = BatchChannel(client, keys, RedisStore(client, keys), pub)
    tensors = {"tokens": torch.arange(6).reshape(2, 3)}
    first = channel.publish("p0", "batch-1", tensors)
    assert channel.publish("p0", "batch-1", tensors) == first  # a retried job: the same entry, no number
    channel.publish("p0", "batch-2", tensors)
    pub.publish(keys.rollout_stream, ready(EXECUTOR))
    assert [n for _, n in seqs(client, keys.batch_stream("p0"))] == [2, 3]
    assert [n for _, n in seqs(client, keys.rollout_stream)] == [1, 4]


def test_numbers_past_one_byte_keep_the_event_decodable(client: redis.Redis, keys: Keys) -> None:
    client.hset(keys.producer_seqs, str(CONTROLLER), 2**16 - 2)
    pub = Publisher(client, keys, CONTROLLER)
    for _ in range(3):
        pub.publish(keys.engine_stream, ready())
    client.hset(keys.producer_seqs, str(EXECUTOR), 126)
    for _ in range(2):
        pub.publish(keys.engine_stream, ready(EXECUTOR))
    assert [n for _, n in seqs(client, keys.engine_stream)] == [2**16 - 1, 2**16, 2**16 + 1, 127, 128]


def test_numbers_past_four_bytes_neither_wrap_nor_read_as_unnumbered(client: redis.Redis, keys: Keys) -> None:
    client.hset(keys.producer_seqs, str(CONTROLLER), 2**32 - 2)
    pub = Publisher(client, keys, CONTROLLER)
    for _ in range(3):
        pub.publish(keys.engine_stream, ready())
    assert [n for _, n in seqs(client, keys.engine_stream)] == [2**32 - 1, 2**32, 2**32 + 1]
