"""Exact evaluation of the tiny LM: the probability of each answer, against a token-by-token computation."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_bus.lm import tokenizer
from rollout_bus.lm.model import build_model
from rollout_bus.tasks.arithmetic import problem
from rollout_bus.tasks.exact import all_problems, answer_probabilities, exact_accuracy


def by_hand(model: torch.nn.Module, prompt: str, answer: str, temperature: float) -> float:
    """One forward pass per answer token on the growing prefix, its log-probability at ``temperature`` summed."""
    ids = tokenizer.encode(prompt, add_bos=True)
    total = 0.0
    with torch.no_grad():
        for token in tokenizer.encode(answer, add_eos=True):
            logits = model(torch.tensor([ids]))[0, -1] / temperature
            total += float(torch.log_softmax(logits.float(), dim=-1)[token])
            ids.append(token)
    return math.exp(total)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_each_answers_probability_is_what_a_token_by_token_pass_gives(temperature: float) -> None:
    model = build_model(seed=3)
    problems = [("3+4=", "7"), ("9+9=", "18"), ("0+0=", "0")]  # one- and two-character answers, padded together
    got = answer_probabilities(model, problems, temperature=temperature, batch_size=2)
    want = [by_hand(model, p, a, temperature) for p, a in problems]
    assert got == pytest.approx(want, rel=1e-4)
    assert all(0.0 < g < 1.0 for g in got)


def test_the_whole_one_digit_task_is_the_hundred_problems_the_draw_can_make() -> None:
    problems = all_problems(1, "+")
    assert len(problems) == len(set(problems)) == 100
    drawn = {problem(i, digits=1, seed=s, split=split) for i in range(300) for s in (0, 1) for split in ("train", "eval")}
    assert drawn <= set(problems)
    assert len(all_problems(2, "*")) == 8100
    with pytest.raises(ValueError, match="evaluate by sampling instead"):
        all_problems(3)


def test_exact_accuracy_is_one_probability_per_problem() -> None:
    values = exact_accuracy(build_model(seed=0))
    assert len(values) == 100 and all(0.0 <= v <= 1.0 for v in values)
