"""Arithmetic word problems with names and units, in a model's chat template: a data source plug-in.

``problem(split, index, ...)`` is a pure function: a person starts with some quantity
("Maya buys 3 bags with 4 kilograms of flour in each bag.") and 1 to 3 more steps change it
(gives some away, buys more, doubles it, shares it equally), then a question asks for the
final amount. Every intermediate value is a positive integer.

Train and eval never share a problem: a problem's split is a hash of its text, and problem
``index`` of a split is the first draw of its own random stream that hashes into that split.
So the splits are disjoint by construction, whatever the seeds and indices, and any process
rebuilds any problem from ``(split, seed, index, options)``.

A problem *restates its answer* when the answer is the only number in its text ("Leo has 7
apples. How many apples does Leo have now?"): answering it takes copying, not arithmetic, so it
says nothing about what training changed. ``MathWordsSource`` leaves such problems out of the
eval split (``restated="drop"``, the default there) and keeps them in train.

``MathWordsSource`` serves one split. With ``tokenizer`` (a Hugging Face model directory) the
prompt is rendered through the model's chat template and tokenized, so executors send and
train on exactly the template's tokens. Every item carries the reward's options in its
``metadata``, so the reward (``tasks.math_reward.reward``) needs no configuration of its own:
the whole task travels in the request's ``data`` (merged over the executor's
``--data-source-args``).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any, Literal

from rollout_bus.lm import hf_tokenizer
from rollout_bus.tasks.indexed import IndexedSource

Split = Literal["train", "eval"]
AnswerFormat = Literal["boxed", "hashes"]
SPLITS: tuple[str, ...] = ("train", "eval")
EVAL_PER_MILLE = 125
"""The share of all problems (in thousandths, by text hash) that belongs to eval."""
MAX_DRAWS = 1000

NAMES = ("Maya", "Leo", "Aisha", "Tom", "Sofia", "Ravi", "Emma", "Kenji", "Lucia", "Omar", "Nina", "Pablo",
         "Grace", "Ivan", "Zara", "Ben", "Mei", "Carlos", "Hana", "Felix")
THINGS = (("kilograms of flour", "bag", "bags"), ("liters of juice", "bottle", "bottles"),
          ("meters of rope", "coil", "coils"), ("marbles", "jar", "jars"), ("stickers", "sheet", "sheets"),
          ("cookies", "box", "boxes"), ("pencils", "pack", "packs"), ("eggs", "carton", "cartons"),
          ("grams of tea", "tin", "tins"), ("apples", "crate", "crates"), ("stamps", "album", "albums"),
          ("dollars", "envelope", "envelopes"), ("books", "stack", "stacks"), ("shells", "bucket", "buckets"))
MULTIPLIERS = {2: "doubles", 3: "triples"}

INSTRUCTIONS: dict[str, str] = {
    "boxed": "Please reason step by step, and put your final answer within \\boxed{}.",
    "hashes": "Please reason step by step, and write the final number on the last line after '####'.",
}


@dataclass(frozen=True)
class Problem:
    text: str
    answer: int
    steps: int


def split_of(text: str) -> str:
    """The split a problem text belongs to (a stable hash of the text)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "big") % 1000 < EVAL_PER_MILLE else "train"


