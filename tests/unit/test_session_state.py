"""A session's state read back from Redis is untrusted: ``check_state`` refuses every malformed token list."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_bus.events.sessions import UNKNOWN_VERSION, BadState, check_state, new_state


def with_turn(**change: Any) -> dict[str, Any]:
    turn: dict[str, Any] = {"new_ids": [5, 6], "output_ids": [7, 0], "versions": [3, 3], "logprobs": [-0.5, -1],
                            "messages": [], "engine_id": "e0"}
    turn.update(change)
    state = new_state("s1", "default", max_context=64)
    state["turns"] = [turn]
    state["position"] = 1
    return state


def test_well_formed_turns_pass() -> None:
    assert check_state("s1", with_turn())["turns"][0]["output_ids"] == [7, 0]
    assert check_state("s1", with_turn(new_ids=[], output_ids=[], versions=[], logprobs=[]))


@pytest.mark.parametrize("key", ["new_ids", "output_ids"])
@pytest.mark.parametrize("bad", [[1, -1], [1, True], [1, 2.0], [1, "2"], [None], "12", {"a": 1}])
def test_token_lists_must_be_non_negative_ints(key: str, bad: Any) -> None:
    change = {key: bad}
    if key != "new_ids" and isinstance(bad, list):  # keep the lengths right: only the values are wrong
        change = {"output_ids": [7] * len(bad), "versions": [3] * len(bad), "logprobs": [-0.5] * len(bad), key: bad}
    with pytest.raises(BadState, match=f"{key} must be a list of non-negative integers"):
        check_state("s1", with_turn(**change))


@pytest.mark.parametrize("bad", [[1, -2], [1, True], [1, 2.0], [1, "2"], [None], "12", {"a": 1}])
def test_versions_must_be_versions_or_unknown(bad: Any) -> None:
    change: dict[str, Any] = {"versions": bad}
    if isinstance(bad, list):
        change.update(output_ids=[7] * len(bad), logprobs=[-0.5] * len(bad))
    with pytest.raises(BadState, match="versions must be a list of integers, each a version or -1"):
        check_state("s1", with_turn(**change))


def test_a_token_of_unknown_version_is_a_well_formed_turn() -> None:
    """SGLang without --weight-version reports "default": such a token's version is -1, never a bad state."""
    state = check_state("s1", with_turn(output_ids=[7, 0], versions=[UNKNOWN_VERSION, 3], logprobs=[-0.5, -0.5]))
    assert state["turns"][0]["versions"] == [-1, 3]


@pytest.mark.parametrize("bad", [[-0.5, "x"], [-0.5, None], "x"])
def test_logprobs_must_be_numbers(bad: Any) -> None:
    with pytest.raises(BadState, match="logprobs must be a list of numbers"):
        check_state("s1", with_turn(logprobs=bad))
