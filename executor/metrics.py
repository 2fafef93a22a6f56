"""The executor's Prometheus metrics, in a registry of their own (no process-global state).

Jobs started, and ended by outcome (``ok``, ``failed``, ``retried``); samples published
(samples/s is ``rate(rollout_bus_executor_samples_total[1m])``); the tensor bytes of each
published batch; job wall time and its split between engine calls and the rest. Queue
depth (requests queued, by rq state) is namespace-wide: the bus exporter
(``events.metrics.BusCollector``) serves it as ``rollout_bus_queue_jobs``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from rollout_bus.events.metrics import serve_metrics

if TYPE_CHECKING:
    from rollout_bus.events.train_data import TrainData

log = logging.getLogger(__name__)

_JOB_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
_BYTE_BUCKETS = tuple(float(4 ** k * 1024) for k in range(11))  # 1 KiB .. 1 GiB
OUTCOMES = ("ok", "failed", "retried")


class ExecutorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.jobs = Counter("rollout_bus_executor_jobs", "Rollout attempts by outcome (ok, failed, retried)",
                            ["outcome"], registry=self.registry)
        for outcome in OUTCOMES:  # every outcome is exported from the start, at 0
            self.jobs.labels(outcome)
        self.started = Counter("rollout_bus_executor_jobs_started", "Rollout attempts started",
                               registry=self.registry)
        self.samples = Counter("rollout_bus_executor_samples", "Samples published in batches",
                               registry=self.registry)
        self.batch_bytes = Histogram("rollout_bus_executor_batch_bytes",
                                     "Tensor bytes of each published batch (its payload less the header)",
                                     buckets=_BYTE_BUCKETS, registry=self.registry)
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

    def job_done(self, metrics: dict[str, float], n_samples: int, data: TrainData | None = None) -> None:
        self.jobs.labels("ok").inc()
        self.samples.inc(n_samples)
        if data is not None:
            self.batch_bytes.observe(tensor_bytes(data))
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


def tensor_bytes(data: TrainData) -> int:
    """Bytes of the tensors a batch of ``data`` carries (ragged fields: values and offsets)."""
    from rollout_bus.events.batch import Ragged

    fields, _meta = data.to_tensors()
    tensors = [t for v in fields.values() for t in ((v.values, v.offsets) if isinstance(v, Ragged) else (v,))]
    return sum(t.numel() * t.element_size() for t in tensors)
