"""The controller's registry of engines and policies, readable by every role.

The controller owns these hashes and writes them on every transition (beside the
event it publishes); executors read them to route requests, the status command to
show them. Records are msgpack maps; an unreadable record is skipped with a warning.

A registry made with a ``fence`` (the controller's fencing token, ``controller.lease``)
writes through a Lua script that refuses the write with ``Fenced`` when the namespace's
fencing counter has moved past the token: a controller that lost its lease cannot
overwrite what the new one wrote. Made with a ``holder`` too (the lease owner that took the
token), it also refuses an equal token from another owner, and any token once Redis no longer
knows who holds the current one (its data was lost): the writer must take the lease again.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack
import redis

from rollout_bus.events.connection import Guard, as_str
from rollout_bus.events.errors import Fenced, RedisCommandError
from rollout_bus.events.names import ADAPTER_SEPARATOR, REGISTRY_GENERATION, Keys, check_name

log = logging.getLogger(__name__)
R = TypeVar("R")

def adapter_name(policy: str, version: int) -> str:
    """The LoRA adapter name an engine serves ``policy`` at ``version`` under: ``<policy>@v<version>``.

    SGLang keeps no version per adapter, so the name carries it: a new version is loaded under a new
    name (then the old one unloaded), and a generate call's version is read from the name it used. The
    name always passes ``events.names.adapter_name_problem``, which engines check: a policy that is no
    name (``policy.v2``), or a negative version, is a ``ValueError`` here, never a name sent to an engine."""
    check_name("policy", policy)
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 10 ** 19:
        raise ValueError(f"an adapter's version is an integer from 0 to 10**19 - 1, got {version!r}")
    return f"{policy}{ADAPTER_SEPARATOR}{version}"


def parse_adapter_name(name: str) -> tuple[str, int] | None:
    """``(policy, version)`` of an adapter name made by ``adapter_name``; None for any other name."""
    policy, sep, version = name.rpartition(ADAPTER_SEPARATOR)
    if not sep or not policy or not version.isdigit():
        return None
    return policy, int(version)


FENCED = "FENCED"
GENERATION = REGISTRY_GENERATION
_GENERATION_BYTES = GENERATION.encode()
# KEYS[1] fencing counter, KEYS[2] hash, KEYS[3] fence holder; ARGV[1] token, ARGV[2] 'set', 'del' or 'check' (refuse
# or pass, write nothing), ARGV[3] the
# writer's lease owner ('' for none), ARGV[4..] fields (and values).
_FENCED_WRITE = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current > tonumber(ARGV[1]) then
  return redis.error_reply('FENCED token ' .. ARGV[1] .. ' is older than ' .. current ..
                           ': another controller holds the lease')
end
if ARGV[3] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[3] then
  return redis.error_reply('FENCED token ' .. ARGV[1] .. ' is not the one the current holder took (counter ' .. current ..
                           '): another controller took this number, or Redis lost it')
end
if ARGV[2] == 'check' then
  return 0
end
local n
if ARGV[2] == 'del' then
  n = redis.call('HDEL', KEYS[2], unpack(ARGV, 4))
else
  n = redis.call('HSET', KEYS[2], unpack(ARGV, 4))
end
redis.call('HINCRBY', KEYS[2], '#gen', 1)
return n
"""


def fenced_error(exc: BaseException) -> Fenced | None:
    """``exc`` as ``Fenced`` when it is a fenced write's refusal, else None."""
    if isinstance(exc, Fenced):
        return exc
    if FENCED in str(exc):
        return Fenced(str(exc))
    return None


class EngineState(enum.StrEnum):
    LAUNCHING = "launching"
    PENDING_WEIGHTS = "pending_weights"
    SERVING = "serving"
    UNHEALTHY = "unhealthy"
    RESTARTING = "restarting"
    OFFLOADED = "offloaded"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass
