"""The batch publish script (``Publisher.publish_many``) and the single-event one (``Publisher.publish``): every
event deduplicated, numbered and appended as one script per event did it, against fakeredis' Lua and a real
redis-server's."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_bus.events import publish as publish_module
from rollout_bus.events.consume import Consumer, ConsumerConfig
from rollout_bus.events.errors import LeaseLost, RedisCommandError
from rollout_bus.events.leased import LeaseFence
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import RETRY_DEDUPE_TTL_S, Publisher, seq_bytes
from rollout_bus.events.schema import EngineReady, Event, Producer, decode, encode_bytes, seq_slot

CONTROLLER = Producer("controller", "c-0")
EXECUTOR = Producer("executor", "x-0")


@pytest.fixture(params=["fakeredis", "redis-server"])
def client(request: pytest.FixtureRequest) -> redis.Redis:
    name = "fake_client" if request.param == "fakeredis" else "redis_client"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


def ready(engine_id: str = "e1", producer: Producer = CONTROLLER) -> EngineReady:
    return EngineReady(producer=producer, engine_id=engine_id, url="http://127.0.0.1:30000")


def stored(client: redis.Redis, stream: str) -> list[tuple[str, bytes]]:
    """Each entry's id and its event as stored."""
    found: Any = client.xrange(stream)
    return [(entry_id.decode(), fields[b"e"]) for entry_id, fields in found]


def entries(client: redis.Redis, stream: str) -> list[tuple[str, Event]]:
    return [(entry_id, decode({b"e": raw})) for entry_id, raw in stored(client, stream)]


def numbered(event: Event, n: int) -> bytes:
    """``event`` as the publish scripts store it once it has number ``n``."""
    raw = encode_bytes(event)
    slot = seq_slot(raw)
    return raw[:slot - 1] + seq_bytes(n) + raw[slot:]


