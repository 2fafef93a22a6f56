"""What a run did, read back from the trainer stream: rewards, speed, staleness; and the reward plot.

Everything here folds ``TrainStepDone`` and ``BatchConsumed`` events, so a summary can
be rebuilt from a replayed or exported event log as well as followed live. ``run_faults``
adds what the run rode out: restarts by process (from the supervisor), jobs requeued after
their executor died (``RolloutStarted`` attempts), batches delivered to a trainer more than
once (the trainer's ``redelivered_batches_total``) and dead letters.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from rollout_bus.events.connection import Guard, Redis
from rollout_bus.events.errors import DecodeError
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.schema import (
    STALENESS_PREFIX,
    BatchConsumed,
    Event,
    RolloutStarted,
    TrainStepDone,
    decode,
)

log = logging.getLogger(__name__)

@dataclass
class PolicySummary:
    policy: str
    steps: int = 0
    rewards: list[float] = field(default_factory=list)
    step_ts_ms: list[int] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)
    staleness_hist: dict[int, int] = field(default_factory=dict)
    batches_trained: int = 0
    batches_unused: int = 0
    stale_groups: float = 0.0
    redelivered: float = 0.0
    """Batches the trainer received more than once (its pending ones after a restart, reclaimed ones)."""
    batch_ids: list[str] = field(default_factory=list)
    correct: list[float] = field(default_factory=list)
    """Per step, the share of the trained batch's answers that were right (tasks that judge answers)."""
    formatted: list[float] = field(default_factory=list)
    """Per step, the share in the requested form."""
    evals: dict[str, dict[str, float]] = field(default_factory=dict)
    """Held-out eval metrics by phase (``before``: the initial weights, ``after``: the last version)."""
    offload_ms: list[float] = field(default_factory=list)
    """Colocated runs, per step: how long the engines took to release their weights and KV cache."""
    onload_ms: list[float] = field(default_factory=list)
    """Colocated runs, per step: how long they took to get them back (weights, then KV cache, newest version)."""
    version: int = -1
    """The newest weight version a step announced: a step without signal publishes none, so it may be
    lower than ``steps``."""
    skipped_no_signal: int = 0
    """Steps whose batch had no signal (every advantage 0): no optimiser step, no new version."""
    groups_filtered: list[float] = field(default_factory=list)
    """Per step, the prompt groups the executors' dynamic filter left out of the batch (all rewards equal);
    empty when no filter ran."""
    eval_points: list[dict[str, Any]] = field(default_factory=list)
    """Held-out evals during the run (``--eval-every``): step, version and metrics with intervals."""
    eval_difference: dict[str, Any] = field(default_factory=dict)
    """After minus before on the same held-out problems, with its paired interval (``launch.evals``)."""

    def reward_before(self, k: int = 2) -> float:
        """Mean reward of the first ``k`` steps (the first batch comes from the initial weights)."""
        return statistics.fmean(self.rewards[:k]) if self.rewards else float("nan")

    def reward_after(self, k: int = 5) -> float:
        """Mean reward of the last ``k`` steps."""
        return statistics.fmean(self.rewards[-k:]) if self.rewards else float("nan")

    def steady_seconds(self) -> float:
        return (self.step_ts_ms[-1] - self.step_ts_ms[0]) / 1000 if len(self.step_ts_ms) > 1 else float("nan")

    def steps_per_s(self) -> float:
        secs = self.steady_seconds()
        return (len(self.step_ts_ms) - 1) / secs if secs and secs == secs and secs > 0 else float("nan")

    def samples_per_s(self) -> float:
        secs = self.steady_seconds()
        return sum(self.samples[1:]) / secs if secs and secs == secs and secs > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "steps": self.steps, "reward_before": self.reward_before(),
                "reward_after": self.reward_after(), "steps_per_s": self.steps_per_s(),
                "samples_per_s": self.samples_per_s(), "staleness_hist": dict(sorted(self.staleness_hist.items())),
                "batches_trained": self.batches_trained, "batches_unused": self.batches_unused,
                "stale_groups": self.stale_groups, "rewards": self.rewards,
                "version": self.version, "skipped_no_signal": self.skipped_no_signal,
                **({"groups_filtered": self.groups_filtered,
                    "groups_filtered_total": sum(self.groups_filtered)} if self.groups_filtered else {}),
                **({"correct": self.correct, "formatted": self.formatted} if self.correct else {}),
                **({"eval": self.evals} if self.evals else {}),
                **({"offload_ms": self.offload_ms, "onload_ms": self.onload_ms} if self.offload_ms else {}),
                **({"eval_during": self.eval_points} if self.eval_points else {}),
                **({"eval_difference": self.eval_difference} if self.eval_difference else {})}


