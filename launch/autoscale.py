"""How many executors a run wants, from its rq queues' backlog: a pure decision, with hysteresis.

``decide(policy, state, sample)`` reads no clock and touches nothing: a ``Sample`` (the time, the jobs
waiting, the age of the oldest, the jobs running, the executors there are) and the ``ScalerState``
carried from the previous call go in; a ``Decision`` (the target count, why, and the next state)
comes out. ``launch.fleet.ExecutorFleet`` feeds it samples and starts or stops processes.

- **Up, quickly.** Any job waiting means every executor is busy (an idle one takes a job within
  milliseconds). When the backlog reaches ``up_depth`` jobs, or its oldest job has waited
  ``up_age_s``, for ``up_samples`` samples in a row, and ``up_cooldown_s`` passed since the last
  change, the target jumps to what the demand asks for (the jobs running plus those waiting, so each
  job gets an executor), at least one more, at most ``max``.
- **Down, slowly.** When no job waits and fewer jobs run than there are executors, for
  ``down_samples`` samples in a row, and ``down_cooldown_s`` passed since the last change (an up
  included), the target drops by one, never below the jobs running nor ``min``. The idle count
  starts again after each step down, so shrinking a fleet by k takes k times that long.
- **Bounds.** A count outside ``[min, max]`` is brought back at once (``reason`` ``min``/``max``).

A sample that is neither (a job waits below the thresholds, or every executor is busy with nothing
waiting) resets both counts: only a sustained condition moves the fleet.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Literal

Reason = Literal["hold", "min", "max", "backlog", "age", "idle"]


@dataclass(frozen=True)
class ScalePolicy:
    min: int = 1
    max: int = 4
    up_depth: int = 1
    """Jobs waiting that count as pressure (1: any job waiting)."""
    up_age_s: float = 2.0
    """The oldest waiting job's age that counts as pressure, whatever the depth."""
    up_samples: int = 2
    up_cooldown_s: float = 3.0
    """After a change, before the next step up (a new executor needs a few seconds to take jobs)."""
    down_samples: int = 10
    down_cooldown_s: float = 15.0
    """After any change, before a step down."""

    def __post_init__(self) -> None:
        problems = policy_problems(self)
        if problems:
            raise ValueError("; ".join(problems))


def policy_problems(policy: ScalePolicy) -> list[str]:
    """What is wrong with ``policy`` (empty: nothing)."""
    problems = _bound_problems(policy.min, policy.max)
    if policy.up_depth < 1 or policy.up_samples < 1 or policy.down_samples < 1:
        problems.append("up_depth, up_samples and down_samples must be >= 1")
    if not all(math.isfinite(v) and v >= 0 for v in (policy.up_age_s, policy.up_cooldown_s,
                                                       policy.down_cooldown_s)):
        problems.append("up_age_s, up_cooldown_s and down_cooldown_s must be finite and >= 0")
    return problems


@dataclass(frozen=True)
class Sample:
    now_s: float
    """The caller's monotonic clock, in seconds."""
    depth: int
    """Jobs waiting in the queues the executors take from."""
    oldest_age_s: float
    """How long the oldest waiting job has waited (0 when none waits)."""
    busy: int
    """Jobs running now."""
    current: int
    """Executors now (starting ones included; those stopping after their job excluded)."""


@dataclass(frozen=True)
class ScalerState:
    over: int = 0
    """Samples in a row under pressure."""
    idle: int = 0
    """Samples in a row with nothing waiting and an executor to spare."""
    changed_s: float | None = None
    """When the target last changed (the sample's clock)."""


@dataclass(frozen=True)
class Decision:
    target: int
    reason: Reason
    state: ScalerState

    def changes(self, current: int) -> bool:
        return self.target != current


def decide(policy: ScalePolicy, state: ScalerState, sample: Sample) -> Decision:
    """The target executor count for ``sample`` and the state to pass to the next call."""
    current = sample.current
    if current < policy.min:
        return Decision(policy.min, "min", ScalerState(changed_s=sample.now_s))
    if current > policy.max:
        return Decision(policy.max, "max", ScalerState(changed_s=sample.now_s))
    depth, age = max(0, sample.depth), max(0.0, sample.oldest_age_s)
    busy = max(0, sample.busy)
    by_depth = depth >= policy.up_depth
    by_age = depth > 0 and age >= policy.up_age_s
    spare = depth == 0 and busy < current
    state = replace(state, over=state.over + 1 if by_depth or by_age else 0, idle=state.idle + 1 if spare else 0)
    since = math.inf if state.changed_s is None else sample.now_s - state.changed_s
    if state.over >= policy.up_samples and current < policy.max and since >= policy.up_cooldown_s:
        target = min(policy.max, max(current + 1, busy + depth))
        return Decision(target, "backlog" if by_depth else "age", ScalerState(changed_s=sample.now_s))
    if state.idle >= policy.down_samples and current > policy.min and since >= policy.down_cooldown_s:
        target = max(policy.min, busy, current - 1)
        if target < current:
            return Decision(target, "idle", ScalerState(changed_s=sample.now_s))
    return Decision(current, "hold", state)


_RANGE = re.compile(r"(-?\d+)-(-?\d+)")
DEFAULT_RANGE = (1, 4)


def parse_executors(spec: str) -> int | ScalePolicy:
    """``--executors``: ``N`` (a fixed count, >= 1), ``auto`` (``DEFAULT_RANGE``) or ``auto:MIN-MAX``.

    ``ValueError`` saying what to write instead for anything else."""
    text = spec.strip()
    usage = "write N (a fixed count >= 1), auto, or auto:MIN-MAX with 1 <= MIN <= MAX (e.g. auto:1-8)"
    if text.isdigit():
        if int(text) < 1:
            raise ValueError(f"--executors {spec!r}: a fixed count must be >= 1; {usage}")
        return int(text)
    if text == "auto":
        return ScalePolicy(min=DEFAULT_RANGE[0], max=DEFAULT_RANGE[1])
    head, sep, bounds = text.partition(":")
    match = _RANGE.fullmatch(bounds) if head == "auto" and sep else None
    if match is None:
        raise ValueError(f"--executors {spec!r}: {usage}")
    low, high = int(match[1]), int(match[2])
    problems = _bound_problems(low, high)
    if low == 0:  # the policy takes 0 (a cluster may scale to zero); a run always has a trainer or an eval waiting
        problems.append("MIN must be >= 1 in a run (its trainers and evals always wait on an executor)")
    if problems:
        raise ValueError(f"--executors {spec!r}: {'; '.join(problems)}; {usage}")
    return ScalePolicy(min=low, max=high)


def _bound_problems(low: int, high: int) -> list[str]:
    out = []
    if low < 0:
        out.append(f"MIN must be >= 0, got {low}")
    if high < 1:
        out.append(f"MAX must be >= 1, got {high}")
    if low > high:
        out.append(f"MIN ({low}) must not exceed MAX ({high})")
    return out
