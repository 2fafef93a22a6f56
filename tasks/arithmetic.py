"""A toy verifiable task: sums of random numbers ("12+34=" -> "46"), scored by exact match.

Problem ``i`` of a seed is a pure function of ``(seed, digits, i)``, so any process can
rebuild any prompt from its index. The data source hands out prompts in index order and
keeps its position (and prompts given back with ``add_samples``) in a small state dict
that the executor saves in Redis.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol

from rollout_bus.lm import tokenizer
from rollout_bus.tasks.indexed import IndexedSource


class _Scored(Protocol):
    response_ids: list[int]
    label: Any


SPLITS = ("train", "eval")


def problem(index: int, *, digits: int = 2, seed: int = 0, operator: str = "+", split: str = "train") -> tuple[str, str]:
    """The prompt and the answer of problem ``index`` of ``split`` (each split its own random stream)."""
    rng = random.Random(f"arith:{seed}:{digits}:{operator}:{index}" if split == "train"
                        else f"arith-{split}:{seed}:{digits}:{operator}:{index}")
    low, high = 10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1
    a, b = rng.randint(low, high), rng.randint(low, high)
    if operator == "+":
        answer = a + b
    elif operator == "-":
        a, b = max(a, b), min(a, b)
        answer = a - b
    elif operator == "*":
        answer = a * b
    else:
        raise ValueError(f"operator must be '+', '-' or '*', got {operator!r}")
    return f"{a}{operator}{b}=", str(answer)


class ArithmeticSource(IndexedSource):
    """Data source of arithmetic prompts; ``size`` makes it a finite set visited in epochs.

    ``split="eval"`` draws the held-out problems from a random stream of their own. With few digits the
    problems themselves cannot be kept apart (one-digit sums are only 100): the eval split then holds
    fixed draws of the same distribution, not problems training never saw.
    """

    def __init__(self, digits: int = 2, seed: int = 0, operator: str = "+", size: int | None = None,
                 bos: bool = True, split: str = "train") -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if not isinstance(digits, int) or not 1 <= digits <= 9:
            raise ValueError(f"digits must be an integer in [1, 9], got {digits!r}")
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"size must be a positive integer or None, got {size!r}")
        problem(0, digits=digits, seed=seed, operator=operator)  # validates the operator
        super().__init__()
        self.digits = digits
        self.seed = seed
        self.operator = operator
        self.size = size
        self.bos = bos
        self.split = split
        self.name = (f"arith-{operator.replace('*', 'x')}-d{digits}-s{seed}" + ("-eval" if split == "eval" else "")
                     + (f"-n{size}" if size else ""))

    def item(self, index: int) -> dict[str, Any]:
        """Prompt number ``index`` (a sequence number; with ``size`` it wraps into epochs)."""
        prompt, label = problem(index % self.size if self.size else index, digits=self.digits, seed=self.seed,
                                operator=self.operator, split=self.split)
        return {"index": index, "prompt": prompt, "label": label,
                "prompt_ids": tokenizer.encode(prompt, add_bos=self.bos)}


def answer_of(response_ids: Sequence[int]) -> str:
    """The decoded response up to the first EOS."""
    ids = list(response_ids)
    if tokenizer.EOS_ID in ids:
        ids = ids[:ids.index(tokenizer.EOS_ID)]
    return tokenizer.decode(ids).strip()


def exact_match(sample: _Scored) -> float:
    """1.0 when the response up to EOS is exactly the label, else 0.0."""
    return 1.0 if answer_of(sample.response_ids) == str(sample.label) else 0.0
