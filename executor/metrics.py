"""The executor's Prometheus metrics, in a registry of their own (no process-global state)."""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from events.metrics import serve_metrics

log = logging.getLogger(__name__)

_JOB_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)


class ExecutorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.jobs = Counter("rollout_bus_executor_jobs", "Rollout attempts by outcome (ok, failed, retried)",
                            ["outcome"], registry=self.registry)
        self.samples = Counter("rollout_bus_executor_samples", "Samples published in batches",
                               registry=self.registry)
        self.job_seconds = Histogram("rollout_bus_executor_job_seconds", "Wall time of one rollout attempt",
                                     buckets=_JOB_BUCKETS, registry=self.registry)
        self.engine_busy_seconds = Counter(
            "rollout_bus_executor_engine_busy_seconds", "Job time with at least one engine call in flight",
            registry=self.registry)
        self.outside_engine_seconds = Counter(
            "rollout_bus_executor_outside_engine_seconds", "Job time with no engine call in flight",
            registry=self.registry)
        self.failovers = Counter("rollout_bus_executor_engine_failovers",
                                 "Engine calls retried on another engine", registry=self.registry)
        self.aborts = Counter("rollout_bus_executor_engine_aborts",
                              "Generate calls that finished with abort (weight-update pauses)", registry=self.registry)
        self._server: Any = None

    def job_done(self, metrics: dict[str, float], n_samples: int) -> None:
        self.jobs.labels("ok").inc()
        self.samples.inc(n_samples)
        wall = metrics.get("wall_s", 0.0)
        busy = metrics.get("engine_busy_s", 0.0)
        self.job_seconds.observe(wall)
        self.engine_busy_seconds.inc(busy)
        self.outside_engine_seconds.inc(max(wall - busy, 0.0))
        self.failovers.inc(metrics.get("failovers", 0.0))
        self.aborts.inc(metrics.get("aborts", 0.0))

    def serve(self, port: int) -> int:
        """Expose ``/metrics`` on ``port`` (0 = any free port); returns the port."""
        self._server, _ = serve_metrics(port, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
