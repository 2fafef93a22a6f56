"""The controller's configuration: one validated dataclass, no heavy imports.

``rollout-bus controller`` (``controller.cli``) parses flags into a ``ControllerConfig`` before it imports
anything that talks to Redis or engines, so ``--help`` and config errors are instant.
``validate`` reports every problem at once; ``from_mapping`` rejects unknown keys with
the closest known one as a hint.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

from rollout_bus.events.errors import InvalidRequest
from rollout_bus.events.names import DEFAULT_NAMESPACE, check_name, name_problem

BackendName = Literal["cpu", "sglang"]
PauseMode = Literal["abort", "retract", "in_place"]
OffloadTag = Literal["weights", "kv_cache", "cuda_graph"]
BACKENDS: tuple[str, ...] = get_args(BackendName)
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)
WeightSync = Literal["disk", "broadcast"]
WEIGHT_SYNCS: tuple[str, ...] = get_args(WeightSync)
BROADCAST_PAUSES = ("before", "swap")
OFFLOAD_TAGS: tuple[str, ...] = get_args(OffloadTag)


ENGINE_API_KEY_ENV = "ROLLOUT_BUS_ENGINE_API_KEY"


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class ConfigError(InvalidRequest):
    """The configuration is invalid; the message lists every problem."""


def parse_pools(items: list[str]) -> dict[str, int]:
    """``["p1=2", "p2=1"]`` -> ``{"p1": 2, "p2": 1}``; ``ValueError`` naming the bad item."""
    pools: dict[str, int] = {}
    for item in items:
        policy, sep, count = item.partition("=")
        if not sep or not count.strip().isdigit():
            raise ValueError(f"pool {item!r} must be POLICY=NUM_ENGINES")
        if policy in pools:
            raise ValueError(f"pool {policy!r} is given twice")
        pools[policy] = int(count)
    return pools


def engine_id(base_policy: str, policy: str, index: int) -> str:
    """The id of engine ``index`` of ``policy``'s pool: ``engine-<i>`` in the base pool, else ``engine-<policy>-<i>``."""
    return f"engine-{index}" if policy == base_policy else f"engine-{policy}-{index}"