class RunLog:
    """Folds trainer events into per-policy summaries; ``follow`` reads new ones from Redis."""

    def __init__(self) -> None:
        self.policies: dict[str, PolicySummary] = {}
        self.cursor = "0"
        self.cursors: dict[int, str] = {}
        """Where the trainer streams of the run's further Redis shards were read up to."""
        self._seen_steps: set[tuple[str, str, int]] = set()

    def policy(self, name: str) -> PolicySummary:
        if name not in self.policies:
            self.policies[name] = PolicySummary(name)
        return self.policies[name]

    def add(self, event: Event) -> TrainStepDone | None:
        """Fold one event; returns it when it is a new ``TrainStepDone``."""
        if isinstance(event, TrainStepDone):
            key = (event.policy, event.trainer_id, event.step)
            if key in self._seen_steps:
                return None
            self._seen_steps.add(key)
            p = self.policy(event.policy)
            p.steps = max(p.steps, event.step)
            p.version = max(p.version, event.weight_version)
            if event.metrics.get("skipped_no_signal"):
                p.skipped_no_signal += 1
            if "groups_filtered" in event.metrics:
                p.groups_filtered.append(float(event.metrics["groups_filtered"]))
            p.rewards.append(float(event.metrics.get("reward_mean", float("nan"))))
            p.step_ts_ms.append(event.ts_ms)
            p.samples.append(float(event.metrics.get("n_samples", 0.0)))
            if "correct_frac" in event.metrics:
                p.correct.append(float(event.metrics["correct_frac"]))
                p.formatted.append(float(event.metrics.get("formatted_frac", float("nan"))))
            p.stale_groups = max(p.stale_groups, float(event.metrics.get("stale_groups_total", 0.0)))
            p.redelivered = max(p.redelivered, float(event.metrics.get("redelivered_batches_total", 0.0)))
            if "offload_ms" in event.metrics:
                p.offload_ms.append(float(event.metrics["offload_ms"]))
                p.onload_ms.append(float(event.metrics.get("onload_ms", float("nan"))))
            for name, value in event.metrics.items():
                if name.startswith(STALENESS_PREFIX):
                    s = int(name[len(STALENESS_PREFIX):])
                    p.staleness_hist[s] = p.staleness_hist.get(s, 0) + int(value)
            return event
        if isinstance(event, BatchConsumed):
            p = self.policy(event.policy)
            if event.accepted:
                p.batches_trained += 1
                p.batch_ids.append(event.batch_id)
            else:
                p.batches_unused += 1
        return None

    def add_all(self, events: Iterable[Event]) -> list[TrainStepDone]:
        return [e for e in (self.add(ev) for ev in events) if e is not None]

    def follow(self, client: Redis, keys: Keys, block_ms: int = 500, guard: Guard | None = None,
               shard: int = 0) -> list[TrainStepDone]:
        """Read what the trainer stream gained since the last call; returns the new steps.

        ``shard``: the trainer stream of another Redis shard of the run (``launch.shards``), with a cursor of its
        own; its steps are the ones every shard carries (folded once), its ``BatchConsumed`` its own batches'."""
        g = guard or Guard(client, name="run log")
        after = self.cursor if shard == 0 else self.cursors.get(shard, "0")
        reply: Any = g.call(partial(_xread, stream=keys.trainer_stream, after=after, block_ms=block_ms))
        events: list[Event] = []
        for entries in _rows(reply):
            entry_id, fields = entries
            after = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            try:
                events.append(decode(fields))
            except Exception as exc:
                log.warning("unreadable trainer event %s: %s", after, exc)
        if shard == 0:
            self.cursor = after
        else:
            self.cursors[shard] = after
        return self.add_all(events)