def _draw(rng: random.Random, steps: int, max_number: int) -> Problem:
    name, other = rng.sample(NAMES, 2)
    thing, container, containers = rng.choice(THINGS)
    if rng.random() < 0.5:
        count, each = rng.randint(2, 5), rng.randint(2, max(2, max_number // 4))
        value = count * each
        sentences = [f"{name} buys {count} {containers} with {each} {thing} in each {container}."]
    else:
        value = rng.randint(2, max_number)
        sentences = [f"{name} has {value} {thing}."]
    for _ in range(steps - 1):
        ops = ["add"] + (["sub"] if value > 1 else []) + (["mul"] if value * 2 <= 4 * max_number else [])
        ops += ["div"] if any(value % k == 0 for k in (2, 3, 4)) else []
        op = rng.choice(ops)
        if op == "add":
            n = rng.randint(1, max_number)
            sentences.append(f"Then {name} gets {n} more {thing}.")
            value += n
        elif op == "sub":
            n = rng.randint(1, value - 1)
            sentences.append(f"{name} gives {n} {thing} to {other}.")
            value -= n
        elif op == "mul":
            k = rng.choice([k for k in MULTIPLIERS if value * k <= 4 * max_number] or [2])
            sentences.append(f"Then {name} {MULTIPLIERS[k]} the amount of {thing}.")
            value *= k
        else:
            k = rng.choice([k for k in (2, 3, 4) if value % k == 0])
            friends = "a friend" if k == 2 else f"{k - 1} friends"
            sentences.append(f"{name} shares the {thing} equally with {friends} and keeps one share.")
            value //= k
    sentences.append(f"How many {thing} does {name} have now?")
    return Problem(" ".join(sentences), value, steps)


def restates_answer(p: Problem) -> bool:
    """Whether the answer is the only number in the problem's text (nothing to compute)."""
    numbers = set(re.findall(r"\d+", p.text))
    return numbers == {str(p.answer)}


def problem(split: str, index: int, *, seed: int = 0, min_steps: int = 2, max_steps: int = 3,
            max_number: int = 20) -> Problem:
    """Problem ``index`` of ``split``: the first draw of its own stream whose text hashes into ``split``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"math-words:{seed}:{split}:{index}:{min_steps}:{max_steps}:{max_number}")
    for _ in range(MAX_DRAWS):
        drawn = _draw(rng, rng.randint(min_steps, max_steps), max_number)
        if split_of(drawn.text) == split:
            return drawn
    raise RuntimeError(f"no {split} problem in {MAX_DRAWS} draws")  # p < (1 - 0.125) ** 1000


class MathWordsSource(IndexedSource):
    """Data source of word problems of one split, rendered through a model's chat template.

    ``size`` makes it a finite set visited in epochs (eval sets); ``answer_format`` is the form
    the prompt asks for (``boxed``: ``\\boxed{N}``; ``hashes``: a last line ``#### N``);
    ``format_credit`` and ``unformatted_credit`` are the reward's partial credits (see
    ``tasks.math_reward.score_text``). ``instruction`` replaces the line after the problem that
    asks for the answer's form.
    """

    def __init__(self, tokenizer: str, split: str = "train", seed: int = 0, size: int | None = None,
                 min_steps: int = 2, max_steps: int = 3, max_number: int = 20, answer_format: str = "boxed",
                 system_prompt: str | None = None, instruction: str | None = None, format_credit: float = 0.0,
                 unformatted_credit: float = 0.0, restated: str = "auto") -> None:
        super().__init__()
        if restated not in ("auto", "keep", "drop"):
            raise ValueError(f"restated must be 'auto', 'keep' or 'drop', got {restated!r}")
        if not isinstance(tokenizer, str) or not tokenizer:
            raise ValueError("tokenizer must be the path of a Hugging Face model directory")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if not (isinstance(min_steps, int) and isinstance(max_steps, int) and 1 <= min_steps <= max_steps <= 4):
            raise ValueError(f"need integers 1 <= min_steps <= max_steps <= 4, got {min_steps!r}, {max_steps!r}")
        if not isinstance(max_number, int) or not 4 <= max_number <= 10_000:
            raise ValueError(f"max_number must be an integer in [4, 10000], got {max_number!r}")
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"size must be a positive integer or None, got {size!r}")
        if answer_format not in INSTRUCTIONS:
            raise ValueError(f"answer_format must be one of {sorted(INSTRUCTIONS)}, got {answer_format!r}")
        if instruction is not None and (not isinstance(instruction, str) or not instruction.strip()):
            raise ValueError(f"instruction must be a non-empty text or None, got {instruction!r}")
        for label, credit in (("format_credit", format_credit), ("unformatted_credit", unformatted_credit)):
            if isinstance(credit, bool) or not isinstance(credit, int | float) or not 0.0 <= credit <= 1.0:
                raise ValueError(f"{label} must be a number in [0, 1], got {credit!r}")
        self.chat = hf_tokenizer.load(tokenizer, system_prompt)
        self.tokenizer = tokenizer
        self.split, self.seed, self.size = split, seed, size
        self.min_steps, self.max_steps, self.max_number = min_steps, max_steps, max_number
        self.answer_format = answer_format
        self.instruction = instruction if instruction is not None else INSTRUCTIONS[answer_format]
        self.reward_options = {"answer_format": answer_format, "format_credit": float(format_credit),
                               "unformatted_credit": float(unformatted_credit)}
        self.drop_restated = restated == "drop" or (restated == "auto" and split == "eval")
        """Leave out problems that restate their answer (``restates_answer``): item ``i`` is then the
        ``i``-th problem of the split that does not."""
        self._kept: list[int] = []
        self.name = (f"math-words-{split}-s{seed}-k{min_steps}{max_steps}-m{max_number}-{answer_format}"
                     + ("-norestated" if self.drop_restated and split == "train" else "")
                     + ("-restated" if not self.drop_restated and split == "eval" else "")
                     + (f"-n{size}" if size else ""))

    def _raw(self, index: int) -> Problem:
        return problem(self.split, index, seed=self.seed, min_steps=self.min_steps, max_steps=self.max_steps,
                       max_number=self.max_number)

    def question(self, index: int) -> Problem:
        index = index % self.size if self.size else index
        if not self.drop_restated:
            return self._raw(index)
        raw = self._kept[-1] + 1 if self._kept else 0
        while len(self._kept) <= index:
            if not restates_answer(self._raw(raw)):
                self._kept.append(raw)
            raw += 1
        return self._raw(self._kept[index])

    def user_message(self, p: Problem) -> str:
        return f"{p.text}\n{self.instruction}"

    def item(self, index: int) -> dict[str, Any]:
        """Item number ``index`` (a sequence number; with ``size`` it wraps into epochs)."""
        p = self.question(index)
        messages = self.chat.messages(self.user_message(p))
        return {"index": index, "prompt": self.chat.render(messages), "label": str(p.answer),
                "prompt_ids": self.chat.encode_messages(messages),
                "metadata": {"task": "math_words", "tokenizer": self.tokenizer, "steps": p.steps,
                             **self.reward_options}}
