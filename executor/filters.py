"""Built-in dynamic sampling filters (as miles): keep a prompt group or drop it, with a reason."""

from __future__ import annotations

from collections.abc import Sequence

from rollout_bus.executor.plugins import FilterResult
from rollout_bus.executor.sample import Sample, Status


def nonzero_reward_std(samples: Sequence[Sample]) -> FilterResult:
    """Drop groups whose rewards are all equal: their GRPO advantages are all zero."""
    rewards = [s.reward for s in samples]
    if len(set(rewards)) <= 1:
        return FilterResult(False, f"zero reward spread (all {rewards[0] if rewards else None})")
    return FilterResult(True)


def no_aborted(samples: Sequence[Sample]) -> FilterResult:
    """Drop groups with an aborted sample."""
    aborted = sum(s.status == Status.ABORTED for s in samples)
    if aborted:
        return FilterResult(False, f"{aborted} aborted sample(s)")
    return FilterResult(True)
