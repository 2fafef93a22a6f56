"""The main job's configuration: what to start, how long to train, where outputs go."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_bus.trainer.config import LOG_BACKENDS, MODES, STALE_POLICIES

__all__ = ["LOG_BACKENDS", "MODES", "STALE_POLICIES", "RunConfig", "RunFailed", "RunResult", "metrics_ports"]


@dataclass
class RunConfig:
    mode: str = "async"
    trainers: int = 1
    executors: int = 1
    engines: int = 1
    steps: int = 40
    seed: int = 0
    out: str = "runs/latest"
    redis_url: str | None = None
    namespace: str | None = None
    # --- rollouts and training ---------------------------------------------------------------
    n_groups: int = 16
    n_samples: int = 8
    max_new_tokens: int = 6
    in_flight: int = 2
    max_staleness: int = 1
    stale_policy: str = "drop"
    lr: float = 5e-4
    epochs: int = 1
    minibatches: int = 1
    digits: int = 1
    token_delay_ms: float = 0.0
    engine_max_batch: int = 128
    """Sequences an engine decodes together (a whole rollout at once by default)."""
    # --- warm start ----------------------------------------------------------------------------
    warm_steps: int = 400
    warm_keep: float = 0.25
    init_dir: str | None = None
    """Cache of warm-started weights (one subdirectory per warm-start config); default ``<out>/init``."""
    # --- extras --------------------------------------------------------------------------------
    recorder: bool = False
    """Also run a recorder of the first policy's batches into ``<out>/recording``."""
    metrics_base_port: int = 0
    """First ``/metrics`` port (see ``metrics_ports``); 0: no process serves metrics."""
    log_to: str = "jsonl"
    """The trainers' metric logs (``--log-to`` of ``rollout-bus trainer``), under ``<out>/metrics``."""
    trainer_args: list[str] = field(default_factory=list)
    controller_args: list[str] = field(default_factory=list)
    """Extra ``rollout-bus controller`` arguments (janitor settings, ...)."""
    executor_args: list[str] = field(default_factory=list)
    # --- supervision and records ----------------------------------------------------------------
    restart_budget: int = 5
    """Restarts each executor, trainer and the controller get over the run before it fails."""
    log_events: str | None = None
    """Export the run's whole event log, payloads included, to this file before Redis stops."""
    timeout_s: float = 900.0
    progress: bool = True
    plot: bool = True

    def policies(self) -> list[str]:
        return [f"p{i}" for i in range(self.trainers)]


def metrics_ports(config: RunConfig) -> dict[str, int]:
    """The ``/metrics`` port of each process, by name; empty when ``metrics_base_port`` is 0.

    The controller on the base port, executor i on base+1+i, the trainer of policy j after
    the executors, and the bus exporter (lag, pending, dead letters, queues) last.
    """
    base = config.metrics_base_port
    if not base:
        return {}
    names = ["controller", *(f"executor-{i}" for i in range(config.executors)),
             *(f"trainer-{p}" for p in config.policies()), "bus-metrics"]
    return {name: base + k for k, name in enumerate(names)}


@dataclass
class RunResult:
    config: RunConfig
    summaries: dict[str, Any]
    wall_s: float
    out: Path
    namespace: str
    text: str
    faults: dict[str, Any] = field(default_factory=dict)
    """Restarts by process, requeued jobs, reclaimed batches, dead letters (``report.RunFaults``)."""


class RunFailed(RuntimeError):
    """A process of the run failed; the message carries the end of its log."""


