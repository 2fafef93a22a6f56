"""The number-guessing environment: its answers and its reward."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from rollout_bus.tasks.guess import CLOSENESS_CREDIT, GuessSource, answer, episode, first_number, score


def test_answers_and_scores() -> None:
    assert [answer(3, 7), answer(9, 7), answer(7, 7), answer(None, 7)][:3] == ["higher.", "lower.", "yes."]
    assert "number" in answer(None, 7)
    assert score([50, 25, 37], 37, 1, 100) == 1.0
    assert 0 < score([50, 25], 37, 1, 100) <= CLOSENESS_CREDIT < 1.0  # shaping never pays a win
    assert score([None, None], 37, 1, 100) == 0.0
    assert first_number("i guess 42, maybe") == 42 and first_number("no idea") is None


def test_games_are_fixed_by_seed_and_split() -> None:
    train, again, held = GuessSource(seed=1), GuessSource(seed=1), GuessSource(seed=1, split="eval")
    assert [train.item(i)["label"] for i in range(20)] == [again.item(i)["label"] for i in range(20)]
    assert [train.item(i)["label"] for i in range(20)] != [held.item(i)["label"] for i in range(20)]
    assert all(1 <= train.item(i)["label"] <= 100 for i in range(50))
    with pytest.raises(ValueError, match="low < high"):
        GuessSource(low=5, high=5)


def test_an_episode_plays_until_it_wins() -> None:
    said: list[list[dict[str, Any]]] = []
    guesses = iter(["50", "25", "37"])

    async def create(**kw: Any) -> Any:
        said.append([dict(m) for m in kw["messages"]])
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=next(guesses)))])

    client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    item = GuessSource(seed=0).item(0) | {"label": 37}
    assert asyncio.run(episode(client, item)) == 1.0
    assert [m["content"] for m in said[-1][1:]] == ["50", "lower.", "25", "higher."]
