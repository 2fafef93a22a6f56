"""A multi-turn environment: guess the number, told "higher" or "lower" after each wrong guess.

The agent (``episode``) plays one game through an OpenAI client bound to its session: the model guesses,
the environment answers, up to ``max_turns`` guesses. A model can get better at it within its context
by using the answers (halving the range each time wins 1..100 in 7 guesses). The reward is 1 for finding
the number, plus nothing for the turns it took; a game not won pays at most ``closeness_credit`` for how
close its last guess came, so shaping never pays as much as a win. Written in the tiny LM's alphabet
(lowercase, digits, a few symbols), so the same game runs on the tiny LM and on a real model.

    rollout-bus run --agent guess                 # the tiny LM: the mechanics in about a minute
    rollout-bus run --agent guess --model smollm2 # the real model
"""

from __future__ import annotations

import random
import re
from typing import Any

from rollout_bus.tasks.indexed import IndexedSource

MAX_TURNS = 6
CLOSENESS_CREDIT = 0.3
_NUMBER = re.compile(r"-?\d+")


def rules(low: int, high: int, max_turns: int) -> str:
    return (f"guess my number. it is between {low} and {high}. you have {max_turns} guesses. after each guess i "
            "say higher or lower. answer with the number only.")


class GuessSource(IndexedSource):
    """Games by sequence number: the secret number of game ``index`` is fixed by ``seed``."""

    def __init__(self, low: int = 1, high: int = 100, max_turns: int = MAX_TURNS, seed: int = 0,
                 size: int | None = None, split: str = "train") -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if not isinstance(low, int) or not isinstance(high, int) or not low < high:
            raise ValueError(f"low and high must be integers with low < high, got {low!r} and {high!r}")
        if not isinstance(max_turns, int) or not 1 <= max_turns <= 64:
            raise ValueError(f"max_turns must be an integer in [1, 64], got {max_turns!r}")
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"size must be a positive integer or None, got {size!r}")
        super().__init__()
        self.low, self.high, self.max_turns, self.seed, self.size = low, high, max_turns, seed, size
        self.split = split
        self.name = f"guess-{split}-{low}-{high}-t{max_turns}-s{seed}" + (f"-n{size}" if size else "")

    def item(self, index: int) -> dict[str, Any]:
        game = index % self.size if self.size else index
        secret = random.Random(f"{self.seed}:{self.split}:{game}").randint(self.low, self.high)
        return {"index": index, "prompt": rules(self.low, self.high, self.max_turns), "label": secret,
                "metadata": {"low": self.low, "high": self.high, "max_turns": self.max_turns}}


def first_number(text: str) -> int | None:
    match = _NUMBER.search(text or "")
    return int(match.group()) if match else None


def answer(guess: int | None, secret: int) -> str:
    if guess is None:
        return "that is not a number. answer with the number only."
    if guess < secret:
        return "higher."
    if guess > secret:
        return "lower."
    return "yes."


def score(guesses: list[int | None], secret: int, low: int, high: int) -> float:
    """1 for a win; else up to ``CLOSENESS_CREDIT`` for how close the last real guess came."""
    if secret in guesses:
        return 1.0
    real = [g for g in guesses if g is not None]
    if not real:
        return 0.0
    miss = abs(real[-1] - secret) / max(high - low, 1)
    return CLOSENESS_CREDIT * max(0.0, 1.0 - miss)


async def episode(client: Any, item: dict[str, Any]) -> float:
    """One game through ``client`` (``openai.AsyncOpenAI`` bound to the session); the reward."""
    meta = item.get("metadata") or {}
    low, high = int(meta.get("low", 1)), int(meta.get("high", 100))
    max_turns = int(meta.get("max_turns", MAX_TURNS))
    secret = int(item["label"])
    messages: list[dict[str, Any]] = [{"role": "user", "content": str(item["prompt"])}]
    guesses: list[int | None] = []
    for _ in range(max_turns):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
        message = reply.choices[0].message
        messages.append({"role": "assistant", "content": message.content or ""})
        guess = first_number(message.content or "")
        guesses.append(guess)
        said = answer(guess, secret)
        if said == "yes.":
            break
        messages.append({"role": "user", "content": said})
    return score(guesses, secret, low, high)
