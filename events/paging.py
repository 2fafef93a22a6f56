"""Reading streams back: page through a stream from an id or a time, find a namespace's streams."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import redis

from rollout_bus.events.connection import Guard, as_str
from rollout_bus.events.names import (
    REGISTRY_GENERATION,
    Keys,
    batch_stream_pattern,
    weight_stream_pattern,
    weight_stream_policy,
)


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


def discover_streams(client: redis.Redis, keys: Keys, *, guard: Guard | None = None) -> list[str]:
    """Every existing stream of the namespace: the fixed ones, then each policy's weight stream, then each
    policy's batch stream."""
    def run(c: redis.Redis) -> list[str]:
        found = [st for st in (*keys.event_streams(), keys.dead_letters) if c.exists(st)]
        batch = {as_str(raw) for raw in c.scan_iter(match=batch_stream_pattern(keys), count=1000, _type="stream")}
        for raw in c.hkeys(keys.policy_registry):
            if as_str(raw) == REGISTRY_GENERATION:  # the hash's write counter, not a policy
                continue
            candidate = keys.batch_stream(as_str(raw))
            if c.exists(candidate):
                batch.add(candidate)
        return found + _weight_streams(c, keys) + sorted(batch)
    return (guard or Guard(client, name="export")).call(run)


def weight_streams(client: redis.Redis, keys: Keys, *, legacy: bool = True,
                   guard: Guard | None = None) -> list[str]:
    """Every existing weight stream of the namespace, in name order: each policy's, found by SCAN (a policy
    whose trainer joined a minute ago has one as soon as it published), and the legacy stream first when it
    exists and ``legacy``."""
    def run(c: redis.Redis) -> list[str]:
        old = [keys.legacy_weight_stream] if legacy and c.exists(keys.legacy_weight_stream) else []
        return old + _weight_streams(c, keys)
    return (guard or Guard(client, name="weight streams")).call(run)


def _weight_streams(c: redis.Redis, keys: Keys) -> list[str]:
    found = {as_str(raw) for raw in c.scan_iter(match=weight_stream_pattern(keys), count=1000, _type="stream")}
    return sorted(s for s in found if weight_stream_policy(keys, s) is not None)  # a key named so by hand: not


class StreamEntry(NamedTuple):
    stream: str
    entry_id: str
    fields: dict[Any, Any]
    """The entry's fields; empty when the entry was trimmed while pending (Redis answers nil)."""


def stream_entries(reply: Any) -> list[StreamEntry]:
    """Every entry of an XREAD or XREADGROUP reply, whatever its shape.

    The one parser of stream replies: RESP2 (``[[stream, entries], ...]``) or RESP3
    (``{stream: entries}``), fields as redis-py's map or as the raw flat list of a packed
    command, nil fields (trimmed while pending) as an empty map.
    """
    if not reply:
        return []
    rows = reply.items() if isinstance(reply, dict) else reply
    out: list[StreamEntry] = []
    for stream, entries in rows:
        name = as_str(stream)
        for entry_id, fields in entries or ():
            out.append(StreamEntry(name, as_str(entry_id), _field_map(fields)))
    return out


def entries_of(reply: Any) -> list[tuple[Any, dict[Any, Any]]]:
    """``stream_entries`` for a consumer's hot path: (raw entry id, field map) of every entry, in order,
    without naming the stream (a consumer reads one) or decoding ids it decodes once itself."""
    if not reply:
        return []
    rows = reply.values() if isinstance(reply, dict) else [entries for _stream, entries in reply]
    return [(entry_id, _field_map(fields)) for entries in rows for entry_id, fields in entries or ()]


def _field_map(fields: Any) -> dict[Any, Any]:
    if not fields:
        return {}
    if isinstance(fields, dict):
        return fields
    if len(fields) == 2:
        return {fields[0]: fields[1]}
    return dict(zip(fields[::2], fields[1::2], strict=True))
