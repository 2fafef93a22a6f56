"""A verifiable math reward: the final answer parsed and compared with ``math-verify``, partial credit for form.

``score_text(text, label, ...)``:
- the answer in the requested form (``\\boxed{N}``, or a last non-empty line that is ``####`` and a
  number, nothing else: ``#### N`` as a placeholder, ``#### 2 * 4 = 8`` or a ``####`` line followed
  by more text are not in that form) is found and parsed with math-verify: equal to the label,
  reward 1; not equal, ``format_credit``;
- no answer in that form: math-verify parses the whole response (it prefers an "answer is"
  phrase, then the last number); equal to the label, ``unformatted_credit``; else 0.

math-verify bounds its own time with ``signal.alarm``, which only works on a process's main
thread (an executor scores on its event-loop thread). So every parse and comparison runs in
one long-lived child process (``Verifier``), on that child's main thread where math-verify's
own timeouts work, and the caller bounds the whole check with ``timeout_s``: a check that
runs over (sympy expanding ``9^{9^{9^9}}`` in one C call, which no signal interrupts) kills
the child, counts as wrong, and the next check starts a fresh one. (``verify_here`` itself
runs on any thread: off the main one it turns both of math-verify's timeouts off.)

The reward plug-in ``reward(sample)`` reads the response with the tokenizer and the options
that the data source (``tasks.math_words``) put in the sample's metadata.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import select
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import IO, Any, Protocol

from rollout_bus.lm import hf_tokenizer

log = logging.getLogger(__name__)

MAX_TEXT_CHARS = 4000
"""Only the last this many characters of a response are parsed."""
MAX_ANSWER_CHARS = 200

_HASHES_LINE = re.compile(r"####[ \t]*\$?[ \t]*(-?\d[\d,]*(?:\.\d+)?)[ \t]*\.?")
"""A whole last line in the ``hashes`` form: ``####``, one number (sign, ``$``, thousands commas and
decimals allowed), an optional full stop."""


class _Scored(Protocol):
    response_ids: list[int]
    label: Any
    metadata: dict[str, Any]


@dataclass(frozen=True)
class Score:
    reward: float
    correct: bool
    formatted: bool


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth = 0
        for i in range(start + len("\\boxed"), len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len("\\boxed{"):i]
        start = text.rfind("\\boxed{", 0, start)
    return None


def formatted_answer(text: str, answer_format: str) -> str | None:
    """The answer written in the requested form, or None when the response has none."""
    if answer_format == "boxed":
        found = last_boxed(text)
    elif answer_format == "hashes":
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        match = _HASHES_LINE.fullmatch(lines[-1]) if lines else None
        found = match.group(1).replace(",", "") if match else None
    else:
        raise ValueError(f"answer_format must be 'boxed' or 'hashes', got {answer_format!r}")
    if found is None or not found.strip() or len(found) > MAX_ANSWER_CHARS:
        return None
    return found.strip()


def verify_here(gold: str, candidate: str) -> bool:
    """math-verify's verdict on ``candidate`` against ``gold`` in this process, on any thread.

    On the main thread math-verify's own alarms bound each step; elsewhere they cannot be
    used (they raise), so both are turned off and the caller must bound the time.
    """
    from math_verify import parse, verify

    main = threading.current_thread() is threading.main_thread()
    limits: dict[str, Any] = {} if main else {"parsing_timeout": None}
    parsed_gold = parse(gold, **limits)
    parsed = parse(candidate, **limits)
    if not parsed_gold or not parsed:
        return False
    return bool(verify(parsed_gold, parsed, **({} if main else {"timeout_seconds": None})))


def warm_up() -> bool:
    """Import math-verify and run its first parse (antlr and sympy start-up): seconds, not a check's time."""
    return verify_here("1", "1")


def serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """The child's loop: a JSON line ``{"gold", "candidate"}`` in, ``{"ok": bool}`` or ``{"error"}`` out."""
    def answer(reply: dict[str, Any]) -> None:
        stdout.write(json.dumps(reply).encode() + b"\n")
        stdout.flush()

    answer({"ready": warm_up()})
    for line in stdin:
        try:
            asked = json.loads(line)
            answer({"ok": verify_here(str(asked["gold"]), str(asked["candidate"]))})
        except Exception as exc:
            answer({"error": f"{type(exc).__name__}: {exc}"})


