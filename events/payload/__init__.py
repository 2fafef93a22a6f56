"""Claim-check payload stores, selected by a short spec.

Specs: ``redis`` (default; options ``chunk_kib``, ``window``, ``raw``), ``shm`` or
``shm:/dir`` (options ``pool_mib``, ``reads=private|shared``, ``fallback=redis``), ``memfd`` (sealed
segments handed over by descriptor; option ``fallback=redis``), ``file:/shared/dir``. Options follow ``?`` as
``name=value`` pairs joined by ``&``, e.g. ``redis?chunk_kib=512`` or ``shm?pool_mib=4096``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, cast
from urllib.parse import parse_qsl

import redis

from rollout_bus.events.errors import InvalidRequest
from rollout_bus.events.names import Keys
from rollout_bus.events.payload.base import (
    BatchDraft,
    PayloadBuffer,
    PayloadStore,
    Reference,
    check_ref,
    make_ref,
)
from rollout_bus.events.payload.file import FileStore
from rollout_bus.events.payload.memfd import MemfdStore
from rollout_bus.events.payload.redis import DEFAULT_CHUNK_BYTES, RedisStore
from rollout_bus.events.payload.shm import DEFAULT_ROOT, ShmStore

__all__ = ["BatchDraft", "FileStore", "MemfdStore", "PayloadBuffer", "PayloadStore", "RedisStore", "Reference",
           "ShmStore", "StoreSpec", "check_ref", "make_ref", "make_store"]

StoreKind = Literal["redis", "shm", "memfd", "file"]
_OPTIONS: dict[str, set[str]] = {"redis": {"chunk_kib", "window", "raw"}, "shm": {"pool_mib", "reads", "fallback"},
                                 "memfd": {"fallback"}, "file": set()}


@dataclass(frozen=True)
class StoreSpec:
    kind: StoreKind = "redis"
    path: str | None = None
    options: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> StoreSpec:
        head, _, query = text.strip().partition("?")
        kind, _, path = head.partition(":")
        if kind not in _OPTIONS:
            raise InvalidRequest(f"payload store {kind!r} is unknown: use redis, shm, shm:/dir, memfd or file:/dir")
        options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
        unknown = set(options) - _OPTIONS[kind]
        if unknown:
            raise InvalidRequest(f"payload store {kind!r} has no option {sorted(unknown)}; "
                                 f"it takes {sorted(_OPTIONS[kind]) or 'none'}")
        if kind == "file" and not path:
            raise InvalidRequest("the file store needs a directory: file:/path/shared/by/all/hosts")
        if kind in ("redis", "memfd") and path:
            if kind == "memfd":
                raise InvalidRequest("the memfd store takes no path: its segments live in no directory")
            raise InvalidRequest("the redis store takes no path; it uses the bus's REDIS_URL")
        return cls(cast(StoreKind, kind), path or None, options)

    def _int(self, name: str, default: int) -> int:
        value = self.options.get(name)
        if value is None:
            return default
        try:
            return int(value)
        except ValueError:
            raise InvalidRequest(f"payload store option {name}={value!r} is not an integer") from None


def make_store(spec: str | StoreSpec, client: redis.Redis, keys: Keys) -> PayloadStore:
    """The store a spec names; the redis store talks to the same server as ``client``."""
    s = StoreSpec.parse(spec) if isinstance(spec, str) else spec
    if s.kind == "redis":
        raw_opt = s.options.get("raw")
        raw = None if raw_opt is None else raw_opt.lower() not in ("0", "false", "no")
        chunk = s._int("chunk_kib", 0) << 10
        return RedisStore(client, keys, chunk_bytes=chunk or DEFAULT_CHUNK_BYTES, window=s._int("window", 2), raw=raw)
    if s.kind == "shm":
        reads = s.options.get("reads", "private")
        if reads not in ("private", "shared"):
            raise InvalidRequest(f"shm option reads={reads!r}: use reads=private (copy-on-write, the default) "
                                 "or reads=shared (tensors alias the segment)")
        fallback = s.options.get("fallback")
        if fallback not in (None, "redis"):
            raise InvalidRequest(f"shm option fallback={fallback!r}: the only fallback is redis "
                                 "(for batches whose readers are on another host)")
        store = ShmStore(keys, s.path or DEFAULT_ROOT, pool_bytes=s._int("pool_mib", 2048) << 20,
                         reads=cast(Literal["private", "shared"], reads))
        if fallback == "redis":
            store.fallback = RedisStore(client, keys)
        return store
    if s.kind == "memfd":
        fallback = s.options.get("fallback")
        if fallback not in (None, "redis"):
            raise InvalidRequest(f"memfd option fallback={fallback!r}: the only fallback is redis "
                                 "(for batches whose readers are on another host)")
        memfd = MemfdStore(keys)
        if fallback == "redis":
            memfd.fallback = RedisStore(client, keys)
        return memfd
    assert s.path is not None
    return FileStore(s.path, keys)
