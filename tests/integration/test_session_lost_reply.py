"""A session call's reply lost on the wire (a real redis-server behind a TCP proxy that drops one reply).

The script ran on the server; only its reply died with the connection. The call is sent again, and each of a
call's scripts is idempotent for its token: ``begin`` finds the lock its own (not a busy session for the lock's
whole lifetime), ``commit`` finds the revision its own (not a conflict after a write that went through), and the
commit's event is appended once. Both the plain calls and the pipelined ones (``send_begin``, ``send_commit``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from rollout_bus.events.connection import connect
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import Producer, SessionTurn
from rollout_bus.events.sessions import _COMMIT_PUBLISH, SessionStore, SessionStoreUnavailable, new_state
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.integration
PRODUCER = Producer("gateway", "t")


@pytest.fixture()
def store(proxy: TcpProxy, keys: Keys) -> Iterator[SessionStore]:
    client = connect(proxy.url)
    s = SessionStore(client, keys)
    assert s.create(new_state("s", "p", max_context=64))
    s.update("s", "warm", lambda st: st)
    client.script_load(_COMMIT_PUBLISH)
    # every script loaded: the dropped reply is the script's own, not a NOSCRIPT answer
    assert all(client.script_exists(s._begin.sha, s._commit.sha, s._commit_publish.sha))
    yield s
    client.close()


def _event(publisher: Publisher, turn: int) -> tuple[list[Any], list[Any]]:
    return publisher.prepared(publisher.keys.session_stream, SessionTurn(
        producer=PRODUCER, policy="p", session_id="s", turn=turn, engine_id="e0", new_tokens=1, output_tokens=1,
        cached_tokens=0, oldest_version=0, newest_version=0, finish="stop", gen_ms=1.0, env_ms=0.0))


@pytest.mark.parametrize("pipelined", [False, True], ids=["plain", "pipelined"])
def test_a_call_whose_replies_are_lost_takes_its_lock_and_commits_once(
        store: SessionStore, proxy: TcpProxy, redis_client: redis.Redis, keys: Keys, pipelined: bool) -> None:
    publisher = Publisher(store.client, keys, PRODUCER)
    rev = int(redis_client.hget(keys.session("s"), "rev") or 0)

    proxy.drop_next_reply(store._begin.sha.encode())
    held = store.send_begin("s", "call-1").held() if pipelined else store.begin("s", "call-1")
    assert proxy.dropped == 1  # the fault happened: the lock was taken, its reply lost
    assert redis_client.get(keys.session_busy("s")) == b"call-1"
    assert held.token == "call-1" and int(held.rev) == rev

    proxy.drop_next_reply(store._commit_publish.sha.encode())
    new = {**held.state, "engine_id": "e7"}
    if pipelined:
        store.send_commit(held, new, publish=_event(publisher, 1)).done()
    else:
        store.commit(held, new, publish=_event(publisher, 1))
    assert proxy.dropped == 2  # the commit ran, its reply lost
    assert int(redis_client.hget(keys.session("s"), "rev") or 0) == rev + 1  # written once
    assert int(held.rev) == rev + 1 and held.state["engine_id"] == "e7"
    assert store.get("s")["engine_id"] == "e7"  # type: ignore[index]
    assert redis_client.get(keys.session_busy("s")) is None  # the lock freed
    assert redis_client.xlen(keys.session_stream) == 1  # the event appended once
    assert store.guard.outages == (0 if pipelined else 2)  # a pipelined reply lost: the plain call is the retry

    again = store.begin("s", "call-2")  # the session serves its next call at once
    store.commit(again, {**again.state, "engine_id": "e8"})
    assert int(redis_client.hget(keys.session("s"), "rev") or 0) == rev + 2


def test_a_commit_sent_again_after_another_call_wrote_is_still_refused(
        store: SessionStore, redis_client: redis.Redis, keys: Keys) -> None:
    """The 'already done' answer is only for the commit that wrote: a late writer still conflicts."""
    from rollout_bus.events.sessions import SessionConflict

    first = store.begin("s", "a")
    store.commit(first, {**first.state, "engine_id": "e1"})
    stale = store.begin("s", "b")
    store.unlock("s")
    taker = store.begin("s", "c")
    store.commit(taker, {**taker.state, "engine_id": "e2"})
    with pytest.raises(SessionConflict):
        store.commit(stale, {**stale.state, "engine_id": "e3"})
    with pytest.raises(SessionConflict):  # an earlier call's commit sent again once another wrote: refused
        store.commit(first, {**first.state, "engine_id": "e9"})
    assert store.get("s")["engine_id"] == "e2"  # type: ignore[index]


def test_a_store_that_stays_away_fails_the_call_with_503_after_its_budget(
        store: SessionStore, proxy: TcpProxy) -> None:
    store.guard.policy = type(store.guard.policy)(max_wait_s=0.3, base_s=0.02, cap_s=0.1)
    proxy.cut()
    with pytest.raises(SessionStoreUnavailable) as failed:
        store.begin("s", "call-x")
    assert failed.value.status == 503 and "send it again" in str(failed.value)
    proxy.heal()
    held = store.begin("s", "call-x")  # back: the same call goes through
    store.commit(held, dict(held.state))
