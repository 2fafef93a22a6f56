"""The session store on fakeredis (with Lua): the call lock, revision-checked commits, hostile states."""

from __future__ import annotations

from typing import Any

import fakeredis
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bus.events.names import Keys
from rollout_bus.events.sessions import (
    BadState,
    SessionBusy,
    SessionConflict,
    SessionNotFound,
    SessionStore,
    check_state,
    new_state,
)


@pytest.fixture()
def store() -> SessionStore:
    return SessionStore(fakeredis.FakeRedis(), Keys("t"))


def test_a_call_sent_again_is_the_same_call(store: SessionStore) -> None:
    """What the store sends again after a lost reply: the lock script of the same token finds the lock its own; the
    commit of the same token and revision, once written, answers done without writing again."""
    assert store.create(new_state("s", "p", max_context=64))
    held = store.begin("s", "a")
    again = store.begin("s", "a")  # the same call (its first reply lost)
    assert again.rev == held.rev
    with pytest.raises(SessionBusy):
        store.begin("s", "b")
    before = dict(held.state)
    store.commit(held, {**before, "engine_id": "e1"}, release=False)
    rev = store.client.hget(store.keys.session("s"), "rev")
    resent = type(held)(held.sid, held.token, again.rev, before, held.tenant)  # the commit as first sent
    store.commit(resent, {**before, "engine_id": "e1"}, release=False)  # sent again: done already, nothing written
    assert store.client.hget(store.keys.session("s"), "rev") == rev
    stale = type(held)(held.sid, held.token, again.rev, before, held.tenant)
    with pytest.raises(SessionConflict):  # the same token and revision with another state: stale, not "done"
        store.commit(stale, {**before, "engine_id": "e2"})
    assert store.client.hget(store.keys.session("s"), "rev") == rev
    assert store.get("s")["engine_id"] == "e1"  # type: ignore[index]
    store.commit(held, {**held.state, "engine_id": "e3"})  # the call's next commit (its lock kept) goes through
    assert store.get("s")["engine_id"] == "e3"  # type: ignore[index]


def test_one_call_at_a_time(store: SessionStore) -> None:
    assert store.create(new_state("s", "p", max_context=64))
    assert not store.create(new_state("s", "p", max_context=64))  # never overwritten
    held = store.begin("s", "a")
    with pytest.raises(SessionBusy):
        store.begin("s", "b")
    store.commit(held, {**held.state, "position": 0, "engine_id": "e0"})
    again = store.begin("s", "b")  # the commit freed the lock
    assert again.state["engine_id"] == "e0"
    store.release("s", "b")


def test_a_commit_after_losing_the_lock_or_the_race_is_refused(store: SessionStore) -> None:
    store.create(new_state("s", "p", max_context=64))
    held = store.begin("s", "a")
    store.unlock("s")  # a retried episode took the session over
    other = store.begin("s", "b")
    with pytest.raises(SessionConflict):
        store.commit(held, held.state)
    store.commit(other, other.state)
    stale = store.begin("s", "c")
    stale.rev = b"0"
    with pytest.raises(SessionConflict):
        store.commit(stale, stale.state)


def test_unknown_sessions_and_bad_ids(store: SessionStore) -> None:
    with pytest.raises(SessionNotFound):
        store.begin("nobody", "a")
    assert store.get("nobody") is None
    with pytest.raises(ValueError, match="'/'"):
        store.get("a/etc")


def test_offers_are_claimed_once(store: SessionStore) -> None:
    for sid in ("a", "b"):
        store.create(new_state(sid, "p", max_context=64))
    store.offer("p", ["a", "b"])
    assert [store.claim("p"), store.claim("p"), store.claim("p")] == ["a", "b", None]


def test_a_malformed_state_is_bad_state_not_a_crash(store: SessionStore) -> None:
    key = store.keys.session("s")
    store.client.hset(key, mapping={"rev": b"0", "state": b"\xc1not msgpack"})
    with pytest.raises(BadState):
        store.get("s")
    with pytest.raises(BadState):
        store.begin("s", "a")
    assert store.client.exists(store.keys.session_busy("s")) == 0  # the lock went back


base = new_state("s", "p", max_context=64)
turn = {"kind": "chat", "messages": [], "new_ids": [1], "output_ids": [2], "logprobs": [-1.0], "versions": [0],
        "engine_id": "e0", "finish": "stop", "reply": {}}


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(sorted(base)), value=st.none() | st.integers(-2**62, 2**62) | st.text(max_size=70)
       | st.lists(st.integers(-2**62, 2**62), max_size=3) | st.floats(allow_nan=True) | st.booleans(),
       turn_key=st.sampled_from(sorted(turn)), turn_value=st.none() | st.integers(-3, 3) | st.text(max_size=5)
       | st.lists(st.integers(-2, 2), max_size=3))
def test_any_tampered_state_is_rejected_or_still_well_formed(key: str, value: Any, turn_key: str,
                                                              turn_value: Any) -> None:
    for state in ({**base, key: value}, {**base, "turns": [{**turn, turn_key: turn_value}], "position": 1}):
        raw = msgpack.packb(state, use_bin_type=True)
        try:
            checked = check_state("s", msgpack.unpackb(raw, raw=False))
        except BadState:
            continue
        assert checked["policy"] and checked["max_context"] > 0 and 0 <= checked["position"] <= len(checked["turns"])
        for t in checked["turns"]:
            assert len(t["output_ids"]) == len(t["logprobs"]) == len(t["versions"])


def test_a_session_is_found_only_by_its_tenant_and_another_never_takes_its_lock(store: SessionStore) -> None:
    assert store.create(new_state("s", "p", max_context=64), tenant="a")
    assert store.get("s", tenant="a") is not None and store.get("s") is not None  # None: a caller of every tenant
    assert store.get("s", tenant="b") is None
    with pytest.raises(SessionNotFound):
        store.begin("s", "t1", tenant="b")
    assert not store.client.exists(store.keys.session_busy("s"))
    held = store.begin("s", "t2", tenant="a")
    assert held.tenant == "a"
    store.release("s", "t2")
    assert not store.bind("s", "b")  # bound already
    assert store.tenant("s") == "a"


def test_an_offered_session_is_bound_by_its_claim(store: SessionStore) -> None:
    assert store.create(new_state("o", "p", max_context=64))
    assert store.tenant("o") == "" and store.get("o", tenant="a") is None
    assert store.bind("o", "a") and store.bind("o", "a")  # again by the same tenant: no change
    assert store.get("o", tenant="a") is not None and store.get("o", tenant="b") is None
    assert not store.bind("gone", "a")
    with pytest.raises(ValueError, match="'.'"):
        store.bind("o", "a.b")
