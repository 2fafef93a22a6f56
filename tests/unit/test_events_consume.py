"""Consumer groups, acks and dead letters against fakeredis."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import msgpack
import pytest
import redis

from rollout_bus.events.connection import Guard, ReconnectPolicy
from rollout_bus.events.consume import Consumer, ConsumerConfig, Message
from rollout_bus.events.errors import RedisCommandError
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import EngineReady, Producer, encode

PRODUCER = Producer("controller", "c-0")
FAST = ConsumerConfig(block_ms=1, claim_idle_ms=60_000, claim_every_ms=60_000)


def publish(client: redis.Redis, keys: Keys, n: int, stream: str | None = None) -> list[str]:
    pub = Publisher(client, keys, PRODUCER)
    return [pub.publish(stream or keys.engine_stream,
                        EngineReady(producer=PRODUCER, engine_id=f"e{i}", url="http://x")) for i in range(n)]


def consumer(client: redis.Redis, keys: Keys, group: str = "g", name: str = "c0",
             config: ConsumerConfig = FAST) -> Consumer:
    return Consumer(client, keys, keys.engine_stream, group, name, config)


def dead_letters(client: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    return [{k.decode(): v for k, v in fields.items()} for _, fields in client.xrange(keys.dead_letters)]


def pending(client: redis.Redis, keys: Keys, group: str = "g") -> int:
    return int(client.xpending(keys.engine_stream, group)["pending"])


def test_ensure_group_creates_and_registers_the_group_once(fake_client: redis.Redis, keys: Keys) -> None:
    c = consumer(fake_client, keys)
    c.ensure_group()
    c.ensure_group()
    assert [g["name"] for g in fake_client.xinfo_groups(keys.engine_stream)] == [b"g"]
    assert fake_client.smembers(keys.registered_groups(keys.engine_stream)) == {b"g"}


def test_ensure_group_reports_errors_other_than_busygroup(fake_client: redis.Redis, keys: Keys) -> None:
    fake_client.set(keys.engine_stream, "not a stream")
    with pytest.raises(RedisCommandError, match="WRONGTYPE"):
        consumer(fake_client, keys).ensure_group()


def test_handled_entries_are_acked_and_decoded(fake_client: redis.Redis, keys: Keys) -> None:
    ids = publish(fake_client, keys, 5)
    seen: list[Message] = []
    assert consumer(fake_client, keys).run_until_idle(seen.append) == 5
    assert [m.id for m in seen] == ids
    assert [m.event.engine_id for m in seen] == [f"e{i}" for i in range(5)]  # type: ignore[attr-defined]
    assert all(m.deliveries == 1 and m.stream == keys.engine_stream for m in seen)
    assert pending(fake_client, keys) == 0


def test_consumers_of_one_group_share_the_entries(fake_client: redis.Redis, keys: Keys) -> None:
    cfg = ConsumerConfig(block_ms=1, count=3, claim_idle_ms=60_000, claim_every_ms=60_000)
    a, b = consumer(fake_client, keys, name="a", config=cfg), consumer(fake_client, keys, name="b", config=cfg)
    a.ensure_group()
    ids = publish(fake_client, keys, 12)
    got: dict[str, list[str]] = {"a": [], "b": []}
    while sum(map(len, got.values())) < 12:
        a.process(lambda m: got["a"].append(m.id))
        b.process(lambda m: got["b"].append(m.id))
    assert sorted(got["a"] + got["b"]) == ids
    assert got["a"] and got["b"] and not set(got["a"]) & set(got["b"])


def test_each_group_sees_every_entry(fake_client: redis.Redis, keys: Keys) -> None:
    groups = ["trainer-a", "trainer-b", "audit"]
    consumers = [consumer(fake_client, keys, group=g) for g in groups]
    for c in consumers:
        c.ensure_group()
    ids = publish(fake_client, keys, 7)
    for c in consumers:
        seen: list[str] = []
        c.run_until_idle(lambda m, seen=seen: seen.append(m.id))
        assert seen == ids


def test_a_handler_error_leaves_the_entry_pending(fake_client: redis.Redis, keys: Keys) -> None:
    publish(fake_client, keys, 3)

    def handler(msg: Message) -> None:
        if msg.event.engine_id == "e1":  # type: ignore[attr-defined]
            raise RuntimeError("boom")
    assert consumer(fake_client, keys).run_until_idle(handler) == 2
    rows = fake_client.xpending_range(keys.engine_stream, "g", "-", "+", 10)
    assert len(rows) == 1 and rows[0]["consumer"] == b"c0"


def test_a_restarted_consumer_first_gets_its_own_pending_entries_again(
        fake_client: redis.Redis, keys: Keys) -> None:
    ids = publish(fake_client, keys, 3)
    first = consumer(fake_client, keys)
    assert [m.id for m in first.read(count=2)] == ids[:2]  # read, never acked: the process "died"
    again = consumer(fake_client, keys)
    msgs = again.read()
    assert [(m.id, m.deliveries) for m in msgs] == [(ids[0], 2), (ids[1], 2)]
    again.ack(*[m.id for m in msgs])
    assert [m.id for m in again.read()] == ids[2:]


def test_malformed_entries_are_dead_lettered_at_once_and_do_not_block_the_rest(
        fake_client: redis.Redis, keys: Keys) -> None:
    before = publish(fake_client, keys, 2)
    garbage = fake_client.xadd(keys.engine_stream, {b"e": b"\xc1\x00garbage"}).decode()
    no_field = fake_client.xadd(keys.engine_stream, {b"junk": b"1"}).decode()
    unknown = fake_client.xadd(keys.engine_stream, {b"e": msgpack.packb({"type": "Nope", "schema_version": 1})})
    after = publish(fake_client, keys, 2)
    seen: list[str] = []
    c = consumer(fake_client, keys)
    assert c.run_until_idle(lambda m: seen.append(m.id)) == 4
    assert seen == before + after
    assert c.dead_lettered == 3
    letters = dead_letters(fake_client, keys)
    assert [d["entry_id"].decode() for d in letters] == [garbage, no_field, unknown.decode()]
    assert b"not msgpack" in letters[0]["reason"]
    assert letters[1]["reason"] == b"entry has no 'e' field"
    assert letters[2]["reason"] == b"unknown event type 'Nope'"
    first = letters[0]
    assert first["source"] == keys.engine_stream.encode()
    assert (first["group"], first["consumer"], first["deliveries"]) == (b"g", b"c0", b"1")
    assert msgpack.unpackb(first["raw"]) == {b"e": b"\xc1\x00garbage"}
    assert pending(fake_client, keys) == 0


def test_a_poison_entry_is_dead_lettered_after_max_deliveries(fake_client: redis.Redis, keys: Keys) -> None:
    cfg = ConsumerConfig(block_ms=1, claim_idle_ms=0, claim_every_ms=0, max_deliveries=3)
    (poison,) = publish(fake_client, keys, 1)
    calls: Counter[int] = Counter()

    def handler(msg: Message) -> None:
        calls[msg.deliveries] += 1
        raise ValueError("cannot handle this")
    c = consumer(fake_client, keys, config=cfg)
    for _ in range(10):
        c.process(handler)
        if c.dead_lettered:
            break
    assert calls == Counter({1: 1, 2: 1, 3: 1})
    (letter,) = dead_letters(fake_client, keys)
    assert letter["entry_id"] == poison.encode()
    assert letter["reason"] == b"delivered 4 times (max 3)"
    assert letter["deliveries"] == b"4"
    assert pending(fake_client, keys) == 0
    later = publish(fake_client, keys, 1)
    assert [m.id for m in c.read()] == later


def test_manual_ack_mode_leaves_acking_to_the_handler(fake_client: redis.Redis, keys: Keys) -> None:
    publish(fake_client, keys, 2)
    c = consumer(fake_client, keys, config=ConsumerConfig(block_ms=1, auto_ack=False))
    assert c.process(lambda m: None) == 2
    assert pending(fake_client, keys) == 2


def test_a_deleted_group_is_recreated(fake_client: redis.Redis, keys: Keys) -> None:
    publish(fake_client, keys, 1)
    c = consumer(fake_client, keys)
    c.ensure_group()
    fake_client.xgroup_destroy(keys.engine_stream, "g")
    assert c.read() == []
    assert len(c.read()) == 1


def test_encoded_events_are_what_the_consumer_decodes(fake_client: redis.Redis, keys: Keys) -> None:
    event = EngineReady(producer=PRODUCER, engine_id="x", url="u")
    fake_client.xadd(keys.engine_stream, encode(event))  # type: ignore[arg-type]
    (msg,) = consumer(fake_client, keys).read()
    assert msg.event == event and msg.fields == encode(event)


def test_a_zero_block_read_returns_at_once_instead_of_waiting_forever(
        fake_client: redis.Redis, keys: Keys) -> None:
    c = consumer(fake_client, keys, config=ConsumerConfig(block_ms=0))
    started = time.monotonic()
    assert c.read() == []
    assert c.run_until_idle(lambda m: None, idle_block_ms=0) == 0
    assert time.monotonic() - started < 1.0


class LosesOneReply:
    """A client whose first non-empty XREADGROUP reply is lost on the way back, after Redis acted on it."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.armed = True

    def xreadgroup(self, *args: Any, **kwargs: Any) -> Any:
        reply = self.client.xreadgroup(*args, **kwargs)
        if self.armed and any(entries for _, entries in reply or []):
            self.armed = False
            raise redis.ConnectionError("connection reset while reading the reply")
        return reply

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def test_entries_whose_delivery_reply_was_lost_are_read_again_after_the_reconnect(
        fake_client: redis.Redis, keys: Keys) -> None:
    flaky: Any = LosesOneReply(fake_client)
    guard = Guard(flaky, ReconnectPolicy(base_s=0.001), name="flaky")
    c = Consumer(flaky, keys, keys.engine_stream, "g", "c0", ConsumerConfig(block_ms=0), guard=guard)
    c.ensure_group()
    ids = publish(fake_client, keys, 3)
    assert c.read() == []  # Redis delivered the three, the reply never arrived, the retry found nothing new
    assert pending(fake_client, keys) == 3 and guard.outages == 1
    assert [(m.id, m.deliveries) for m in c.read()] == [(i, 2) for i in ids]


