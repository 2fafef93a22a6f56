"""The gateway's Prometheus metrics, in a registry of their own: turns per session, tokens per turn,
generation time against environment time, engine switches, journal hits, and refused calls by code."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_TURN_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.sessions_opened = Counter("rollout_bus_gateway_sessions_opened", "Sessions opened (attempts)",
                                       registry=r)
        self.sessions_closed = Counter("rollout_bus_gateway_sessions_closed", "Sessions ended, by status",
                                       ["status"], registry=r)
        self.turns = Counter("rollout_bus_gateway_turns", "Turns served, by source (engine or journal)",
                             ["source"], registry=r)
        self.turns_per_session = Histogram("rollout_bus_gateway_turns_per_session", "Turns of each ended session",
                                           buckets=_TURN_BUCKETS, registry=r)
        self.new_tokens = Histogram("rollout_bus_gateway_turn_new_tokens",
                                    "Tokens appended per turn for the client's messages (mask 0)",
                                    buckets=_TOKEN_BUCKETS, registry=r)
        self.output_tokens = Histogram("rollout_bus_gateway_turn_output_tokens", "Tokens generated per turn",
                                       buckets=_TOKEN_BUCKETS, registry=r)
        self.generation_s = Histogram("rollout_bus_gateway_generation_seconds", "Engine time per turn",
                                      buckets=_TIME_BUCKETS, registry=r)
        self.environment_s = Histogram("rollout_bus_gateway_environment_seconds",
                                       "Time between a turn's reply and the session's next call (the agent and "
                                       "its environment)", buckets=_TIME_BUCKETS, registry=r)
        self.overhead_s = Histogram("rollout_bus_gateway_overhead_seconds",
                                    "Gateway time per turn beyond the engine call", buckets=_TIME_BUCKETS,
                                    registry=r)
        self.engine_switches = Counter("rollout_bus_gateway_engine_switches",
                                       "Turns moved off their session's engine (it died or stopped serving)",
                                       registry=r)
        self.refused = Counter("rollout_bus_gateway_refused", "Calls refused, by error code", ["code"], registry=r)