class EngineRecord:
    engine_id: str
    url: str
    state: EngineState
    backend: str = "cpu"
    managed: bool = True
    versions: dict[str, int] = field(default_factory=dict)
    """Version of every policy the engine serves: its base policy's weights and its adapters."""
    adapters: dict[str, str] = field(default_factory=dict)
    """Adapter policies: policy -> the LoRA adapter name to send as ``lora_path``."""
    updating: dict[str, int] = field(default_factory=dict)
    pause_mode: str = "retract"
    base_policy: str = "default"
    load: int = 0
    pid: int | None = None
    offloaded_tags: list[str] = field(default_factory=list)
    updated_ms: int = field(default_factory=lambda: time.time_ns() // 1_000_000)
    generate_url: str = ""
    """Where executors send ``/generate`` when not to ``url`` (an SGLang engine behind its fence guard)."""
    role: str = "train"
    """``eval``: an engine of the eval pool (``--eval-engines``), kept on the newest weights like any other but
    used by eval requests alone; anything else: an engine for every request."""

    @property
    def evaluates(self) -> bool:
        """Whether the engine is kept for eval requests (training rollouts never use it)."""
        return self.role == "eval"

    def serves(self, policy: str) -> bool:
        return (self.state == EngineState.SERVING and policy in self.versions
                and (policy == self.base_policy or policy in self.adapters))

    def lora_path(self, policy: str) -> str | None:
        """What a generate call for ``policy`` sends as ``lora_path``: None for the engine's base policy,
        else the name of the adapter that serves it."""
        return None if policy == self.base_policy else self.adapters.get(policy)

    def pack(self) -> bytes:
        data = dataclasses.asdict(self)
        data["state"] = self.state.value
        return msgpack.packb(data, use_bin_type=True)

    @classmethod
    def unpack(cls, raw: bytes) -> EngineRecord:
        data = msgpack.unpackb(raw, raw=False)
        data["state"] = EngineState(data["state"])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class PolicyRecord:
    policy: str
    published: int = -1
    serving: int = -1
    uri: str = ""
    sha256: str = ""
    engines: int = -1
    """A pool's size as last scaled at run time (``rollout-bus scale``); -1: the configured size."""
    updated_ms: int = field(default_factory=lambda: time.time_ns() // 1_000_000)

    def pack(self) -> bytes:
        return msgpack.packb(dataclasses.asdict(self), use_bin_type=True)

    @classmethod
    def unpack(cls, raw: bytes) -> PolicyRecord:
        data = msgpack.unpackb(raw, raw=False)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class Registry:
    """Read and write engine and policy records under one namespace."""

    def __init__(self, client: redis.Redis, keys: Keys, guard: Guard | None = None, *,
                 fence: int | None = None, holder: str | None = None) -> None:
        self.client = client
        self.keys = keys
        self.guard = guard or Guard(client, name="registry")
        self.fence = fence
        self.holder = holder
        self._fenced = client.register_script(_FENCED_WRITE) if fence is not None else None

    def put_engine(self, record: EngineRecord, pipe: Any = None) -> None:
        """Write ``record`` (stamped now); queued on ``pipe`` when one is given, else sent at once."""
        record.updated_ms = time.time_ns() // 1_000_000
        self._put(self.keys.engine_registry, record.engine_id, record.pack(), pipe)

    def put_engines(self, records: Sequence[EngineRecord]) -> None:
        """Write several records (stamped now) with one command: one ``HSET`` of every field, fenced as one."""
        if not records:
            return
        now_ms = time.time_ns() // 1_000_000
        pairs: list[Any] = []
        for record in records:
            record.updated_ms = now_ms
            pairs += [record.engine_id, record.pack()]
        if self._fenced is not None:
            self._run_fenced(self.keys.engine_registry, "set", pairs, None)
        else:
            def send(c: Any) -> None:
                pipe = c.pipeline(transaction=False)
                pipe.execute_command("HSET", self.keys.engine_registry, *pairs)
                pipe.hincrby(self.keys.engine_registry, GENERATION, 1)
                pipe.execute()
            self.guard.call(send)

    def engines_generation(self) -> int:
        """How many writes the engine records have seen (one ``HGET``): unchanged means no record changed."""
        raw = self.guard.call(lambda c: c.hget(self.keys.engine_registry, GENERATION))
        return int(raw or 0)

    def remove_engine(self, engine_id: str) -> None:
        if self._fenced is None:
            def send(c: Any) -> None:
                pipe = c.pipeline(transaction=False)
                pipe.hdel(self.keys.engine_registry, engine_id)
                pipe.hincrby(self.keys.engine_registry, GENERATION, 1)
                pipe.execute()
            self.guard.call(send)
        else:
            self._run_fenced(self.keys.engine_registry, "del", [engine_id], None)

    def check_fence(self) -> None:
        """Raise ``Fenced`` where a fenced write would be refused now, writing nothing; no-op when unfenced.
        Sent just before an event that has no record of its own (the event's script carries no token)."""
        if self._fenced is not None:
            self._run_fenced(self.keys.engine_registry, "check", [], None)

    def engines(self) -> dict[str, EngineRecord]:
        return {rec.engine_id: rec for rec in self._read(self.keys.engine_registry, EngineRecord.unpack, "engine")}

    def serving(self, policy: str) -> list[EngineRecord]:
        return [r for r in self.engines().values() if r.serves(policy)]

    def put_policy(self, record: PolicyRecord, pipe: Any = None) -> None:
        """Write ``record`` (stamped now); queued on ``pipe`` when one is given, else sent at once."""
        record.updated_ms = time.time_ns() // 1_000_000
        self._put(self.keys.policy_registry, record.policy, record.pack(), pipe)

    def trainer_lease_owner(self, policy: str) -> str | None:
        """The trainer that holds ``policy``'s lease (``<trainer_id>/<dp_size>``, ``trainer.lease``), None when
        none does (a lease that lapsed, was released, or never existed)."""
        raw = self.guard.call(lambda c: c.hget(self.keys.trainer_lease(policy), "owner"))
        return None if raw is None else as_str(raw)

    def policies(self) -> dict[str, PolicyRecord]:
        return {rec.policy: rec for rec in self._read(self.keys.policy_registry, PolicyRecord.unpack, "policy")}

    def policy(self, policy: str) -> PolicyRecord | None:
        return self.policies().get(policy)

    def _put(self, key: str, name: str, packed: bytes, pipe: Any) -> None:
        if self._fenced is not None:
            self._run_fenced(key, "set", [name, packed], pipe)
        elif pipe is not None:
            pipe.hset(key, name, packed)
            pipe.hincrby(key, GENERATION, 1)
        else:
            def send(c: Any) -> None:
                p = c.pipeline(transaction=False)
                p.hset(key, name, packed)
                p.hincrby(key, GENERATION, 1)
                p.execute()
            self.guard.call(send)

    def _run_fenced(self, key: str, op: str, args: list[Any], pipe: Any) -> None:
        assert self._fenced is not None
        script_keys = [self.keys.controller_fence, key, self.keys.controller_fence_holder]
        script_args = [self.fence, op, self.holder or "", *args]
        if pipe is not None:  # refused at the pipeline's execute: see ``fenced_error``
            self._fenced(keys=script_keys, args=script_args, client=pipe)
            return
        try:
            self.guard.call(lambda c: self._fenced(keys=script_keys, args=script_args, client=c))  # type: ignore[misc]
        except RedisCommandError as exc:
            raise fenced_error(exc) or exc from None

    def _read(self, key: str, unpack: Callable[[bytes], R], kind: str) -> Iterator[R]:
        """Every readable record of the hash ``key``; an unreadable one is skipped with a warning."""
        raw: dict[bytes, bytes] = self.guard.call(lambda c: c.hgetall(key))
        for name, value in raw.items():
            if name == _GENERATION_BYTES:
                continue
            try:
                yield unpack(value)
            except Exception as exc:  # a record written by another version, or damaged: skip, never crash readers
                log.warning("skipping unreadable %s record %r: %s", kind, name, exc)