@dataclass
class ControllerConfig:
    """Everything one controller instance needs; see ``rollout-bus controller --help``."""

    # --- where -----------------------------------------------------------------------
    namespace: str = DEFAULT_NAMESPACE
    redis_url: str | None = None
    instance: str = field(default_factory=socket.gethostname)
    # --- engines ---------------------------------------------------------------------
    backend: str = "cpu"
    num_engines: int = 1
    """Engines of the base policy's pool (adapter policies are served on them too)."""
    pools: list[str] = field(default_factory=list)
    """More pools, ``POLICY=NUM_ENGINES``: engines whose base weights are that full-weight policy's."""
    eval_engines: int = 0
    """Engines of the eval pool: base-pool engines (kept on the newest weights, adapters included) that
    register with role ``eval``, so executors send them eval requests and never a training rollout."""
    model_path: str = ""
    engine_host: str = ""
    """Where launched engines listen; "" (auto): 127.0.0.1 when ``advertise_host`` is a loopback address
    (everything on one host), else 0.0.0.0."""
    advertise_host: str = ""
    """The address engines register under, for executors and the controller on other hosts; "" (auto):
    this host's address on the route to Redis (``events.connection.route_address``)."""
    engine_args: list[str] = field(default_factory=list)
    token_delay_ms: float = 0.0
    seed: int | None = None
    initial_version: int = 0
    adopt_urls: list[str] = field(default_factory=list)
    python: str = sys.executable
    engine_api_key: str | None = field(default_factory=lambda: os.environ.get(ENGINE_API_KEY_ENV) or None)
    """Sent as a bearer token to every engine, and given to launched ones as ``--api-key``."""
    enable_lora: bool = False
    """Launch engines with LoRA on, so adapter policies can be served."""
    max_loras_per_batch: int = 8
    max_lora_rank: int = 64
    lora_target_modules: list[str] = field(default_factory=lambda: ["all"])
    tp_size: int = 1
    """SGLang: GPUs per engine; engine ``i`` (counted over every pool) starts at ``base_gpu_id + i * tp_size``."""
    base_gpu_id: int = 0
    max_engines: int = 8
    """The most engines a pool may be scaled to at run time (``rollout-bus scale``); ``max_pool`` per policy."""
    max_pools: list[str] = field(default_factory=list)
    """``POLICY=N``: the most engines of that policy's pool, over ``max_engines``."""
    drain_timeout_s: float = 120.0
    """How long a scaled-down engine's requests in flight may run on; then they are aborted (executors
    continue their partial output on another engine) and the engine stops."""
    drain_grace_s: float = 1.0
    """A draining engine is stopped no sooner than this after it left the serving set: longer than an
    executor keeps a registry snapshot without asking whether it changed."""
    colocate: bool = False
    """Engines share their devices with a trainer, which offloads and onloads them around each step: every
    engine must be able to release its memory (checked at start, ``colocate_problem``)."""
    memory_saver: bool = True
    """SGLang: launch with ``--enable-memory-saver`` (needed to release memory: ``--no-memory-saver`` turns it off)."""
    log_dir: str | None = None
    startup_timeout_s: float = 120.0
    max_restart_attempts: int = 5
    stop_engines_on_exit: bool = True
    # --- health ----------------------------------------------------------------------
    health_interval_s: float = 5.0
    health_timeout_s: float = 5.0
    health_failure_threshold: int = 3
    # --- weights ---------------------------------------------------------------------
    weights_root: str = ""
    base_policy: str = "default"
    pause_mode: str = "retract"
    update_timeout_s: float = 120.0
    request_timeout_s: float = 30.0
    weight_sync: str = "disk"
    """``broadcast``: full weights a trainer offers by collective go through the engines' weight-update group
    (``controller.broadcast``), the version directory staying the fallback; ``disk``: always the directory."""
    broadcast_pause: str = "before"
    """broadcast: ``before`` pauses the engines before the first bucket (a real SGLang engine loads each bucket as
    it arrives); ``swap`` only before the last one, for engines that stage a version and swap it in whole (the
    CPU engine): they serve the old weights while the rest arrives."""
    group_timeout_s: float = 60.0
    """broadcast: how long a weight-update group may take to form, or a rank in a broadcast (the CPU engine's
    ``--dist-timeout``); a group that breaks or times out is destroyed and the version delivered by disk."""
    weights_missing_wait_s: float = 20.0
    """How long a publication whose directory this host does not see yet (a shared mount late to show it)
    is checked again, with backoff (0.25 s doubling up to 4 s), before its refusal is final; 0: at once.
    Shorter than a trainer's serving timeout (60 s), so a final refusal still reaches it in time."""
    # --- coordination and observability ------------------------------------------------
    lease_ttl_s: float = 10.0
    metrics_port: int | None = None
    # --- housekeeping (the janitor, events.janitor) --------------------------------------
    janitor_interval_s: float = 30.0
    """Seconds between janitor passes; 0 turns it off."""
    retention_max_len: int = 100_000
    """Entries kept per stream (never past what a live group still needs); 0: no length limit."""
    retention_max_age_s: float = 0.0
    """Entries older than this go (same rule); 0: no age limit."""
    payload_max_age_s: float = 24 * 3600.0
    """Payloads older than this are deleted whatever their readers."""
    payload_roots: list[str] = field(default_factory=list)
    """Directories of shm and file payload stores the janitor may delete from."""

    def engine_addresses(self) -> tuple[str, str]:
        """(listen, advertise) of launched engines, the automatic ones resolved (see the fields)."""
        from rollout_bus.events.connection import route_address  # not at import: --help loads no Redis client

        advertise = self.advertise_host or route_address(self.redis_url)
        listen = self.engine_host or ("127.0.0.1" if is_loopback(advertise) else "0.0.0.0")
        if is_loopback(listen) and not is_loopback(advertise):
            raise ConfigError(f"engines would listen on {listen} but register as {advertise}: other hosts could "
                              "not reach them; give --engine-host 0.0.0.0 (or the advertised address)")
        return listen, advertise

    @property
    def total_engines(self) -> int:
        return self.num_engines + sum(self.pool_sizes().values()) + self.eval_engines + len(self.adopt_urls)

    def pool_sizes(self) -> dict[str, int]:
        """The extra full-weight pools, policy -> number of engines."""
        return parse_pools(self.pools)

    def sizes(self) -> dict[str, int]:
        """Every pool's configured size, policy -> engines (the base pool's is ``num_engines``)."""
        return {self.base_policy: self.num_engines, **self.pool_sizes()}

    def expected_engines(self, sizes: dict[str, int] | None = None) -> dict[str, str]:
        """Engine id -> base policy of every engine to launch: ``engine-<i>`` for the base pool,
        ``engine-<policy>-<i>`` for the others, ``engine-eval-<i>`` for the eval pool (on the base policy, never
        scaled); ``sizes`` (policy -> engines) replaces the configured ones."""
        sizes = {**self.sizes(), **(sizes or {})}
        out: dict[str, str] = {}
        for policy, count in sizes.items():
            out.update({engine_id(self.base_policy, policy, i): policy for i in range(count)})
        out.update({eval_id: self.base_policy for eval_id in self.eval_engine_ids()})
        return out

    def eval_engine_ids(self) -> list[str]:
        """The engines of the eval pool: registered with role ``eval``, used by eval requests alone."""
        return [f"engine-eval-{i}" for i in range(self.eval_engines)]

    def max_sizes(self) -> dict[str, int]:
        """The most engines each pool may be scaled to (``max_engines``, or its ``max_pools`` entry)."""
        bounds = dict.fromkeys(self.sizes(), self.max_engines)
        bounds.update({p: n for p, n in parse_pools(self.max_pools).items() if p in bounds})
        return bounds

    def colocate_problem(self) -> str | None:
        """Why these engines cannot release their memory for a colocated trainer; None when they can."""
        if self.backend == "sglang" and not self.memory_saver and "--enable-memory-saver" not in self.engine_args:
            return ("--colocate needs engines that release their memory, and SGLang does that only with "
                    "--enable-memory-saver: drop --no-memory-saver")
        if self.adopt_urls:
            return ("--colocate cannot vouch for adopted engines (--adopt-url): whether they release their memory "
                    "is unknown here; let the controller launch them")
        return None

    def validate(self) -> ControllerConfig:
        """Return ``self`` or raise ``ConfigError`` naming every invalid setting."""
        problems: list[str] = []
        for kind, value in (("namespace", self.namespace), ("base_policy", self.base_policy)):
            try:
                check_name(kind, value)
            except ValueError as exc:
                problems.append(str(exc))
        if self.backend not in BACKENDS:
            problems.append(f"backend {self.backend!r} is not one of {list(BACKENDS)}")
        try:
            pools = self.pool_sizes()
        except ValueError as exc:
            problems.append(str(exc))
            pools = {}
        for policy in pools:
            try:
                check_name("pool policy", policy)
            except ValueError as exc:
                problems.append(str(exc))
        if self.base_policy in pools:
            problems.append(f"pool {self.base_policy!r} is the base policy: its engines are --num-engines")
        if any(n < 0 for n in pools.values()):
            problems.append("pool sizes must be >= 0")
        try:
            bounds = parse_pools(self.max_pools)
        except ValueError as exc:
            problems.append(f"max_pools: {exc}")
            bounds = {}
        unknown = sorted(set(bounds) - {self.base_policy, *pools})
        if unknown:
            problems.append(f"max_pools names {unknown}, which have no pool (pools: {sorted({self.base_policy, *pools})})")
        if self.max_engines < 0:
            problems.append(f"max_engines must be >= 0, got {self.max_engines}")
        for policy, size in {self.base_policy: self.num_engines, **pools}.items():
            bound = bounds.get(policy, self.max_engines)
            if size > bound:
                problems.append(f"pool {policy!r} starts with {size} engines, above its bound of {bound} "
                                "(--max-engines / --max-pool)")
        if self.drain_timeout_s <= 0 or self.drain_grace_s < 0:
            problems.append(f"drain_timeout_s must be > 0 and drain_grace_s >= 0, got {self.drain_timeout_s} and "
                            f"{self.drain_grace_s}")
        if self.colocate and self.colocate_problem():
            problems.append(str(self.colocate_problem()))
        for name in ("max_loras_per_batch", "max_lora_rank", "tp_size"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.base_gpu_id < 0:
            problems.append(f"base_gpu_id must be >= 0, got {self.base_gpu_id}")
        if self.weight_sync not in WEIGHT_SYNCS:
            problems.append(f"weight_sync {self.weight_sync!r} is not one of {list(WEIGHT_SYNCS)}")
        if self.broadcast_pause not in BROADCAST_PAUSES:
            problems.append(f"broadcast_pause {self.broadcast_pause!r} is not one of {list(BROADCAST_PAUSES)}")
        if self.broadcast_pause == "swap" and self.backend == "sglang":
            problems.append("broadcast_pause swap needs engines that stage a version (the CPU engine): SGLang loads "
                            "each bucket as it arrives, so it must be paused before the first")
        if not self.group_timeout_s > 0:
            problems.append(f"group_timeout_s must be > 0, got {self.group_timeout_s}")
        if self.pause_mode not in PAUSE_MODES:
            problems.append(f"pause_mode {self.pause_mode!r} is not one of {list(PAUSE_MODES)}")
        if self.num_engines < 0:
            problems.append(f"num_engines must be >= 0, got {self.num_engines}")
        if self.eval_engines < 0:
            problems.append(f"eval_engines must be >= 0, got {self.eval_engines}")
        elif self.eval_engines and self.num_engines + sum(pools.values()) + len(self.adopt_urls) == 0:
            problems.append("eval engines alone serve no training: give num_engines >= 1 as well")
        if self.num_engines + sum(pools.values()) + len(self.adopt_urls) == 0:
            problems.append("nothing to manage: give num_engines >= 1 or at least one adopt URL")
        launched = self.num_engines + sum(pools.values()) + max(self.eval_engines, 0)
        if launched > 0 and not self.model_path:
            problems.append("model_path is required to launch engines")
        elif launched > 0 and self.backend == "cpu" and not os.path.isdir(self.model_path):
            problems.append(f"model_path {self.model_path!r} is not a directory (a Hugging Face model directory, "
                            "or config.json + model.safetensors of the tiny LM)")
        if not self.weights_root:
            problems.append("weights_root is required: weights outside it are refused")
        for url in self.adopt_urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
                problems.append(f"adopt URL {url!r} must look like http://host:port")
        if len(set(self.adopt_urls)) != len(self.adopt_urls):
            problems.append("adopt URLs must be distinct")
        for name in ("health_interval_s", "health_timeout_s", "startup_timeout_s", "update_timeout_s",
                     "request_timeout_s", "lease_ttl_s", "payload_max_age_s"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("janitor_interval_s", "retention_max_len", "retention_max_age_s", "weights_missing_wait_s"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")
        if self.health_failure_threshold < 1:
            problems.append(f"health_failure_threshold must be >= 1, got {self.health_failure_threshold}")
        if self.max_restart_attempts < 0:
            problems.append(f"max_restart_attempts must be >= 0, got {self.max_restart_attempts}")
        if self.token_delay_ms < 0:
            problems.append(f"token_delay_ms must be >= 0, got {self.token_delay_ms}")
        if self.initial_version < 0:
            problems.append(f"initial_version must be >= 0, got {self.initial_version}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            problems.append(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        instance = name_problem("instance", self.instance, host=True)  # it names the controller's events' producer
        if instance is not None:
            problems.append(instance)
        if problems:
            raise ConfigError("invalid controller config:\n  - " + "\n  - ".join(problems))
        return self

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> ControllerConfig:
        """A validated config from a plain mapping; unknown keys are refused with a hint."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(f"unknown controller setting(s): {', '.join(hints)}")
        return cls(**data).validate()
