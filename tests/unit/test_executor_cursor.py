"""Prompt reservations: a retry reuses its prompts, finished requests return the unused ones."""

from __future__ import annotations

import fakeredis

from rollout_bus.events.names import Keys
from rollout_bus.executor.cursor import CursorStore
from rollout_bus.tasks.arithmetic import ArithmeticSource


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


def test_prompts_a_request_gives_back_go_out_first_and_a_retry_never_gives_them_back_twice(
        fake_client: fakeredis.FakeRedis, keys: Keys) -> None:
    store, source = CursorStore(fake_client, keys), ArithmeticSource()
    key = store.key("p", source)
    stale = store.reserve(key, source, "a", 0, 2)
    store.mark_used(key, "a", [0, 1])
    store.finalize(key, "a")
    # request "b" gives rollout "a"'s two prompts back: they are the first it draws
    assert indices(store.reserve(key, source, "b", 0, 3, returned=stale)) == [0, 1, 2]
    # "b" is retried (its executor died): same prompts, and nothing given back again
    assert indices(store.reserve(key, source, "b", 0, 3, returned=stale)) == [0, 1, 2]
    assert indices(store.reserve(key, source, "b", 1, 1, returned=stale)) == [3]
    assert indices(store.reserve(key, source, "c", 0, 2)) == [4, 5]


def test_given_back_prompts_beyond_the_first_draw_stay_for_the_next_request(
        fake_client: fakeredis.FakeRedis, keys: Keys) -> None:
    store, source = CursorStore(fake_client, keys), ArithmeticSource()
    key = store.key("p", source)
    stale = store.reserve(key, source, "a", 0, 3)
    store.mark_used(key, "a", [0, 1, 2])
    store.finalize(key, "a")
    assert indices(store.reserve(key, source, "b", 0, 1, returned=stale)) == [0]
    assert indices(store.reserve(key, source, "c", 0, 3)) == [1, 2, 3]
