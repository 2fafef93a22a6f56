"""Replay primitives: page through a stream from an id or a time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import redis

from events.connection import Guard, as_str


def id_at(ms: int) -> str:
    """The first possible stream id at wall-clock time ``ms``."""
    return f"{ms}-0"


def page(client: redis.Redis, stream: str, start: str = "-", end: str = "+", *, count: int = 500,
         guard: Guard | None = None) -> Iterator[tuple[str, dict[bytes, bytes]]]:
    """Every entry of ``stream`` from ``start`` (inclusive) to ``end``, fetched ``count`` at a time."""
    g = guard or Guard(client, name="replay")
    cursor = start
    while True:
        lo = cursor
        rows: list[Any] = g.call(lambda c: c.xrange(stream, min=lo, max=end, count=count))  # noqa: B023
        if not rows:
            return
        for entry_id, fields in rows:
            yield as_str(entry_id), fields
        cursor = "(" + as_str(rows[-1][0])
        if len(rows) < count:
            return


def page_since(client: redis.Redis, stream: str, since_ms: int, until_ms: int | None = None, *,
               count: int = 500, guard: Guard | None = None) -> Iterator[tuple[str, dict[bytes, bytes]]]:
    """Every entry added from ``since_ms`` through ``until_ms`` (inclusive, wall-clock ms)."""
    end = "+" if until_ms is None else f"{until_ms}-18446744073709551615"
    return page(client, stream, id_at(since_ms), end, count=count, guard=guard)