def _xread(c: Redis, *, stream: str, after: str, block_ms: int) -> Any:
    return c.xread({stream: after}, count=500, block=block_ms if block_ms > 0 else None)


def _rows(reply: Any) -> list[tuple[Any, Any]]:
    if not reply:
        return []
    if isinstance(reply, dict):
        return [(e[0], e[1]) for entries in reply.values() for e in entries]
    return [(e[0], e[1]) for _, entries in reply for e in entries]


@dataclass
class RunFaults:
    restarts: dict[str, int] = field(default_factory=dict)
    requeued_jobs: int = 0
    reclaimed_batches: int = 0
    dead_letters: int = 0
    unread_shards: list[int] = field(default_factory=list)
    """Shards whose Redis could not be read at the run's end (lost, or not answering then): their counts are not in
    the figures. A request requeued on two shards (moved off a lost one) counts on each."""

    def add_shard(self, shard: RunFaults) -> None:
        """Fold in another shard's bus-side counts (requeued jobs, dead letters; restarts and redeliveries are
        the run's and the trainers', counted once)."""
        self.requeued_jobs += shard.requeued_jobs
        self.dead_letters += shard.dead_letters

    def to_dict(self) -> dict[str, Any]:
        out = {"restarts": dict(self.restarts), "requeued_jobs": self.requeued_jobs,
               "reclaimed_batches": self.reclaimed_batches, "dead_letters": self.dead_letters}
        if self.unread_shards:
            out["unread_shards"] = list(self.unread_shards)
        return out


def run_faults(client: Redis, keys: Keys, restarts: dict[str, int], policies: Iterable[PolicySummary], *,
               guard: Guard | None = None) -> RunFaults:
    """What the run rode out (see the module docstring), read from the bus at its end."""
    g = guard or Guard(client, name="run faults")
    requeued: set[str] = set()
    for _, fields in page(client, keys.rollout_stream, guard=g):
        try:
            event = decode(fields)
        except DecodeError:
            continue
        if isinstance(event, RolloutStarted) and event.attempt > 1:
            requeued.add(event.request_id)
    return RunFaults(restarts=dict(restarts), requeued_jobs=len(requeued),
                     reclaimed_batches=int(sum(p.redelivered for p in policies)),
                     dead_letters=int(g.call(lambda c: c.xlen(keys.dead_letters))))


