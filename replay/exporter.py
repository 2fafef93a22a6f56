"""Export a namespace's streams (by id or by time) to a log file, sample batches included.

Entries of all streams are merged into one order by entry id (one server clock) and
written as they are paged from Redis; nothing is held in memory beyond one page per
stream, one millisecond of entries and one payload. For every ``BatchReady`` the payload
bytes are fetched through a ``PayloadSource`` and written just before the entry.

Ids order entries of different streams only to the millisecond (the sequence part counts
per stream). Within one millisecond each producer's events go in the order it made them
(their ``seq``, ``logfile.producer_order``); what no producer orders is taken by the ids'
sequence part, and entries with the same id on several streams stream by stream in
``discover_streams`` order, which is the same live and after an import.

A batch's payload lives only until its last reader releases it (``events.batches``): once
the trainer has acked a batch its bytes are gone. To export a run with its batches, call
``hold_payloads`` before the run, which registers a group on each policy's batch stream that
never reads, so every payload stays until its TTL or ``delete_expired`` (and retention keeps the
entries). ``release_payloads`` lets them go.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from rollout_bus.events.connection import Guard, Redis, as_str
from rollout_bus.events.consume import register_group
from rollout_bus.events.errors import DecodeError, PayloadMissing
from rollout_bus.events.names import BATCHES, Keys, check_name, logical_stream, stream_key
from rollout_bus.events.paging import discover_streams, page
from rollout_bus.events.retention import first_needed
from rollout_bus.events.schema import BatchReady
from rollout_bus.replay.logfile import (
    Header,
    LogEntry,
    LogWriter,
    Payload,
    StreamRange,
    is_batch_ready,
    producer_order,
)

log = logging.getLogger(__name__)


class PayloadSource(Protocol):
    """Reads the payload bytes a ``BatchReady`` refers to (raises ``PayloadMissing`` when gone)."""

    def read(self, event: BatchReady) -> bytes | memoryview: ...


@dataclass(frozen=True)
class Range:
    """An id range; ``by_time`` builds one from wall-clock milliseconds (the entry ids' clock)."""

    start: str = "-"
    end: str = "+"

    @classmethod
    def by_time(cls, since_ms: int | None = None, until_ms: int | None = None) -> Range:
        return cls("-" if since_ms is None else f"{since_ms}-0",
                   "+" if until_ms is None else f"{until_ms}-18446744073709551615")


@dataclass
class ExportStats:
    entries: dict[str, int] = field(default_factory=dict)
    payloads: int = 0
    payload_bytes: int = 0
    missing_payloads: list[str] = field(default_factory=list)


def _group_info(c: Redis, stream: str, info: dict[Any, Any]) -> dict[str, Any]:
    lag, read = info.get("lag"), info.get("entries-read")
    return {
        "name": as_str(info["name"]), "consumers": int(info["consumers"]), "pending": int(info["pending"]),
        "last_delivered_id": as_str(info["last-delivered-id"]),
        "first_needed_id": str(first_needed(c, stream, info)), "entries_read": None if read is None else int(read),
        "lag": None if lag is None else int(lag),
    }


def group_infos(client: Redis, stream: str, *, guard: Guard | None = None) -> list[dict[str, Any]]:
    """XINFO GROUPS of ``stream`` as plain JSON-able dicts, with each group's first unacked entry."""
    def run(c: Redis) -> list[dict[str, Any]]:
        if not c.exists(stream):
            return []
        return [_group_info(c, stream, info) for info in c.xinfo_groups(stream)]
    return (guard or Guard(client, name="export")).call(run)


def _range_of(client: Redis, keys: Keys, stream: str, rng: Range, guard: Guard) -> StreamRange:
    length = int(guard.call(lambda c: c.xlen(stream)))
    return StreamRange(logical_stream(keys, stream), rng.start, rng.end, length,
                       group_infos(client, stream, guard=guard))


def _stream_entries(client: Redis, keys: Keys, stream: str, rng: Range, guard: Guard,
                    count: int) -> Iterator[tuple[tuple[int, int], LogEntry]]:
    logical = logical_stream(keys, stream)
    for entry_id, fields in page(client, stream, rng.start, rng.end, count=count, guard=guard):
        entry = LogEntry(logical, entry_id, fields)
        yield entry.sort_key, entry


def read_live(client: Redis, keys: Keys, streams: Sequence[str] | None = None, rng: Range | None = None,
              *, count: int = 500, guard: Guard | None = None) -> Iterator[LogEntry]:
    """Every entry of ``streams`` (default: all of the namespace) in ``rng``, merged in entry-id order and,
    within a millisecond, in each producer's own order (``logfile.producer_order``)."""
    g = guard or Guard(client, name="export")
    chosen = list(streams) if streams is not None else discover_streams(client, keys, guard=g)
    r = rng or Range()
    merged = heapq.merge(*(_stream_entries(client, keys, s, r, g, count) for s in chosen), key=lambda t: t[0])
    yield from producer_order(entry for _, entry in merged)


def export_log(client: Redis, keys: Keys, out: str | Path | IO[bytes], *,
               streams: Sequence[str] | None = None, rng: Range | None = None,
               payloads: PayloadSource | None = None, count: int = 500,
               guard: Guard | None = None) -> ExportStats:
    """Write the entries of ``streams`` in ``rng`` (default: everything) to ``out``.

    ``streams`` are Redis keys of the namespace (see ``stream_key`` for logical names).
    Without ``payloads`` no batch bytes are written (a metadata-only log). A payload that
    is gone is logged and listed in the stats; the entry is still written.
    """
    g = guard or Guard(client, name="export")
    chosen = list(streams) if streams is not None else discover_streams(client, keys, guard=g)
    r = rng or Range()
    ranges = [_range_of(client, keys, st, r, g) for st in chosen]
    header = Header(keys.namespace, time.time_ns() // 1_000_000, ranges)
    if isinstance(out, str | Path):
        with Path(out).open("wb") as fh:
            return _write(client, keys, fh, header, chosen, r, payloads, count, g)
    return _write(client, keys, out, header, chosen, r, payloads, count, g)


def _write(client: Redis, keys: Keys, fh: IO[bytes], header: Header, streams: list[str], rng: Range,
           payloads: PayloadSource | None, count: int, guard: Guard) -> ExportStats:
    writer = LogWriter(fh, header)
    stats = ExportStats()
    for entry in read_live(client, keys, streams, rng, count=count, guard=guard):
        event = is_batch_ready(entry) if payloads is not None and entry.stream.startswith(BATCHES) else None
        if event is not None and payloads is not None:
            try:
                data = payloads.read(event)
            except PayloadMissing as exc:
                log.warning("batch %s (%s %s): payload missing: %s", event.batch_id, entry.stream, entry.id, exc)
                stats.missing_payloads.append(event.batch_id)
            else:
                writer.payload(Payload(entry.stream, entry.id, event.batch_id, event.payload, data))
                stats.payloads += 1
                stats.payload_bytes += memoryview(data).nbytes
        writer.entry(entry)
    writer.close()
    stats.entries = dict(writer.entries)
    return stats


HOLD_GROUP = "log-export"


def hold_payloads(client: Redis, keys: Keys, policies: Sequence[str], *, group: str = HOLD_GROUP,
                  guard: Guard | None = None) -> None:
    """Register ``group`` on each policy's batch stream (created if missing) as a reader that never reads.

    Batches published from then on keep their payloads (until their TTL or ``delete_expired``), so a later
    ``export_log`` can write them; call it before the run.
    """
    check_name("group", group)

    def run(c: Redis) -> None:
        for policy in policies:
            register_group(c, keys, keys.batch_stream(policy), group, "$")
    (guard or Guard(client, name="export")).call(run)


def release_payloads(client: Redis, keys: Keys, policies: Sequence[str], *, group: str = HOLD_GROUP,
                     guard: Guard | None = None) -> int:
    """Undo ``hold_payloads``: release every payload ``group`` holds and drop the group; returns how many
    payloads were deleted (those no other group still needed)."""
    from rollout_bus.events.batches import BatchChannel

    g = guard or Guard(client, name="export")
    channel = BatchChannel(client, keys, guard=g)
    deleted = 0
    try:
        for policy in policies:
            stream = keys.batch_stream(policy)

            def unregister(c: Redis, st: str = stream) -> None:
                c.srem(keys.registered_groups(st), group)

            def destroy(c: Redis, st: str = stream) -> None:
                if c.exists(st):
                    c.xgroup_destroy(st, group)
            g.call(unregister)
            for _, fields in page(client, stream, guard=g):
                event = is_batch_ready(LogEntry(BATCHES + policy, "0-0", fields))
                if event is not None and group in channel.readers(str(event.payload.get("ref"))):
                    try:
                        deleted += bool(channel.release(event, group))
                    except DecodeError as exc:  # an event pointing at another batch's payload: never released
                        log.warning("batch %s of %s: %s", event.batch_id, policy, exc.reason)
            g.call(destroy)
    finally:
        channel.close()
    return deleted


def resolve_streams(keys: Keys, names: Sequence[str]) -> list[str]:
    """Redis keys for logical stream names (``engines``, ``batches/p0``...)."""
    return [stream_key(keys, n) for n in names]
