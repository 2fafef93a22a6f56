"""Writes bound to a lease (``events.leased``): the check and the write are one script, on the server's clock."""

from __future__ import annotations

import time
from typing import Any

import fakeredis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.connection import Guard
from rollout_bus.events.consume import Consumer, ConsumerConfig
from rollout_bus.events.errors import LeaseLost
from rollout_bus.events.leased import LeaseFence, guarded, leased
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import BatchReady, Producer, TrainerJoined, decode
from tests.support.fake_rollouts import fake_batch


def hold(client: fakeredis.FakeRedis, keys: Keys, token: str, *, until_ms: int | None = None) -> LeaseFence:
    """Write a lease field for ``token`` (valid 60 s unless ``until_ms``) and return the fence of ``token``."""
    fence = LeaseFence(keys.trainer_lease("alpha"), "r0", token)
    until = time.time_ns() // 1_000_000 + 60_000 if until_ms is None else until_ms
    client.hset(fence.key, "r0", f"{token}|{until}|host:1")
    return fence


def joined(n: int = 0) -> TrainerJoined:
    return TrainerJoined(producer=Producer("trainer", "a"), policy="alpha", trainer_id=f"t{n}", group="g")


@pytest.mark.parametrize("case", ["taken by another", "lapsed", "no holder"])
def test_a_leased_publish_is_refused_once_the_lease_is_not_the_writers(keys: Keys, case: str) -> None:
    client = fakeredis.FakeRedis()
    mine = LeaseFence(keys.trainer_lease("alpha"), "r0", "tok-a")
    if case == "taken by another":
        hold(client, keys, "tok-b")
    elif case == "lapsed":
        hold(client, keys, "tok-a", until_ms=time.time_ns() // 1_000_000 - 10)
    publisher = Publisher(client, keys, Producer("trainer", "a"))
    with pytest.raises(LeaseLost, match="lease lost"):
        publisher.publish(keys.trainer_stream, joined(), idempotency_key="joined.a", lease=mine)
    assert list(page(client, keys.trainer_stream)) == []
    assert publisher.entry_for(keys.trainer_stream, "joined.a") is None  # nor a dedupe key that would hide a retry


def test_a_leased_publish_goes_through_while_the_lease_holds_and_is_still_deduplicated(keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    fence = hold(client, keys, "tok-a")
    publisher = Publisher(client, keys, Producer("trainer", "a"))
    first = publisher.publish(keys.trainer_stream, joined(1), idempotency_key="k", lease=fence)
    again = publisher.publish(keys.trainer_stream, joined(2), idempotency_key="k", lease=fence, durable=True)
    assert first == again and len(list(page(client, keys.trainer_stream))) == 1
    assert publisher.entry_for(keys.trainer_stream, "k") == first


def delivered_while_another_holds_the_lease(keys: Keys) -> tuple[fakeredis.FakeRedis, str, Consumer, Any]:
    """One entry delivered to consumer ``c`` of group ``g``, while ``tok-b`` holds the lease."""
    client = fakeredis.FakeRedis()
    stream = keys.batch_stream("alpha")
    Publisher(client, keys, Producer("x", "x")).publish(stream, joined())
    consumer = Consumer(client, keys, stream, "g", "c", ConsumerConfig(block_ms=0, auto_ack=False))
    consumer.ensure_group()
    [msg] = consumer.read()
    hold(client, keys, "tok-b")
    return client, stream, consumer, msg


def test_a_leased_ack_leaves_the_entry_pending_once_the_lease_is_lost(keys: Keys) -> None:
    client, stream, consumer, msg = delivered_while_another_holds_the_lease(keys)
    with pytest.raises(LeaseLost):
        consumer.ack(msg.id, lease=LeaseFence(keys.trainer_lease("alpha"), "r0", "tok-a"))
    assert client.xpending(stream, "g")["pending"] == 1
    consumer.ack(msg.id, lease=LeaseFence(keys.trainer_lease("alpha"), "r0", "tok-b"))
    assert client.xpending(stream, "g")["pending"] == 0


def test_a_leased_dead_letter_moves_nothing_once_the_lease_is_lost(keys: Keys) -> None:
    client, stream, consumer, msg = delivered_while_another_holds_the_lease(keys)
    with pytest.raises(LeaseLost):
        consumer.dead_letter(msg.id, msg.fields, "bad", 1, lease=LeaseFence(keys.trainer_lease("alpha"), "r0", "tok-a"))
    assert client.xpending(stream, "g")["pending"] == 1 and client.xlen(keys.dead_letters) == 0
    consumer.dead_letter(msg.id, msg.fields, "bad", 1, lease=LeaseFence(keys.trainer_lease("alpha"), "r0", "tok-b"))
    assert client.xpending(stream, "g")["pending"] == 0
    [(_, record)] = client.xrange(keys.dead_letters)
    assert record[b"reason"] == b"bad" and record[b"entry_id"] == msg.id.encode()


def test_a_leased_payload_release_changes_nothing_once_the_lease_is_lost(keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    channel = BatchChannel(client, keys)
    client.sadd(keys.registered_groups(keys.batch_stream("alpha")), "g")
    tensors, meta = fake_batch(1, 2, rollout_id=0, version=0).to_tensors()
    channel.publish("alpha", "b0", tensors, meta)
    [(_, fields)] = list(page(client, keys.batch_stream("alpha")))
    event = decode(fields)
    assert isinstance(event, BatchReady)
    readers = keys.payload_readers(event.payload["ref"])
    before = client.smembers(readers)
    assert b"g" in before
    hold(client, keys, "tok-b")
    with pytest.raises(LeaseLost):
        channel.release(event, "g", lease=LeaseFence(keys.trainer_lease("alpha"), "r0", "tok-a"))
    assert client.smembers(readers) == before
    assert channel.release(event, "g", lease=LeaseFence(keys.trainer_lease("alpha"), "r0", "tok-b"))


def test_a_wrapped_script_sees_only_its_own_keys_and_arguments(keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    fence = hold(client, keys, "tok-a")
    script = client.register_script(leased("return {#KEYS, KEYS[1], #ARGV, ARGV[1], ARGV[2]}"))
    script_keys, args = fence.keys("k1", "k2"), fence.args("a1", "a2", "a3")
    reply = guarded(Guard(client), lambda c: script(keys=script_keys, args=args, client=c))
    assert reply == [2, b"k1", 3, b"a1", b"a2"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.binary(max_size=48), token=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="|"), min_size=1,
                                                                max_size=12))
def test_whatever_a_lease_field_holds_only_the_writers_live_token_lets_a_write_through(
        keys: Keys, value: bytes, token: str) -> None:
    client = fakeredis.FakeRedis()
    fence = LeaseFence(keys.trainer_lease("alpha"), "r0", token)
    publisher = Publisher(client, keys, Producer("trainer", "a"))
    client.hset(fence.key, "r0", value)  # anything: a damaged or foreign record
    live = value.startswith(f"{token}|".encode())
    if not live:
        with pytest.raises(LeaseLost):
            publisher.publish(keys.trainer_stream, joined(), lease=fence)
    until = time.time_ns() // 1_000_000 + 60_000
    client.hset(fence.key, "r0", f"{token}|{until}|".encode() + value)
    publisher.publish(keys.trainer_stream, joined(), lease=fence)  # the live token, whatever follows it
    client.delete(keys.trainer_stream)
