"""The controller's Prometheus metrics, in a registry of their own.

Each ``ControllerMetrics`` owns its ``CollectorRegistry`` (no process-global state, so
several controllers, in tests or side by side, never collide on metric names).
``serve(port)`` exposes them on ``/metrics``: engines per state, the latency of each
health check (by outcome) and of each round over all engines, the duration of each weight update over
all serving engines (by policy and outcome), weight-update failures, engine restarts, and what the
janitor removed (stream entries by stream, payloads by store kind, expired groups by stream).
"""

from __future__ import annotations

import logging
from collections import Counter as Tally
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rollout_bus.events.registry import EngineState

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_UPDATE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.engine_states = Gauge(
            "rollout_bus_controller_engines", "Engines per state", ["state"], registry=self.registry)
        self.health_check_seconds = Histogram(
            "rollout_bus_controller_health_check_seconds", "Latency of one /health_generate check",
            ["outcome"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.health_round_seconds = Histogram(
            "rollout_bus_controller_health_round_seconds", "Duration of one health check round over all engines",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.weight_update_seconds = Histogram(
            "rollout_bus_controller_weight_update_seconds",
            "Duration of one weight update over all serving engines", ["policy", "outcome"],
            buckets=_UPDATE_BUCKETS, registry=self.registry)
        self.weight_update_failures = Counter(
            "rollout_bus_controller_weight_update_failures", "Weight updates refused or failed, per engine",
            ["policy", "kind"], registry=self.registry)
        self.weight_checks = Counter(
            "rollout_bus_controller_weight_checks",
            "Engine weight digests compared with the published ones, per policy and outcome (match, mismatch, "
            "unchecked)", ["policy", "outcome"], registry=self.registry)
        self.engine_restarts = Counter(
            "rollout_bus_controller_engine_restarts", "Engine relaunches", registry=self.registry)
        self.engines_scaled = Counter(
            "rollout_bus_controller_engines_scaled", "Engines started (up) or drained and stopped (down) by a scale "
            "command, per pool", ["policy", "direction"], registry=self.registry)
        self.memory_seconds = Histogram(
            "rollout_bus_controller_memory_seconds", "Duration of one offload or onload command over its engines",
            ["command"], buckets=_UPDATE_BUCKETS, registry=self.registry)
        self.janitor_removed = Counter(
            "rollout_bus_controller_janitor_removed",
            "What the janitor removed: stream entries (by stream), payloads (by store kind), groups (by stream)",
            ["what", "where"], registry=self.registry)
        self.janitor_seconds = Histogram(
            "rollout_bus_controller_janitor_seconds", "Duration of one janitor pass",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._server: Any = None
        for state in EngineState:
            self.engine_states.labels(state.value).set(0)
        for outcome in ("ok", "failed"):  # exported from the start, at 0
            self.health_check_seconds.labels(outcome)

    def set_states(self, states: Iterable[EngineState]) -> None:
        counts = Tally(states)
        for state in EngineState:
            self.engine_states.labels(state.value).set(counts.get(state, 0))

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Expose ``/metrics`` on ``port`` (0 = any free port); returns the port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        bound = int(server.server_address[1])
        log.info("controller metrics on http://%s:%d/metrics", addr, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
