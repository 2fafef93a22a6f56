"""Exact evaluation of the tiny LM on a whole arithmetic task: no sampling noise.

With one-digit operands the task has only 100 problems, each drawn with the same probability
(``tasks.arithmetic.problem``), so a policy's expected accuracy is a finite sum: for each problem
the probability that a sample at the rollouts' temperature is the answer's characters followed by
EOS, which one teacher-forced forward pass gives exactly. ``exact_match`` also accepts an answer
with spaces around it, which a trained model all but never writes: the figure is exact up to that
(a lower bound by the probability of those spellings).

A sampled eval of ``n`` problems carries a binomial error of about ``1/sqrt(n)``; this one carries
none, so two runs of the same seed compare problem by problem with nothing but the training between
them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import product

import torch

from rollout_bus.lm import tokenizer
from rollout_bus.lm.model import TinyLM, pad_batch, token_logprobs

MAX_PROBLEMS = 10_000
"""The largest task enumerated whole (two-digit operands: 8,100 problems)."""


def all_problems(digits: int = 1, operator: str = "+") -> list[tuple[str, str]]:
    """Every (prompt, answer) of the task, each as likely as any other under ``problem``'s draw."""
    low, high = (10 ** (digits - 1) if digits > 1 else 0), 10 ** digits - 1
    count = (high - low + 1) ** 2
    if count > MAX_PROBLEMS:
        raise ValueError(f"{digits}-digit operands make {count} problems; exact evaluation enumerates at most "
                         f"{MAX_PROBLEMS}: evaluate by sampling instead")
    out = []
    for a, b in product(range(low, high + 1), repeat=2):
        if operator == "+":
            out.append((f"{a}+{b}=", str(a + b)))
        elif operator == "*":
            out.append((f"{a}*{b}=", str(a * b)))
        elif operator == "-":
            big, small = max(a, b), min(a, b)
            out.append((f"{big}-{small}=", str(big - small)))
        else:
            raise ValueError(f"operator must be '+', '-' or '*', got {operator!r}")
    return out


@torch.no_grad()
def answer_probabilities(model: TinyLM, problems: Sequence[tuple[str, str]], *, temperature: float = 1.0,
                         bos: bool = True, batch_size: int = 512) -> list[float]:
    """For each problem, the probability that one sample at ``temperature`` is the answer, then EOS."""
    model.eval()
    out: list[float] = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        prompts = [tokenizer.encode(p, add_bos=bos) for p, _ in chunk]
        answers = [tokenizer.encode(a, add_eos=True) for _, a in chunk]
        ids, mask = pad_batch([p + a for p, a in zip(prompts, answers, strict=True)], side="right")
        picked = token_logprobs(model, ids, mask, temperature=temperature)
        for row, (p, a) in enumerate(zip(prompts, answers, strict=True)):
            # column t scores token t + 1: the answer's tokens are len(p) .. len(p) + len(a) - 1
            out.append(math.exp(float(picked[row, len(p) - 1:len(p) - 1 + len(a)].sum())))
    return out


def exact_accuracy(model: TinyLM, *, digits: int = 1, operator: str = "+", temperature: float = 1.0) -> list[float]:
    """``answer_probabilities`` over the whole task (``all_problems``): their mean is the expected accuracy."""
    return answer_probabilities(model, all_problems(digits, operator), temperature=temperature)
