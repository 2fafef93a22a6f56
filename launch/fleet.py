"""Executors started and stopped from the queues' backlog (``rollout-bus run --executors auto[:MIN-MAX]``).

``ExecutorFleet.tick`` is called by the run's follow loop. Every ``interval_s`` it reads the backlog
(``events.backlog.read_backlog``), asks ``launch.autoscale.decide`` for a target, and when the target
changes it publishes ``ExecutorsScaled`` with the inputs, then:

- up: starts executors at the lowest free indexes (``executor-<i>``: stable names, metrics ports from
  ``metrics_ports``), under the run's supervision like fixed ones;
- down: retires the executor with the highest index (``ProcessSet.retire``: one SIGTERM, rq's warm
  shutdown). A busy executor finishes its job first (its heartbeat goes on meanwhile), then exits; it
  is not counted while it does, and its index is not given out again until it has exited.

A backlog that cannot be read (Redis away) skips the sample: the fleet stays as it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_bus.launch.autoscale import Decision, Sample, ScalePolicy, ScalerState, decide
from rollout_bus.launch.procs import Child, ProcessSet

log = logging.getLogger(__name__)


@dataclass
class FleetRecord:
    """What the fleet did over the run (``summary.json``): each change (``t_s`` after the fleet was made, from and
    to, why, and the inputs), and the most executors at once."""

    decisions: list[dict[str, Any]] = field(default_factory=list)
    peak: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"peak": self.peak, "decisions": self.decisions}


class ExecutorFleet:
    """The run's executors, between ``policy.min`` and ``policy.max``."""

    def __init__(self, procs: ProcessSet, policy: ScalePolicy, *, start: Callable[[int], Child],
                 read_backlog: Callable[[], Any], publish: Callable[[Sample, Decision, ScalePolicy], None],
                 interval_s: float = 1.0) -> None:
        self.procs = procs
        self.policy = policy
        self._start = start
        self._read = read_backlog
        self._publish = publish
        self.interval_s = interval_s
        self.members: dict[int, Child] = {}
        self.retiring: list[Child] = []
        self.state = ScalerState()
        self.record = FleetRecord()
        self._last_sample: float | None = None
        self._started = time.monotonic()

    @property
    def count(self) -> int:
        return len(self.members)

    def start_initial(self) -> None:
        """The first ``policy.min`` executors (no decision event: the run starts with its lower bound)."""
        self._grow(self.policy.min)

    def tick(self, now_s: float | None = None) -> Decision | None:
        """One sample and decision when ``interval_s`` has passed since the last; the decision, else None."""
        now = time.monotonic() if now_s is None else now_s
        self.retiring = [c for c in self.retiring if c.alive()]
        if self._last_sample is not None and now - self._last_sample < self.interval_s:
            return None
        self._last_sample = now
        try:
            backlog = self._read()
        except Exception as exc:  # Redis away: no sample, no change
            log.warning("reading the executors' backlog: %s", exc)
            return None
        sample = Sample(now, backlog.depth, backlog.oldest_age_s, backlog.busy, self.count)
        decision = decide(self.policy, self.state, sample)
        self.state = decision.state
        if decision.changes(self.count):
            log.info("executors %d -> %d (%s): %d waiting, oldest %.1fs, %d running", self.count, decision.target,
                     decision.reason, sample.depth, sample.oldest_age_s, sample.busy)
            self.record.decisions.append({"t_s": round(now - self._started, 3), "from": self.count, "to": decision.target,
                                          "reason": decision.reason, "depth": sample.depth,
                                          "oldest_age_s": sample.oldest_age_s, "busy": sample.busy})
            try:
                self._publish(sample, decision, self.policy)
            except Exception as exc:  # the decision stands; only its record on the bus is missing
                log.warning("publishing the scaling decision: %s", exc)
            if decision.target > self.count:
                self._grow(decision.target)
            else:
                self._shrink(decision.target)
        return decision

    def _grow(self, target: int) -> None:
        busy = {int(c.name.rsplit("-", 1)[1]) for c in self.retiring if c.alive()}
        index = 0
        while self.count < target:
            if index not in self.members and index not in busy:
                self.members[index] = self._start(index)
            index += 1
        self.record.peak = max(self.record.peak, self.count)

    def _shrink(self, target: int) -> None:
        while self.count > target:
            index = max(self.members)
            child = self.members.pop(index)
            self.procs.retire(child)
            self.retiring.append(child)
            log.info("%s (pid %d) retired: it finishes its job, if any, then exits", child.name, child.pid)
