"""Held-out evals of a run: before training, every ``eval_every`` steps during it, and after it.

Each eval is an eval request (``RolloutRequest.eval``: the eval split, the same first
``eval_groups`` problems every time) on the eval queue, served by an executor of its own
(``--queues eval``), so a training rollout never waits behind an eval job; the engines are shared.
The executor publishes the result as ``EvalCompleted`` on the eval stream (accuracy with its 95%
Wilson interval, per-problem counts); ``EvalTracker`` submits the requests, follows that stream
without blocking the run, and hands each result to the run's summary and to ``EvalLog``:

- ``<log dir>/<run>-eval.jsonl``: one line per eval (phase, step, weight versions, metrics, and the per-problem
  ``[index, correct, samples]`` rows, so two runs' evals of the same problems can be compared pairwise);
- TensorBoard (``--log-to tensorboard``): ``<log dir>/tensorboard/<run>/eval/``, the ``eval/*`` scalars at the
  training step each eval followed (0 before training), shown as the run's ``eval`` sub-run;
- W&B (``--log-to wandb``): a run ``<run>-eval`` in the run's group.

Before and after are compared on the same problems: ``difference`` is after minus before with a
paired-bootstrap 95% interval (``tasks.stats.paired_difference``).
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from rollout_bus.events.connection import Guard, Redis
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import stream_entries
from rollout_bus.events.schema import EvalCompleted, decode
from rollout_bus.tasks.stats import counts_of, paired_difference

log = logging.getLogger(__name__)

EVAL_SCALARS = ("accuracy", "accuracy_lo", "accuracy_hi", "pass_at_n", "pass_at_n_lo", "pass_at_n_hi",
                "reward_mean", "correct_frac", "formatted_frac", "response_len_mean")
"""The ``EvalCompleted.metrics`` written to the metric logs as ``eval/<name>``."""


@dataclass
class EvalPoint:
    policy: str
    phase: str
    """``before``, ``during`` or ``after``."""
    step: int
    """The trainer step it followed (0: before training)."""
    request_id: str
    event: EvalCompleted | None = None
    error: str = ""
    """Why the eval request failed for good (its rq job's error); empty while it runs or once it completed."""

    def to_dict(self) -> dict[str, Any]:
        e = self.event
        return {"phase": self.phase, "step": self.step, "request_id": self.request_id,
                **({"min_weight_version": e.min_weight_version, "max_weight_version": e.max_weight_version,
                    "n_problems": e.n_problems, "n_samples": e.n_samples, "metrics": dict(e.metrics)}
                   if e is not None else {})}


@dataclass
class EvalTracker:
    """Submits a run's eval requests and folds their ``EvalCompleted`` events as they arrive."""

    client: Redis
    keys: Keys
    submit: Any
    """``(policy, request_id) -> None``: queue one eval request (``launch.job`` builds it)."""
    namespace: str
    logs: dict[str, EvalLog] = field(default_factory=dict)
    timeout_s: float = 960.0
    """How long ``launch.job`` waits for the evals it needs (the run's limit and a minute)."""
    points: dict[str, EvalPoint] = field(default_factory=dict)
    cursor: str = "0"

    def __post_init__(self) -> None:
        self.guard = Guard(self.client, name="evals")

    def ask(self, policy: str, phase: str, step: int) -> EvalPoint:
        request_id = f"eval-{self.namespace}-{policy}-{phase}{step}-{uuid.uuid4().hex[:8]}"[:58]
        point = self.points[request_id] = EvalPoint(policy, phase, step, request_id)
        self.submit(policy, request_id)
        log.info("eval %s of %s after step %d asked for (%s)", phase, policy, step, request_id)
        return point

    def poll(self, block_ms: int = 0) -> list[EvalPoint]:
        """Fold what the eval stream gained; returns the evals of this run that completed."""
        reply: Any = self.guard.call(partial(_xread, stream=self.keys.eval_stream, after=self.cursor,
                                             block_ms=block_ms))
        done: list[EvalPoint] = []
        for _, entry_id, fields in stream_entries(reply):
            self.cursor = entry_id
            try:
                event = decode(fields)
            except Exception as exc:
                log.warning("unreadable eval event %s: %s", entry_id, exc)
                continue
            point = self.points.get(event.request_id) if isinstance(event, EvalCompleted) else None
            if point is None or point.event is not None or not isinstance(event, EvalCompleted):
                continue
            point.event = event
            done.append(point)
            log.info("eval %s of %s (step %d, v%d-%d): accuracy %.3f [%.3f, %.3f] on %d samples", point.phase,
                     point.policy, point.step, event.min_weight_version, event.max_weight_version,
                     event.metrics.get("accuracy", math.nan), event.metrics.get("accuracy_lo", math.nan),
                     event.metrics.get("accuracy_hi", math.nan), event.n_samples)
            # the initial weights' eval (the base pool's policy when every policy is an adapter) starts every log
            for eval_log in [self.logs[point.policy]] if point.policy in self.logs else self.logs.values():
                eval_log.write(point)
        return done

    def pending(self) -> list[EvalPoint]:
        return [p for p in self.points.values() if p.event is None and not p.error]

    def wait(self, points: list[EvalPoint], timeout_s: float, supervise: Any = None) -> None:
        """Until every one of ``points`` completed or failed for good. ``EvalFailed`` when one of them failed
        (its job's error) or none came after ``timeout_s``."""
        from rollout_bus.events.submit import outcome

        deadline = time.monotonic() + timeout_s
        checked = time.monotonic()
        while any(p.event is None and not p.error for p in points):
            if time.monotonic() > deadline:
                missing = ", ".join(f"{p.phase} of {p.policy}" for p in points if p.event is None)
                raise EvalFailed(f"no result of the eval(s) {missing} after {timeout_s:.0f}s")
            self.poll(block_ms=300)
            if supervise is not None:
                supervise()
            if time.monotonic() - checked > 2.0:  # a request that failed for good publishes no EvalCompleted
                checked = time.monotonic()
                for p in points:
                    if p.event is None and not p.error:
                        state = self.guard.call(lambda c, rid=p.request_id: outcome(c, rid))  # type: ignore[misc]
                        if state.state == "failed":
                            p.error = state.error or "failed"
                            log.error("the %s eval of %s failed: %s", p.phase, p.policy, p.error)
        failed = [p for p in points if p.error]
        if failed:
            raise EvalFailed("; ".join(f"the {p.phase} eval of {p.policy} (step {p.step}) failed: "
                                       f"{p.error.strip().splitlines()[-1] if p.error.strip() else p.error}"
                                       for p in failed))

    def of(self, policy: str) -> list[EvalPoint]:
        return sorted((p for p in self.points.values() if p.policy == policy and p.event is not None),
                      key=lambda p: ({"before": 0, "during": 1, "after": 2}[p.phase], p.step))

    def close(self) -> None:
        """Close every eval log (again: a no-op)."""
        for eval_log in self.logs.values():
            eval_log.close()


class EvalFailed(RuntimeError):
    """An eval request failed for good, or its result did not come in time."""


def difference(before: EvalCompleted, after: EvalCompleted) -> dict[str, float]:
    """After minus before on the problems both scored: accuracy difference with its paired 95% interval."""
    diff = paired_difference(counts_of(before.problems), counts_of(after.problems))
    return {"accuracy_diff": diff.value, "accuracy_diff_lo": diff.lo, "accuracy_diff_hi": diff.hi,
            "paired_problems": float(diff.n)}


def phase_metrics(point: EvalPoint) -> dict[str, float]:
    """The summary's view of one eval: its metrics, the sample count and the versions (as before this module)."""
    e = point.event
    assert e is not None
    return {**e.metrics, "samples": float(e.n_samples), "problems": float(e.n_problems),
            "min_weight_version": float(e.min_weight_version), "max_weight_version": float(e.max_weight_version),
            "step": float(point.step)}


class EvalLog:
    """One policy's evals in the run's metric logs (see the module docstring)."""

    def __init__(self, directory: Path, run: str, policy: str, backends: list[str], *, group: str,
                 wandb_project: str = "rollout-bus", config: dict[str, Any] | None = None) -> None:
        from rollout_bus.trainer.metric_loggers import MetricLogger, TensorBoardLogger, WandbLogger

        self.run, self.policy = run, policy
        self.path = directory / f"{run}-eval.jsonl"
        directory.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self.loggers: list[MetricLogger] = []
        settings = config or {}
        try:
            if "tensorboard" in backends:
                self.loggers.append(TensorBoardLogger(directory, f"{run}/eval", settings))
            if "wandb" in backends:
                self.loggers.append(WandbLogger(directory, f"{run}-eval", group, wandb_project, settings))
        except BaseException:
            self.close()
            raise
        self.outputs: dict[str, Path] = {"jsonl": self.path, **{lg.backend: lg.location for lg in self.loggers}}
        """Where each backend writes (still known after ``close``)."""

    def write(self, point: EvalPoint) -> None:
        from rollout_bus.trainer.metric_loggers import StepRecord

        e = point.event
        assert e is not None
        line = {"run": self.run, "policy": self.policy, "split": e.split, **point.to_dict(), "time": time.time(),
                "problems": [list(row) for row in e.problems]}
        self._file.write(json.dumps(_finite(line), allow_nan=False) + "\n")
        self._file.flush()
        scalars = {f"eval/{k}": float(e.metrics[k]) for k in EVAL_SCALARS if k in e.metrics}
        record = StepRecord(point.step, e.min_weight_version, time.time(), scalars)
        for logger in self.loggers:
            try:
                logger.log(record)
            except Exception as exc:  # one backend failing keeps neither the run nor the others from going on
                log.warning("writing an eval to %s failed: %s", logger.backend, exc)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            try:
                logger.close()
            except Exception as exc:
                log.warning("closing the %s eval log failed: %s", logger.backend, exc)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _xread(c: Redis, *, stream: str, after: str, block_ms: int) -> Any:
    return c.xread({stream: after}, count=100, block=block_ms if block_ms > 0 else None)