def test_a_batch_is_appended_in_order_each_event_numbered_and_stored_as_one_script_per_event_stored_it(
        client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(client, keys, CONTROLLER)
    events = [ready(f"e{i}") for i in range(5)]
    ids = pub.publish_many(keys.engine_stream, events)  # the first call: the script writes every number
    more = [ready(f"f{i}") for i in range(5)]
    ids += pub.publish_many(keys.engine_stream, more)  # then the publisher writes them and the script checks
    assert [entry_id for entry_id, _ in stored(client, keys.engine_stream)] == ids
    assert [raw for _, raw in stored(client, keys.engine_stream)] == [
        numbered(e, n) for n, e in enumerate(events + more, 1)]
    assert [e.engine_id for _, e in entries(client, keys.engine_stream)] == [  # type: ignore[attr-defined]
        e.engine_id for e in events + more]


def test_a_repeat_of_a_partially_published_batch_appends_only_the_rest_and_numbers_them_next(
        client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(client, keys, CONTROLLER)
    events = [ready(f"e{i}") for i in range(6)]
    first = {i: pub.publish(keys.engine_stream, events[i]) for i in (1, 3)}  # an earlier try got these through
    ids = pub.publish_many(keys.engine_stream, events)
    assert {i: ids[i] for i in (1, 3)} == first
    assert len(set(ids)) == 6
    got = entries(client, keys.engine_stream)
    assert [entry_id for entry_id, _ in got] == [first[1], first[3]] + [ids[i] for i in (0, 2, 4, 5)]
    assert [e.seq for _, e in got] == [1, 2, 3, 4, 5, 6]  # the deduplicated ones took no number
    assert pub.publish_many(keys.engine_stream, events) == ids  # and a full repeat adds nothing
    assert client.xlen(keys.engine_stream) == 6


def test_keys_repeated_within_a_batch_append_once_and_take_one_number(client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(client, keys, CONTROLLER)
    ids = pub.publish_many(keys.engine_stream, [ready("a"), ready("b"), ready("c"), ready("d")],
                           idempotency_keys=["k", None, "k", ""])  # "": no key, the event id serves
    assert ids[0] == ids[2] and len(set(ids)) == 3
    assert [e.seq for _, e in entries(client, keys.engine_stream)] == [1, 2, 3]
    assert [e.engine_id for _, e in entries(client, keys.engine_stream)] == ["a", "b", "d"]  # type: ignore[attr-defined]


def test_producers_of_one_batch_are_numbered_apart_and_an_imported_number_is_kept(
        client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(client, keys, CONTROLLER)
    imported = dataclasses.replace(ready("imported", EXECUTOR), seq=41)
    pub.publish_many(keys.engine_stream, [ready("a", EXECUTOR), ready("b"), imported, ready("c", EXECUTOR)])
    pub.publish_many(keys.engine_stream, [ready("d"), ready("e", EXECUTOR)])
    assert [(str(e.producer), e.seq) for _, e in entries(client, keys.engine_stream)] == [
        ("executor/x-0", 1), ("controller/c-0", 1), ("executor/x-0", 41), ("executor/x-0", 2),
        ("controller/c-0", 2), ("executor/x-0", 3)]
    assert client.hget(keys.producer_seqs, "executor/x-0") == b"3"


@pytest.mark.parametrize("start", [0, 125, 254, 65533, 2**32 - 3])
def test_a_stale_guess_across_encoding_widths_is_rewritten_to_the_counters_number(
        client: redis.Redis, keys: Keys, start: int) -> None:
    pub = Publisher(client, keys, CONTROLLER)
    client.hset(keys.producer_seqs, str(CONTROLLER), start)
    pub.publish_many(keys.engine_stream, [ready()])  # the publisher now believes start + 1
    other = Publisher(client, keys, CONTROLLER)  # the same producer name elsewhere takes 4 numbers
    other.publish_many(keys.engine_stream, [ready() for _ in range(4)])
    batch = [ready(f"e{i}") for i in range(3)]
    pub.publish_many(keys.engine_stream, batch)  # written as start + 2.., numbered start + 6..
    single = ready("single")
    other.publish(keys.engine_stream, ready())
    pub.publish(keys.engine_stream, single)  # the single-event script checks its guess the same way
    raws = [raw for _, raw in stored(client, keys.engine_stream)]
    assert raws[5:8] == [numbered(e, start + 6 + i) for i, e in enumerate(batch)]
    assert raws[9] == numbered(single, start + 10)
    assert [e.seq for _, e in entries(client, keys.engine_stream)] == list(range(start + 1, start + 11))


def test_a_failed_append_takes_no_number_and_a_repeat_appends_it(client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(client, keys, CONTROLLER)
    pub.publish(keys.engine_stream, ready())
    client.set(keys.weight_stream("p"), "not a stream")
    events = [ready(f"e{i}") for i in range(3)]
    with pytest.raises(RedisCommandError, match="WRONGTYPE"):
        pub.publish_many(keys.weight_stream("p"), events)
    assert client.hget(keys.producer_seqs, str(CONTROLLER)) == b"1"
    assert client.get(keys.dedupe(keys.weight_stream("p"), events[0].event_id)) is None  # nothing hides a retry
    client.delete(keys.weight_stream("p"))
    pub.publish_many(keys.weight_stream("p"), events)
    assert [e.seq for _, e in entries(client, keys.weight_stream("p"))] == [2, 3, 4]


def test_appends_refused_for_memory_take_no_number_and_their_repeat_goes_through(
        redis_client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(redis_client, keys, CONTROLLER)
    pub.publish_many(keys.engine_stream, [ready()])
    redis_client.config_set("maxmemory", 1)
    try:
        with pytest.raises(RedisCommandError, match="maxmemory"):
            pub.publish_many(keys.engine_stream, [ready("a"), ready("b")])
    finally:
        redis_client.config_set("maxmemory", 0)
    assert redis_client.xlen(keys.engine_stream) == 1
    assert redis_client.hget(keys.producer_seqs, str(CONTROLLER)) == b"1"
    pub.publish_many(keys.engine_stream, [ready("a"), ready("b")])
    assert [e.seq for _, e in entries(redis_client, keys.engine_stream)] == [1, 2, 3]


def test_dedupe_keys_live_as_long_as_publishs(client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(client, keys, CONTROLLER, dedupe_ttl_s=3600)
    event = ready()
    pub.publish_many(keys.engine_stream, [event, ready()], idempotency_keys=[None, "request-7"])
    assert 0 < client.ttl(keys.dedupe(keys.engine_stream, event.event_id)) <= RETRY_DEDUPE_TTL_S
    assert RETRY_DEDUPE_TTL_S < client.ttl(keys.dedupe(keys.engine_stream, "request-7")) <= 3600
    assert pub.entry_for(keys.engine_stream, "request-7") == entries(client, keys.engine_stream)[1][0]


def test_maxlen_trims_the_stream_on_a_batch(client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(client, keys, CONTROLLER)
    for _ in range(10):
        pub.publish_many(keys.engine_stream, [ready() for _ in range(20)], maxlen=5)
    assert 5 <= client.xlen(keys.engine_stream) < 200
    with pytest.raises(TypeError):
        pub.publish_many(keys.engine_stream, [ready()], maxlen="5")  # type: ignore[arg-type]


def test_a_batch_larger_than_one_call_goes_in_one_send_and_keeps_every_guarantee(
        client: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(publish_module, "BATCH_EVENTS", 4)
    pub = Publisher(client, keys, CONTROLLER)
    events = [ready(f"e{i}", EXECUTOR if i % 3 == 0 else CONTROLLER) for i in range(11)]
    ids = pub.publish_many(keys.engine_stream, events[:5])
    calls: list[int] = []
    send = pub._send

    def counted(*args: Any) -> list[Any]:
        calls.append(len(args[0]))
        return send(*args)
    monkeypatch.setattr(pub, "_send", counted)
    ids = pub.publish_many(keys.engine_stream, events)
    assert calls == [3]  # three script calls, one send
    got = entries(client, keys.engine_stream)
    assert [entry_id for entry_id, _ in got] == ids
    assert [e.seq for _, e in got if e.producer == EXECUTOR] == [1, 2, 3, 4]
    assert [e.seq for _, e in got if e.producer == CONTROLLER] == list(range(1, 8))
    monkeypatch.setattr(publish_module, "BATCH_BYTES", 1)  # every event alone
    assert pub.publish_many(keys.engine_stream, [events[2], ready("new")])[0] == ids[2]
    assert calls[-1] == 2


def test_a_batch_reloads_its_script_after_the_server_lost_it(client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(client, keys, CONTROLLER)
    first = pub.publish_many(keys.engine_stream, [ready()], idempotency_keys=["k"])[0]
    client.script_flush()
    assert pub.publish_many(keys.engine_stream, [ready(), ready()], idempotency_keys=["k", None])[0] == first
    client.script_flush()
    assert pub.publish(keys.engine_stream, ready(), idempotency_key="k") == first
    assert client.xlen(keys.engine_stream) == 2


def test_a_leased_batch_goes_through_while_the_lease_holds_and_is_refused_whole_after(
        client: redis.Redis, keys: Keys) -> None:
    fence = LeaseFence(keys.trainer_lease("alpha"), "r0", "tok-a")
    client.hset(fence.key, "r0", f"tok-a|{time.time_ns() // 1_000_000 + 60_000}|host:1")
    pub = Publisher(client, keys, CONTROLLER)
    ids = pub.publish_many(keys.trainer_stream, [ready("a"), ready("b")], idempotency_keys=["a", None], lease=fence)
    assert pub.publish(keys.trainer_stream, ready("a"), idempotency_key="a", lease=fence) == ids[0]
    client.hset(fence.key, "r0", f"tok-b|{time.time_ns() // 1_000_000 + 60_000}|host:2")
    with pytest.raises(LeaseLost, match="held by another holder"):
        pub.publish_many(keys.trainer_stream, [ready("c"), ready("d")], idempotency_keys=["c", None], lease=fence)
    with pytest.raises(LeaseLost):
        pub.publish(keys.trainer_stream, ready("c"), idempotency_key="c", lease=fence)
    assert client.xlen(keys.trainer_stream) == 2
    assert pub.entry_for(keys.trainer_stream, "c") is None
    assert client.hget(keys.producer_seqs, str(CONTROLLER)) == b"2"


def test_a_consumer_takes_every_batched_event_with_nothing_dead_lettered(client: redis.Redis, keys: Keys) -> None:
    pub = Publisher(client, keys, CONTROLLER)
    consumer = Consumer(client, keys, keys.engine_stream, "g", "c0", ConsumerConfig(block_ms=0, count=100))
    consumer.read(block_ms=0)  # the group, made before the events
    events = [ready(f"e{i}") for i in range(20)]
    pub.publish_many(keys.engine_stream, events[:12])
    pub.publish_many(keys.engine_stream, events)
    got = consumer.read(block_ms=0)
    assert [m.event.event_id for m in got] == [e.event_id for e in events]
    assert [m.event.seq for m in got] == list(range(1, 21))
    assert consumer.dead_lettered == 0 and client.xlen(keys.dead_letters) == 0


# hostile inputs: idempotency keys of any text (empty, repeated, long, any code point), producers whose
# counters sit at the edges of the number's encodings, events already numbered, batches and single events mixed
_KEY = st.one_of(st.none(), st.sampled_from(["", "k", "k2", "x" * 300]), st.text(max_size=40))
_PRODUCERS = [CONTROLLER, EXECUTOR, Producer("trainer", "t_9.x-" + "y" * 200)]
_EVENT = st.tuples(st.integers(0, len(_PRODUCERS) - 1), _KEY, st.booleans(), st.integers(0, 5))
_STEP = st.tuples(st.booleans(), st.lists(_EVENT, min_size=0, max_size=9))
_STARTS = st.sampled_from([0, 1, 126, 127, 254, 65534, 65535, 2**32 - 2, 2**40])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(_STEP, min_size=1, max_size=6), starts=st.lists(_STARTS, min_size=3, max_size=3),
       stale=st.booleans())
def test_any_mix_of_batches_and_single_events_matches_one_script_per_event(
        client: redis.Redis, steps: list[tuple[bool, list[tuple[int, str | None, bool, int]]]],
        starts: list[int], stale: bool) -> None:
    keys = Keys(f"h{uuid.uuid4().hex[:10]}")
    stream = keys.engine_stream
    for producer, start in zip(_PRODUCERS, starts, strict=True):
        client.hset(keys.producer_seqs, str(producer), start)
    pub = Publisher(client, keys, CONTROLLER)
    other = Publisher(client, keys, CONTROLLER)
    counters = {str(p): s for p, s in zip(_PRODUCERS, starts, strict=True)}
    seen: dict[str, str] = {}  # the model: effective key -> entry id
    sent: list[Event] = []  # every event published, by any event id it may be repeated under
    expected: list[tuple[Event, int]] = []
    for as_batch, batch in steps:
        events: list[Event] = []
        idem: list[str | None] = []
        for p, key, repeat, nth in batch:
            event: Event = sent[nth % len(sent)] if repeat and sent else ready(f"e{len(sent)}", _PRODUCERS[p])
            sent.append(event)
            events.append(event)
            idem.append(key)
        if as_batch:
            ids = pub.publish_many(stream, events, idempotency_keys=idem)
        else:
            ids = [pub.publish(stream, e, idempotency_key=k) for e, k in zip(events, idem, strict=True)]
        for event, key, entry_id in zip(events, idem, ids, strict=True):
            effective = key or event.event_id
            if effective in seen:
                assert entry_id == seen[effective]
            else:
                seen[effective] = entry_id
                name = str(event.producer)
                counters[name] += 1
                expected.append((event, counters[name]))
        if stale:  # another publisher of the same name: every guess of ``pub`` goes stale
            fresh = ready("other")
            other.publish(stream, fresh)
            sent.append(fresh)
            seen[fresh.event_id] = entries(client, stream)[-1][0]
            counters[str(CONTROLLER)] += 1
            expected.append((fresh, counters[str(CONTROLLER)]))
    assert [raw for _, raw in stored(client, stream)] == [numbered(e, n) for e, n in expected]
    assert sorted(seen.values()) == sorted(entry_id for entry_id, _ in stored(client, stream))
    last: Any = client.hgetall(keys.producer_seqs)
    assert {k.decode(): int(v) for k, v in last.items()} == counters
