"""The toy arithmetic task: deterministic prompts, saveable position, exact-match reward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from rollout_bus.lm import tokenizer
from rollout_bus.tasks.arithmetic import ArithmeticSource, exact_match, problem


def test_problems_are_a_pure_function_of_seed_digits_and_index() -> None:
    assert problem(5) == problem(5)
    assert problem(5) != problem(6)
    prompt, answer = problem(11, digits=3, seed=4)
    a, b = prompt.rstrip("=").split("+")
    assert len(a) == len(b) == 3 and int(a) + int(b) == int(answer)
    assert problem(0, operator="*")[0].count("*") == 1
    with pytest.raises(ValueError, match="operator"):
        ArithmeticSource(operator="/")


def test_the_source_saves_and_restores_its_position_and_requeued_items() -> None:
    src = ArithmeticSource(digits=2, seed=1)
    first = src.get_samples(3)
    assert [it["index"] for it in first] == [0, 1, 2]
    assert first[0]["prompt_ids"][0] == tokenizer.BOS_ID
    src.add_samples([first[1]])
    state = src.save()
    other = ArithmeticSource(digits=2, seed=1)
    other.load(state)
    assert [it["index"] for it in other.get_samples(3)] == [1, 3, 4]


def test_a_finite_source_wraps_into_epochs() -> None:
    src = ArithmeticSource(size=2)
    items = src.get_samples(4)
    assert [it["index"] for it in items] == [0, 1, 2, 3]
    assert items[2]["prompt"] == items[0]["prompt"] and src.name.endswith("-n2")


@dataclass
class Done:
    label: str
    response_ids: list[int] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)


def test_exact_match_compares_the_answer_up_to_eos() -> None:
    eos = tokenizer.EOS_ID
    assert exact_match(Done("46", tokenizer.encode("46") + [eos] + tokenizer.encode("9"))) == 1.0
    assert exact_match(Done("46", tokenizer.encode("46"))) == 1.0
    assert exact_match(Done("46", tokenizer.encode("467") + [eos])) == 0.0
    assert exact_match(Done("46", [])) == 0.0
