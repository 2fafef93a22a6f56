"""Retention that never drops an entry a registered group has not acked.

Redis 7 trims streams regardless of consumer groups, so the safe trim point is
computed here: the oldest of (each group's oldest pending entry, each group's first
undelivered entry), and a registered group that does not exist yet keeps everything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis

from rollout_bus.events.connection import Guard
from rollout_bus.events.names import Keys


@dataclass(frozen=True, order=True)
class StreamId:
    ms: int
    seq: int

    @classmethod
    def parse(cls, value: bytes | str) -> StreamId:
        text = value.decode() if isinstance(value, bytes) else value
        ms, _, seq = text.partition("-")
        return cls(int(ms), int(seq or 0))

    def next(self) -> StreamId:
        return StreamId(self.ms, self.seq + 1)

    def __str__(self) -> str:
        return f"{self.ms}-{self.seq}"


def safe_trim_point(client: redis.Redis, keys: Keys, stream: str) -> StreamId | None:
    """The lowest id some registered group still needs, or None when nothing is needed."""
    groups = client.xinfo_groups(stream)
    existing = {g["name"].decode() if isinstance(g["name"], bytes) else g["name"]: g for g in groups}
    registered = {m.decode() for m in client.smembers(keys.registered_groups(stream))}  # type: ignore[union-attr]
    if registered - set(existing):
        return StreamId(0, 0)
    point: StreamId | None = None
    for info in existing.values():
        need = first_needed(client, stream, info)
        point = need if point is None else min(point, need)
    return point


def first_needed(client: redis.Redis, stream: str, info: dict[Any, Any]) -> StreamId:
    """The first entry a group (its ``XINFO GROUPS`` row) still needs: its oldest pending one, else the
    one after its last delivered."""
    need = StreamId.parse(info["last-delivered-id"]).next()
    if int(info["pending"]) > 0:
        need = min(need, StreamId.parse(client.xpending(stream, info["name"])["min"]))
    return need


def trim(client: redis.Redis, keys: Keys, stream: str, *, max_len: int | None = None,
         max_age_ms: int | None = None, guard: Guard | None = None) -> int:
    """Trim ``stream`` by length and/or age, never past what a registered group still needs.

    Returns the number of entries removed.
    """
    g = guard or Guard(client, name="retention")

    def run(c: Any) -> int:
        target: StreamId | None = None
        if max_age_ms is not None:
            target = StreamId(time.time_ns() // 1_000_000 - max_age_ms, 0)
        length = c.xlen(stream) if max_len is not None else 0
        if max_len is not None and length > max_len:
            if max_len == 0:
                last = c.xrevrange(stream, count=1)
                by_len = StreamId.parse(last[0][0]).next()
            elif length - max_len <= max_len:  # find the first entry kept from whichever end is nearer
                first_kept = c.xrange(stream, count=length - max_len + 1)[-1]
                by_len = StreamId.parse(first_kept[0])
            else:
                keep = c.xrevrange(stream, count=max_len)
                by_len = StreamId.parse(keep[-1][0])
            target = by_len if target is None else max(target, by_len)
        if target is None or not c.exists(stream):
            return 0
        safe = safe_trim_point(c, keys, stream)
        if safe is not None:
            target = min(target, safe)
        return int(c.xtrim(stream, minid=str(target), approximate=False))
    return g.call(run)
