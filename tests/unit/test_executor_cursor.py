"""Prompt reservations: a retry reuses its prompts, finished requests return the unused ones."""

from __future__ import annotations

import fakeredis

from events.names import Keys
from executor.cursor import CursorStore
from tasks.arithmetic import ArithmeticSource


def indices(items: list[dict[str, object]]) -> list[object]:
    return [it["index"] for it in items]


def test_a_retry_gets_the_same_prompts_and_other_requests_the_next(fake_client: fakeredis.FakeRedis,
                                                                   keys: Keys) -> None:
    store, source = CursorStore(fake_client, keys), ArithmeticSource()
    key = store.key("p", source)
    assert indices(store.reserve(key, source, "a", 0, 3)) == [0, 1, 2]
    assert indices(store.reserve(key, source, "b", 0, 2)) == [3, 4]
    # "a" runs again (its executor died): same prompts, nothing new drawn
    assert indices(store.reserve(key, source, "a", 0, 3)) == [0, 1, 2]
    assert indices(store.reserve(key, source, "a", 1, 1)) == [5]
    # a fresh source object (another executor) continues from the saved state
    assert indices(store.reserve(key, ArithmeticSource(), "c", 0, 1)) == [6]


def test_finalize_returns_unused_prompts_which_go_out_first(fake_client: fakeredis.FakeRedis, keys: Keys) -> None:
    store, source = CursorStore(fake_client, keys), ArithmeticSource()
    key = store.key("p", source)
    store.reserve(key, source, "a", 0, 4)
    store.mark_used(key, "a", [0, 2])
    assert store.finalize(key, "a") == 2
    assert store.finalize(key, "a") == 0  # idempotent
    assert store.reservations(key, "a") == []
    assert indices(store.reserve(key, source, "b", 0, 3)) == [1, 3, 4]


def test_a_failed_request_returns_its_prompts_unless_they_were_the_problem(fake_client: fakeredis.FakeRedis,
                                                                          keys: Keys) -> None:
    store, source = CursorStore(fake_client, keys), ArithmeticSource()
    key = store.key("p", source)
    store.reserve(key, source, "a", 0, 2)
    store.reserve(key, source, "a", 1, 1)
    store.reserve(key, source, "bad", 0, 2)
    store.reserve(key, source, "worse", 0, 2)
    assert store.release(key, "a") == 3
    assert store.release(key, "bad", drop=True) == 0
    assert store.release(key, "worse", drop=[5]) == 1
    assert indices(store.reserve(key, source, "c", 0, 6)) == [0, 1, 2, 6, 7, 8]


def test_eval_draws_do_not_move_the_cursor(fake_client: fakeredis.FakeRedis, keys: Keys) -> None:
    store, source = CursorStore(fake_client, keys), ArithmeticSource()
    key = store.key("p", source)
    store.reserve(key, source, "a", 0, 2)
    assert indices(store.draw_fresh(source, 3)) == [0, 1, 2]
    assert indices(store.reserve(key, source, "b", 0, 1)) == [2]


def test_prompts_given_back_go_out_first_once(fake_client: fakeredis.FakeRedis, keys: Keys) -> None:
    store, source = CursorStore(fake_client, keys), ArithmeticSource()
    key = store.key("p", source)
    stale = store.reserve(key, source, "a", 0, 2)
    store.mark_used(key, "a", [0, 1])
    store.finalize(key, "a")
    assert store.give_back(key, stale) == 2
    assert store.give_back(key, stale[:1]) == 0  # already there
    assert indices(store.reserve(key, source, "b", 0, 3)) == [0, 1, 2]