def format_summary(policies: Iterable[PolicySummary], *, mode: str, wall_s: float,
                   faults: RunFaults | None = None) -> str:
    lines = [f"mode {mode}, {wall_s:.1f}s wall"]
    for p in policies:
        hist = ", ".join(f"{s}: {n}" for s, n in sorted(p.staleness_hist.items())) or "-"
        lines += [
            f"policy {p.policy}: {p.steps} steps",
            f"  reward      {p.reward_before():.3f} -> {p.reward_after():.3f} "
            f"(mean of the first 2 and the last 5 steps)",
            f"  speed       {p.steps_per_s():.2f} steps/s, {_figure(p.samples_per_s())} samples/s (steady state)",
            f"  staleness   samples by versions behind: {hist}",
            f"  batches     {p.batches_trained} trained, {p.batches_unused} not trained; "
            f"{p.stale_groups:.0f} stale groups left out; {p.skipped_no_signal} step(s) without signal (no "
            f"optimiser step, no new version: last version v{p.version})",
        ]
        if p.groups_filtered:
            lines.append(f"  filter      {sum(p.groups_filtered):.0f} prompt groups left out (all rewards equal), "
                         f"{_mean(p.groups_filtered):.1f} per step")
        if p.correct:
            k = min(5, len(p.correct))
            lines.append(f"  answers     correct {_mean(p.correct[:2]):.3f} -> {_mean(p.correct[-k:]):.3f}, "
                         f"in form {_mean(p.formatted[:2]):.3f} -> {_mean(p.formatted[-k:]):.3f} (trained batches)")
        if p.offload_ms:
            lines.append(f"  colocated   offload {_mean(p.offload_ms):.0f} ms, onload {_mean(p.onload_ms):.0f} ms per step "
                         f"(mean of {len(p.offload_ms)}; max {max(p.offload_ms):.0f} and {max(p.onload_ms):.0f} ms)")
        nan = float("nan")
        for phase, m in p.evals.items():
            lines.append(f"  eval {phase:<6} accuracy {m.get('accuracy', nan):.3f} [{m.get('accuracy_lo', nan):.3f}, "
                         f"{m.get('accuracy_hi', nan):.3f}], reward {m.get('reward_mean', nan):.3f}"
                         + (f", in form {m['formatted_frac']:.3f}" if "formatted_frac" in m else "")
                         + f" on {m.get('samples', 0):.0f} held-out samples of "
                         f"{m.get('problems', 0):.0f} problems (weights v{m.get('min_weight_version', -1):.0f})")
        if p.eval_difference:
            d = p.eval_difference
            lines.append(f"  eval change accuracy {d['accuracy_diff']:+.3f} [{d['accuracy_diff_lo']:+.3f}, "
                         f"{d['accuracy_diff_hi']:+.3f}] after - before on {d['paired_problems']:.0f} paired problems "
                         "(95%, paired bootstrap)")
        during = [e for e in p.eval_points if e.get("phase") == "during" and "metrics" in e]
        if during:
            lines.append("  eval during " + ", ".join(f"step {e['step']}: {e['metrics'].get('accuracy', nan):.3f}"
                                                      for e in during))
    if faults is not None:
        restarted = ", ".join(f"{name} {n}" for name, n in sorted(faults.restarts.items()) if n) or "none"
        lines.append(f"faults: restarts {restarted}; {faults.requeued_jobs} job(s) requeued, "
                     f"{faults.reclaimed_batches} batch(es) redelivered, {faults.dead_letters} dead letter(s)"
                     + (f" (shard(s) {', '.join(map(str, faults.unread_shards))} not read: lost or not answering)"
                        if faults.unread_shards else ""))
    return "\n".join(lines)


def _figure(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2f}"


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def format_outputs(outputs: dict[str, dict[str, Path]]) -> str:
    """Where each policy's metric logs went (``trainer.metric_loggers.output_paths``), with how to open them."""
    lines = ["metric logs"]
    for policy, paths in outputs.items():
        for backend, path in paths.items():
            hint = ""
            if backend == "tensorboard":
                hint = f"  (tensorboard --logdir {path.parent})"
            elif backend == "wandb" and path.name.startswith("offline-run-"):
                hint = f"  (wandb sync {path})"
            lines.append(f"  {policy:<8} {backend:<12} {path}{hint}")
    return "\n".join(lines)


def plot_rewards(policies: Iterable[PolicySummary], path: str | Path, *, title: str = "") -> Path:
    """A PNG of each policy's reward per step (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for p in policies:
        line, = ax.plot(range(1, len(p.rewards) + 1), p.rewards, marker=".", label=f"{p.policy} reward")
        if p.correct:
            ax.plot(range(1, len(p.correct) + 1), p.correct, linestyle="--", color=line.get_color(),
                    label=f"{p.policy} correct")
            ax.plot(range(1, len(p.formatted) + 1), p.formatted, linestyle=":", color=line.get_color(),
                    label=f"{p.policy} in form")
        held = [(e["step"], e["metrics"]) for e in p.eval_points if "metrics" in e and "accuracy" in e["metrics"]]
        if held:  # every held-out eval (before, during, after) with its 95% Wilson interval
            xs = [x for x, _ in held]
            ys = [m["accuracy"] for _, m in held]
            lo = [max(0.0, m["accuracy"] - m.get("accuracy_lo", m["accuracy"])) for _, m in held]
            hi = [max(0.0, m.get("accuracy_hi", m["accuracy"]) - m["accuracy"]) for _, m in held]
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="s", capsize=3, color=line.get_color(),
                        label=f"{p.policy} held-out accuracy (95% interval)")
    ax.set_xlabel("training step")
    ax.set_ylabel("trained batch: mean reward, share of answers")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