def test_run_acks_each_batch_with_the_next_read_and_everything_on_the_way_out(
        fake_client: redis.Redis, keys: Keys) -> None:
    ids = publish(fake_client, keys, 5)
    c = consumer(fake_client, keys, config=ConsumerConfig(block_ms=1, count=2))
    stop = threading.Event()
    pending_seen: list[int] = []

    def handler(msg: Message) -> None:
        pending_seen.append(pending(fake_client, keys))
        if msg.id == ids[-1]:
            stop.set()
    c.run(handler, stop)
    assert pending_seen == [2, 2, 2, 2, 1]  # the batch before was acked when this one was read
    assert pending(fake_client, keys) == 0


def test_entries_handled_but_not_yet_acked_are_never_claimed_again(fake_client: redis.Redis, keys: Keys) -> None:
    ids = publish(fake_client, keys, 9)
    c = consumer(fake_client, keys, config=ConsumerConfig(block_ms=1, count=2, claim_idle_ms=0, claim_every_ms=0))
    seen: list[str] = []
    assert c.run_until_idle(lambda m: seen.append(m.id)) == 9
    assert seen == ids
    assert pending(fake_client, keys) == 0


def test_stream_replies_of_both_protocols_and_both_field_shapes_become_entries_with_field_maps() -> None:
    from rollout_bus.events.paging import stream_entries
    resp2 = [[b"s", [[b"1-0", [b"e", b"x"]], [b"2-0", None], [b"3-0", [b"a", b"1", b"b", b"2"]]]],
             [b"t", [[b"4-0", {b"e": b"y"}]]]]
    expected = [("s", "1-0", {b"e": b"x"}), ("s", "2-0", {}), ("s", "3-0", {b"a": b"1", b"b": b"2"}),
                ("t", "4-0", {b"e": b"y"})]
    assert stream_entries(resp2) == expected
    assert stream_entries({b"s": resp2[0][1], b"t": resp2[1][1]}) == expected
    assert stream_entries(None) == [] and stream_entries([]) == []


def test_a_consumer_beats_from_its_own_thread_until_closed(fake_client: redis.Redis, keys: Keys) -> None:
    """Its group stays registered while it is busy (no read at all), and lapses once it is closed."""
    stream = keys.weight_stream("default")
    beats = keys.group_beats(stream)
    consumer = Consumer(fake_client, keys, stream, "busy", "c0", ConsumerConfig(block_ms=1, group_ttl_s=0.2))
    consumer.ensure_group()
    first = fake_client.zscore(beats, "busy")
    time.sleep(0.3)  # longer than the TTL, and not one read
    assert fake_client.zscore(beats, "busy") > first  # type: ignore[operator]
    assert fake_client.hget(keys.group_ttls(stream), "busy") == b"200"
    heartbeat = consumer._heartbeat
    assert heartbeat is not None and heartbeat.beats >= 2
    consumer.close()
    deadline = time.monotonic() + 3
    while heartbeat.alive and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not heartbeat.alive
    closed = fake_client.zscore(beats, "busy")
    time.sleep(0.15)
    assert fake_client.zscore(beats, "busy") == closed
