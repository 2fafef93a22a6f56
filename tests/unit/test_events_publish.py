"""Idempotent publishing against fakeredis."""

from __future__ import annotations

import pytest
import redis

from rollout_bus.events.errors import InvalidRequest
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import RETRY_DEDUPE_TTL_S, Publisher
from rollout_bus.events.schema import EngineReady, Producer, decode

PRODUCER = Producer("controller", "c-0")


def ready(engine_id: str = "e1") -> EngineReady:
    return EngineReady(producer=PRODUCER, engine_id=engine_id, url="http://127.0.0.1:30000")


def test_publishing_the_same_key_twice_adds_one_entry_and_returns_the_same_id(
        fake_client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(fake_client, keys, PRODUCER)
    first = pub.publish(keys.engine_stream, ready("e1"), idempotency_key="req-1")
    again = pub.publish(keys.engine_stream, ready("e2"), idempotency_key="req-1")
    assert again == first
    entries = fake_client.xrange(keys.engine_stream)
    assert [e[0].decode() for e in entries] == [first]
    assert decode(entries[0][1]).engine_id == "e1"  # type: ignore[attr-defined]


def test_a_retried_event_is_deduplicated_by_its_event_id(fake_client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(fake_client, keys, PRODUCER)
    event = ready()
    assert pub.publish(keys.engine_stream, event) == pub.publish(keys.engine_stream, event)
    assert fake_client.xlen(keys.engine_stream) == 1
    pub.publish(keys.engine_stream, ready())
    assert fake_client.xlen(keys.engine_stream) == 2


def test_the_dedupe_key_expires_after_its_ttl(fake_client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(fake_client, keys, PRODUCER, dedupe_ttl_s=90)
    entry_id = pub.publish(keys.engine_stream, ready(), idempotency_key="k")
    dedupe = keys.dedupe(keys.engine_stream, "k")
    assert fake_client.get(dedupe) == entry_id.encode()
    assert 0 < fake_client.ttl(dedupe) <= 90


def test_the_same_key_on_two_streams_publishes_twice(fake_client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(fake_client, keys, PRODUCER)
    pub.publish(keys.engine_stream, ready(), idempotency_key="k")
    pub.publish(keys.batch_stream("engines"), ready(), idempotency_key="k")
    assert fake_client.xlen(keys.engine_stream) == 1
    assert fake_client.xlen(keys.batch_stream("engines")) == 1


def test_fields_without_a_key_are_appended_every_time(fake_client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(fake_client, keys, PRODUCER)
    ids = {pub.publish_fields(keys.engine_stream, {b"x": b"1"}) for _ in range(3)}
    assert len(ids) == 3
    assert fake_client.keys(keys.prefix.replace("{", "[{]") + ":dedupe:*") == []


def test_maxlen_caps_the_stream(fake_client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(fake_client, keys, PRODUCER)
    for _ in range(30):
        pub.publish(keys.engine_stream, ready(), maxlen=5)
    assert 5 <= fake_client.xlen(keys.engine_stream) < 30


def test_publish_many_dedupes_each_event_and_returns_ids_in_order(fake_client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(fake_client, keys, PRODUCER)
    events = [ready(f"e{i}") for i in range(5)]
    ids = pub.publish_many(keys.engine_stream, events)
    assert [e[0].decode() for e in fake_client.xrange(keys.engine_stream)] == ids
    assert [decode(e[1]).engine_id for e in fake_client.xrange(keys.engine_stream)] == [  # type: ignore[attr-defined]
        f"e{i}" for i in range(5)]
    assert pub.publish_many(keys.engine_stream, events[2:] + [ready("new")])[:3] == ids[2:]  # a retry adds only the new
    assert pub.publish(keys.engine_stream, events[0]) == ids[0]
    assert fake_client.xlen(keys.engine_stream) == 6
    assert pub.publish_many(keys.engine_stream, []) == []


def test_publish_many_with_explicit_keys_dedupes_within_the_batch(fake_client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(fake_client, keys, PRODUCER)
    ids = pub.publish_many(keys.engine_stream, [ready("a"), ready("b"), ready("c")], idempotency_keys=["k1", "k1", None])
    assert ids[0] == ids[1] != ids[2]
    assert fake_client.xlen(keys.engine_stream) == 2


def test_publishing_reloads_the_script_after_the_server_lost_it(fake_client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(fake_client, keys, PRODUCER)
    fake_client.script_flush()
    first = pub.publish(keys.engine_stream, ready(), idempotency_key="k")
    fake_client.script_flush()
    assert pub.publish_many(keys.engine_stream, [ready(), ready()], idempotency_keys=["k", "k2"])[0] == first
    assert fake_client.xlen(keys.engine_stream) == 2


def test_a_publisher_keeps_one_connection_and_gives_it_back(fake_client: redis.Redis, keys: Keys) -> None:
    pool = fake_client.connection_pool
    pub = Publisher(fake_client, keys, PRODUCER)
    for _ in range(3):
        pub.publish(keys.engine_stream, ready())
    assert len(pool._in_use_connections) == 1  # type: ignore[attr-defined]
    pub.close()
    assert len(pool._in_use_connections) == 0  # type: ignore[attr-defined]
    pub.publish(keys.engine_stream, ready())  # takes one again
    del pub  # a dropped publisher gives its connection back too
    assert len(pool._in_use_connections) == 0  # type: ignore[attr-defined]


class Wrapped:
    """A client behind a wrapper: the publisher uses the wrapper's commands, not a connection of its own."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.commands: list[str] = []

    def execute_command(self, *args: object) -> object:
        self.commands.append(str(args[0]))
        return self.client.execute_command(*args)

    def __getattr__(self, name: str) -> object:
        return getattr(self.client, name)


def test_a_wrapped_client_goes_through_its_own_commands(fake_client: redis.Redis, keys: Keys) -> None:
    wrapped = Wrapped(fake_client)
    pub = Publisher(wrapped, keys, PRODUCER)  # type: ignore[arg-type]
    event = ready()
    ids = pub.publish_many(keys.engine_stream, [event, event])
    assert ids[0] == ids[1] == pub.publish(keys.engine_stream, event)
    assert set(wrapped.commands) == {"EVALSHA"}  # the first one also finds the script not loaded yet
    assert fake_client.xlen(keys.engine_stream) == 1


def test_a_dedupe_key_of_an_event_id_lives_minutes_and_one_of_a_business_key_as_configured(
        fake_client: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_BUS_DEDUPE_TTL_S", "3600")
    pub = Publisher(fake_client, keys, PRODUCER)
    event = ready()
    pub.publish(keys.engine_stream, event)  # only the guard's own re-send can repeat it
    pub.publish(keys.engine_stream, ready(), idempotency_key="request-7")
    assert 0 < fake_client.ttl(keys.dedupe(keys.engine_stream, event.event_id)) <= RETRY_DEDUPE_TTL_S
    assert RETRY_DEDUPE_TTL_S < fake_client.ttl(keys.dedupe(keys.engine_stream, "request-7")) <= 3600
    monkeypatch.setenv("ROLLOUT_BUS_DEDUPE_TTL_S", "5")
    with pytest.raises(InvalidRequest, match="ROLLOUT_BUS_DEDUPE_TTL_S must be a whole number >= 600, got '5'"):
        Publisher(fake_client, keys, PRODUCER)
