"""Configuration of one executor process."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from rollout_bus.events.names import DEFAULT_NAMESPACE
from rollout_bus.events.rollouts import RequestBounds
from rollout_bus.executor.agents import AgentConfig
from rollout_bus.executor.engines import RouterConfig
from rollout_bus.executor.plugins import PluginConfig
from rollout_bus.executor.rollout import RolloutConfig

QUEUE_KINDS = ("rollout", "eval")


@dataclass
class ExecutorConfig:
    redis_url: str | None = None
    """None: ``$REDIS_URL`` or the local default."""
    namespace: str = DEFAULT_NAMESPACE
    index: int | None = None
    """Given, the worker is ``<host>-<namespace>-executor-<index>`` (rq worker names are global to a
    Redis), stable across restarts, so a restarted executor takes over its own name and expires its
    predecessor's jobs at once (a supervisor gives each child one). None: a name of this process
    alone (``...-executor-p<pid>-<random>``), so executors started by hand never clash; a dead
    one's jobs are then retried after its heartbeat TTL."""
    host: str = field(default_factory=socket.gethostname)
    queues: tuple[str, ...] = QUEUE_KINDS
    """Which queues to serve, in priority order: ``rollout`` and/or ``eval``."""
    plugins: PluginConfig = field(default_factory=PluginConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    payload_store: str = "redis"
    """Where batch payloads go (``events.payload`` spec): ``redis``, ``shm[:/dir]``, ``memfd`` or ``file:/shared/dir``."""
    check_policy: bool = True
    """Fail a request at once when the registry does not know its policy (no record, no engine has it)."""
    request_bounds: RequestBounds = field(default_factory=RequestBounds)
    """Upper bounds of a request's sizes; a request past one fails at once, naming the field and bound."""
    heartbeat_ttl_s: int = 10
    """A job whose executor sent no heartbeat for this long is abandoned and requeued (rq retry)."""
    heartbeat_interval_s: float = 2.0
    reap_interval_s: float = 2.0
    """How often this executor looks for abandoned jobs (one executor at a time does it)."""
    worker_ttl_s: int = 30
    """rq worker key TTL; an idle worker also runs rq maintenance every ``worker_ttl_s - 15`` s."""
    agent: AgentConfig | None = None
    """Run agent episodes through the session gateway instead of single-turn generation (``executor.agents``)."""
    metrics_port: int | None = None
    """Serve Prometheus ``/metrics`` on this port (0: any free one); None: not at all."""
    log_level: str = "INFO"
    instance: str = field(default_factory=lambda: f"p{os.getpid()}-{uuid.uuid4().hex[:6]}")
    """The name part used when ``index`` is None."""

    @property
    def name(self) -> str:
        return f"{self.host}-{self.namespace}-executor-{self.instance if self.index is None else self.index}"

    def validate(self) -> None:
        unknown = [q for q in self.queues if q not in QUEUE_KINDS]
        if unknown or not self.queues:
            raise ValueError(f"queues must be a non-empty subset of {QUEUE_KINDS}, got {list(self.queues)}")
        if self.heartbeat_interval_s * 2 > self.heartbeat_ttl_s:
            raise ValueError("heartbeat_interval_s must be at most half of heartbeat_ttl_s")
        if self.index is not None and self.index < 0:
            raise ValueError("index must be >= 0")
