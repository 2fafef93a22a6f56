"""The controller's registry of engines and policies, readable by every role.

The controller owns these hashes and writes them on every transition (beside the
event it publishes); executors read them to route requests, the status command to
show them. Records are msgpack maps; an unreadable record is skipped with a warning.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis

from events.connection import Guard
from events.names import Keys

log = logging.getLogger(__name__)


class EngineState(enum.StrEnum):
    LAUNCHING = "launching"
    PENDING_WEIGHTS = "pending_weights"
    SERVING = "serving"
    UNHEALTHY = "unhealthy"
    RESTARTING = "restarting"
    OFFLOADED = "offloaded"
    STOPPED = "stopped"


@dataclass
class EngineRecord:
    engine_id: str
    url: str
    state: EngineState
    backend: str = "cpu"
    managed: bool = True
    versions: dict[str, int] = field(default_factory=dict)
    updating: dict[str, int] = field(default_factory=dict)
    pause_mode: str = "retract"
    base_policy: str = "default"
    load: int = 0
    pid: int | None = None
    offloaded_tags: list[str] = field(default_factory=list)
    updated_ms: int = field(default_factory=lambda: time.time_ns() // 1_000_000)

    def serves(self, policy: str) -> bool:
        return self.state == EngineState.SERVING and policy in self.versions

    def lora_path(self, policy: str) -> str | None:
        """The engine weight set that serves ``policy``: the base weights, or the set named after it."""
        return None if policy == self.base_policy else policy

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

    def __init__(self, client: redis.Redis, keys: Keys, guard: Guard | None = None) -> None:
        self.client = client
        self.keys = keys
        self.guard = guard or Guard(client, name="registry")

    def put_engine(self, record: EngineRecord, pipe: Any = None) -> None:
        record.updated_ms = time.time_ns() // 1_000_000
        target = pipe if pipe is not None else self.client
        if pipe is not None:
            target.hset(self.keys.engine_registry, record.engine_id, record.pack())
        else:
            self.guard.call(lambda c: c.hset(self.keys.engine_registry, record.engine_id, record.pack()))

    def remove_engine(self, engine_id: str) -> None:
        self.guard.call(lambda c: c.hdel(self.keys.engine_registry, engine_id))

    def engines(self) -> dict[str, EngineRecord]:
        raw: dict[bytes, bytes] = self.guard.call(lambda c: c.hgetall(self.keys.engine_registry))
        out: dict[str, EngineRecord] = {}
        for key, value in raw.items():
            try:
                rec = EngineRecord.unpack(value)
            except Exception as exc:
                log.warning("skipping unreadable engine record %r: %s", key, exc)
                continue
            out[rec.engine_id] = rec
        return out

    def serving(self, policy: str) -> list[EngineRecord]:
        return [r for r in self.engines().values() if r.serves(policy)]

    def put_policy(self, record: PolicyRecord, pipe: Any = None) -> None:
        record.updated_ms = time.time_ns() // 1_000_000
        if pipe is not None:
            pipe.hset(self.keys.policy_registry, record.policy, record.pack())
        else:
            self.guard.call(lambda c: c.hset(self.keys.policy_registry, record.policy, record.pack()))

    def policies(self) -> dict[str, PolicyRecord]:
        raw: dict[bytes, bytes] = self.guard.call(lambda c: c.hgetall(self.keys.policy_registry))
        out: dict[str, PolicyRecord] = {}
        for key, value in raw.items():
            try:
                rec = PolicyRecord.unpack(value)
            except Exception as exc:
                log.warning("skipping unreadable policy record %r: %s", key, exc)
                continue
            out[rec.policy] = rec
        return out

    def policy(self, policy: str) -> PolicyRecord | None:
        return self.policies().get(policy)