class Verifier:
    """``verify_here`` in a child process (``python -m rollout_bus.tasks.math_reward``); thread-safe.

    Each check is bounded by ``timeout_s``: one that runs over kills the child (by pid) and
    counts as wrong; the next check starts a new child. A child is warmed up (math-verify
    imported, a first parse done) within ``startup_timeout_s`` before a check's clock starts,
    so a slow start on a loaded machine is not a timed-out check. The child is a plain
    subprocess speaking JSON lines: it never re-imports the parent's main module, and it
    ends when its stdin closes.
    """

    def __init__(self, timeout_s: float = 5.0, startup_timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.timeouts = 0
        self.starts = 0
        self._child: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen[bytes]:
        child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        weakref.finalize(self, _stop, child)
        ready = _read_line(child, self.startup_timeout_s)
        if ready is None or not ready.get("ready"):
            _stop(child)
            why = "did not start within" if ready is None else f"failed its warm-up ({ready}) in"
            raise RuntimeError(f"math-verify's process {why} {self.startup_timeout_s:.0f}s")
        self.starts += 1
        return child

    def check(self, gold: str, candidate: str) -> bool:
        with self._lock:
            if self._child is None or self._child.poll() is not None:
                self._child = self._start()
            child = self._child
            assert child.stdin is not None
            child.stdin.write(json.dumps({"gold": gold, "candidate": candidate}).encode() + b"\n")
            child.stdin.flush()
            reply = _read_line(child, self.timeout_s)
            if reply is None:
                self.timeouts += 1
                log.warning("math-verify took over %.1fs on %r; counted as wrong, restarting its process",
                            self.timeout_s, candidate[:80])
                self._close()
                return False
            if "error" in reply:
                log.warning("math-verify failed on %r: %s; counted as wrong", candidate[:80], reply["error"])
                return False
            return bool(reply.get("ok"))

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._child is not None:
            _stop(self._child)
            self._child = None


def _read_line(child: subprocess.Popen[bytes], timeout_s: float) -> dict[str, Any] | None:
    """The child's next JSON line, or None when none came within ``timeout_s``."""
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], timeout_s)
    if not ready:
        return None
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"math-verify's process exited (code {child.wait()})")
    reply = json.loads(line)
    return reply if isinstance(reply, dict) else {"error": f"unexpected reply {line[:100]!r}"}


def _stop(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        child.kill()
    child.wait()
    for pipe in (child.stdin, child.stdout):
        if pipe is not None:
            pipe.close()


_default: Verifier | None = None
_default_lock = threading.Lock()


def default_verifier() -> Verifier:
    global _default
    with _default_lock:
        if _default is None:
            _default = Verifier()
        return _default


def score_text(text: str, label: str, *, answer_format: str = "boxed", format_credit: float = 0.0,
               unformatted_credit: float = 0.0, verifier: Verifier | None = None) -> Score:
    """The reward of response ``text`` for the answer ``label`` (see the module docstring)."""
    checker = verifier or default_verifier()
    text = text[-MAX_TEXT_CHARS:]
    answer = formatted_answer(text, answer_format)
    if answer is not None:
        correct = checker.check(str(label), f"\\boxed{{{answer}}}" if answer_format == "boxed" else answer)
        return Score(1.0 if correct else float(format_credit), correct, True)
    correct = checker.check(str(label), text)
    return Score(float(unformatted_credit) if correct else 0.0, correct, False)


def score_sample(sample: _Scored, verifier: Verifier | None = None) -> Score:
    """The score of an executor sample made from a ``tasks.math_words`` item."""
    meta = sample.metadata
    path = meta.get("tokenizer")
    if not isinstance(path, str) or not path:
        raise ValueError("the sample has no 'tokenizer' in its metadata: the math reward scores samples "
                         "of the tasks.math_words data source, which puts it there")
    text = hf_tokenizer.load(path).decode(sample.response_ids)
    return score_text(text, str(sample.label), answer_format=str(meta.get("answer_format", "boxed")),
                      format_credit=float(meta.get("format_credit", 0.0)),
                      unformatted_credit=float(meta.get("unformatted_credit", 0.0)), verifier=verifier)


async def reward(sample: _Scored) -> float:
    """The executor's reward plug-in: ``rollout_bus.tasks.math_reward.reward``."""
    score = await asyncio.to_thread(score_sample, sample)
    sample.metadata["correct"] = score.correct
    sample.metadata["formatted"] = score.formatted
    return score.reward


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
