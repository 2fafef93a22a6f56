"""The event-log file: a stream of msgpack records, written and read without holding it in memory.

A log file is one msgpack map per record, one after the other::

    {"kind": "header", "format": "rollout-bus-log", "format_version": 1, "namespace": ..,
     "created_ms": .., "ranges": [{"stream", "start", "end", "length", "groups"}, ..]}
    {"kind": "payload", "stream", "entry_id", "batch_id", "ref", "size", "sha256", "part", "parts", "data"}
    {"kind": "entry", "stream": "batches/p0", "id": "1700000000000-0", "fields": {b"e": b"..."}}
    ...
    {"kind": "end", "entries": {stream: n}, "payloads": n}

Streams are named by their *logical* name (``engines``, ``weights``, ``batches/<policy>``,
``dead-letters``...), never by their Redis key, so a log imports into any namespace.
Entries of all streams are written in one global order: by entry id, and within one
millisecond (all that ids of different streams can tell apart) each producer's events in
the order it made them, by their header's ``seq`` (``producer_order``). A batch's payload
bytes come *before* its ``BatchReady`` entry, cut in parts of at most ``PART_BYTES``, so a
reader that restores them has every payload in place before the entry that refers to it.
The ``end`` record tells a complete log from a truncated one. Nothing is pickled.

A log is untrusted input: ``LogReader`` reads records with bounded cost (``replay.records``:
each record's structure is walked before it is unpacked, within ``ReadLimits``) and checks
every field it uses, so a malformed or hostile file is a one-line ``DecodeError``, never
another exception or an allocation out of proportion to the file.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgpack

from rollout_bus.events.errors import DecodeError
from rollout_bus.events.names import BATCHES
from rollout_bus.events.schema import FIELD, MAX_EVENT_BYTES, BatchReady, Event, decode
from rollout_bus.replay.records import (
    PART_BYTES,
    OutOfData,
    ReadLimits,
    RecordReader,
    check_fields,
    check_id,
    typed,
)

log = logging.getLogger(__name__)

FORMAT = "rollout-bus-log"
FORMAT_VERSION = 1


# --- records --------------------------------------------------------------------------------

def id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def id_ms(entry_id: str) -> int:
    return id_key(entry_id)[0]


@dataclass(frozen=True)
class StreamRange:
    """One exported stream: the range asked for, its length at export and its groups then."""

    stream: str
    start: str = "-"
    end: str = "+"
    length: int = 0
    groups: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Header:
    namespace: str
    created_ms: int
    ranges: list[StreamRange]
    format_version: int = FORMAT_VERSION


@dataclass(frozen=True)
class LogEntry:
    """One stream entry, as stored: logical stream name, entry id, raw fields."""

    stream: str
    id: str
    fields: dict[bytes, bytes] = field(repr=False)

    @property
    def sort_key(self) -> tuple[int, int]:
        return id_key(self.id)


@dataclass(frozen=True)
class Payload:
    """The bytes a ``BatchReady`` entry refers to."""

    stream: str
    entry_id: str
    batch_id: str
    ref: dict[str, Any]
    data: bytes | memoryview = field(repr=False)


@dataclass(frozen=True)
class LogEvent:
    """A decoded entry."""

    stream: str
    id: str
    event: Event

    @property
    def ms(self) -> int:
        return id_ms(self.id)


Record = LogEntry | Payload


def decode_entries(entries: Iterable[LogEntry], *, skipped: list[LogEntry] | None = None) -> Iterator[LogEvent]:
    """The events among ``entries``; dead letters and undecodable entries are skipped (and collected)."""
    for entry in entries:
        if entry.stream == "dead-letters":
            continue
        try:
            event = decode(entry.fields)
        except DecodeError as exc:
            log.warning("skipping undecodable entry %s %s: %s", entry.stream, entry.id, exc.reason)
            if skipped is not None:
                skipped.append(entry)
            continue
        yield LogEvent(entry.stream, entry.id, event)


def producer_order(entries: Iterable[LogEntry]) -> Iterator[LogEntry]:
    """``entries`` (in entry-id order) with each millisecond's entries put in an exact order.

    Entry ids order entries of different streams only to the millisecond. Within one, the events
    of each producer go in its own order (``seq``, schema version 2); otherwise the order given
    is kept: at each step the earliest-given entry whose producer has no earlier event left
    goes next. Entries with no sequence number (dead letters, version 1 events) keep their place.
    """
    bucket: list[LogEntry] = []
    ms: int | None = None
    for entry in entries:
        entry_ms = id_ms(entry.id)
        if entry_ms != ms and bucket:
            yield from _in_producer_order(bucket)
            bucket = []
        ms = entry_ms
        bucket.append(entry)
    if bucket:
        yield from _in_producer_order(bucket)


def _sequence(entry: LogEntry) -> tuple[tuple[str, str], int] | None:
    """(producer, seq) of an entry's event header, or None when it has none (read without full decoding)."""
    raw = entry.fields.get(FIELD) if isinstance(entry.fields, dict) else None
    if not isinstance(raw, bytes | bytearray | memoryview) or len(raw) > MAX_EVENT_BYTES:
        return None
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_array_len=1024, max_map_len=1024)
        producer, seq = data["producer"], data["seq"]
        key = (str(producer["role"]), str(producer["instance"]))
    except Exception:
        return None
    return (key, seq) if isinstance(seq, int) and not isinstance(seq, bool) and seq > 0 else None


def _in_producer_order(bucket: list[LogEntry]) -> list[LogEntry]:
    if len(bucket) < 2:
        return bucket
    chains: dict[object, list[tuple[int, int]]] = {}  # producer -> [(seq, position)], earliest last
    for position, entry in enumerate(bucket):
        found = _sequence(entry)
        chain = chains.setdefault(found[0] if found else ("", position), [])
        chain.append((found[1] if found else 0, position))
    heads: list[tuple[int, object]] = []
    for producer, chain in chains.items():
        chain.sort(reverse=True)
        heads.append((chain[-1][1], producer))
    heapq.heapify(heads)
    out: list[LogEntry] = []
    while heads:
        position, producer = heapq.heappop(heads)
        out.append(bucket[position])
        chain = chains[producer]
        chain.pop()
        if chain:
            heapq.heappush(heads, (chain[-1][1], producer))
    return out


def only_entries(records: Iterable[Record]) -> Iterator[LogEntry]:
    return (r for r in records if isinstance(r, LogEntry))


# --- writing ----------------------------------------------------------------------------------

class LogWriter:
    """Writes a log file record by record; ``close`` writes the ``end`` record."""

    def __init__(self, out: IO[bytes], header: Header) -> None:
        self._out = out
        self._packer = msgpack.Packer(use_bin_type=True)
        self.entries: dict[str, int] = {}
        self.payloads = 0
        self._write({
            "kind": "header", "format": FORMAT, "format_version": header.format_version,
            "namespace": header.namespace, "created_ms": header.created_ms,
            "ranges": [{"stream": r.stream, "start": r.start, "end": r.end, "length": r.length,
                        "groups": r.groups} for r in header.ranges],
        })

    def _write(self, record: dict[str, Any]) -> None:
        self._out.write(self._packer.pack(record))

    def entry(self, entry: LogEntry) -> None:
        self._write({"kind": "entry", "stream": entry.stream, "id": entry.id, "fields": entry.fields})
        self.entries[entry.stream] = self.entries.get(entry.stream, 0) + 1

    def payload(self, payload: Payload) -> None:
        data = memoryview(payload.data)
        parts = max(1, -(-len(data) // PART_BYTES))
        digest = hashlib.sha256(data).hexdigest()
        for part in range(parts):
            self._write({
                "kind": "payload", "stream": payload.stream, "entry_id": payload.entry_id,
                "batch_id": payload.batch_id, "ref": payload.ref, "size": len(data), "sha256": digest,
                "part": part, "parts": parts, "data": data[part * PART_BYTES:(part + 1) * PART_BYTES],
            })
        self.payloads += 1

    def close(self) -> None:
        self._write({"kind": "end", "entries": self.entries, "payloads": self.payloads})
        self._out.flush()


# --- reading ----------------------------------------------------------------------------------

class LogReader:
    """Reads a log file lazily: ``header`` at once, then records in file order.

    A file without its ``end`` record raises ``DecodeError`` at the end of the iteration
    (a cut or still-growing file) unless ``allow_truncated``. Every malformed record, and any
    record beyond ``limits``, raises ``DecodeError`` naming the file and what is wrong.
    """

    def __init__(self, path: str | Path, *, allow_truncated: bool = False, limits: ReadLimits | None = None) -> None:
        self.path = Path(path)
        self.allow_truncated = allow_truncated
        self.limits = limits or ReadLimits()
        self.complete = False
        self.counts: dict[str, Any] = {}
        self._file = self.path.open("rb")
        self._records = RecordReader(self._file, self.limits)
        try:
            self.header = self._read_header()
        except BaseException:
            self._file.close()
            raise

    def _fail(self, reason: str) -> DecodeError:
        return DecodeError(f"{self.path}: {reason}")

    def _next(self) -> dict[str, Any] | None:
        try:
            record = self._records.next()
        except OutOfData:
            return None
        except DecodeError as exc:
            raise self._fail(exc.reason) from None
        if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
            raise self._fail("malformed record (not a map with a 'kind')")
        return record

    def _read_header(self) -> Header:
        first = self._next()
        if first is None or first.get("kind") != "header" or first.get("format") != FORMAT:
            raise self._fail(f"not a {FORMAT} file")
        if first.get("format_version") != FORMAT_VERSION:
            raise self._fail(f"format version {first.get('format_version')!r}, this reader knows {FORMAT_VERSION}")
        try:
            ranges = [self._range(r) for r in typed(first, "ranges", list, "header")]
            return Header(typed(first, "namespace", str, "header"), typed(first, "created_ms", int, "header"),
                          ranges, FORMAT_VERSION)
        except DecodeError as exc:
            raise self._fail(exc.reason) from None

    @staticmethod
    def _range(r: Any) -> StreamRange:
        where = "header range"
        if not isinstance(r, dict):
            raise DecodeError(f"{where} is not a map")
        groups = r.get("groups", [])
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise DecodeError(f"{where}: 'groups' must be a list of maps")
        for g in groups:
            typed(g, "name", str, "header group")
            if g.get("first_needed_id") is not None:
                check_id(g["first_needed_id"], "header group's first_needed_id")
        return StreamRange(typed(r, "stream", str, where), typed(r, "start", str, where), typed(r, "end", str, where),
                           typed(r, "length", int, where), groups)

    def __iter__(self) -> Iterator[Record]:
        parts = _Parts(self.limits)
        while (record := self._next()) is not None:
            kind = record["kind"]
            try:
                if kind == "entry":
                    yield LogEntry(typed(record, "stream", str, "entry"), check_id(typed(record, "id", str, "entry")),
                                   check_fields(record.get("fields"), "entry"))
                elif kind == "payload":
                    payload = parts.add(record)
                    if payload is not None:
                        yield payload
                elif kind == "end":
                    self.complete = True
                    self.counts = record
                    return
                else:
                    raise DecodeError(f"unknown record kind {kind!r}")
            except DecodeError as exc:
                raise self._fail(exc.reason) from None
        if not self.allow_truncated:
            raise self._fail("truncated log (no end record)")
        log.warning("%s: truncated log (no end record)", self.path)

    def entries(self) -> Iterator[LogEntry]:
        return only_entries(self)

    def events(self) -> Iterator[LogEvent]:
        return decode_entries(self.entries())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> LogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Parts:
    """The parts of one payload, checked as they come: the same payload, in order, within its size."""

    def __init__(self, limits: ReadLimits) -> None:
        self.limits = limits
        self.parts: list[bytes] = []
        self.first: dict[str, Any] = {}
        self.have = 0

    def add(self, record: dict[str, Any]) -> Payload | None:
        where = "payload part"
        stream, entry_id = typed(record, "stream", str, where), check_id(typed(record, "entry_id", str, where))
        batch_id, ref = typed(record, "batch_id", str, where), typed(record, "ref", dict, where)
        size, parts, part = (typed(record, k, int, where) for k in ("size", "parts", "part"))
        digest, data = typed(record, "sha256", str, where), typed(record, "data", bytes, where)
        if not 0 <= size <= self.limits.max_payload_bytes:
            raise DecodeError(f"payload of batch {batch_id!r} declares {size} bytes, outside [0, "
                              f"{self.limits.max_payload_bytes}]")
        if parts != max(1, -(-size // PART_BYTES)) or part != len(self.parts):
            raise DecodeError(f"payload of batch {batch_id!r}: part {part} of {parts} out of order "
                              f"or not the count its {size} bytes make")
        key = {"stream": stream, "entry_id": entry_id, "size": size, "sha256": digest}
        if self.parts and key != self.first:
            raise DecodeError(f"payload of batch {batch_id!r}: a part of another payload before the last one ended")
        self.have += len(data)
        if self.have > size:
            raise DecodeError(f"payload of batch {batch_id!r}: parts hold more than its {size} bytes")
        self.first = key
        self.parts.append(data)
        if len(self.parts) < parts:
            return None
        joined = b"".join(self.parts)
        self.parts, self.have = [], 0
        if len(joined) != size or hashlib.sha256(joined).hexdigest() != digest:
            raise DecodeError(f"payload of batch {batch_id} is corrupt")
        return Payload(stream, entry_id, batch_id, ref, joined)


def is_batch_ready(entry: LogEntry) -> BatchReady | None:
    """The ``BatchReady`` event of a batch-stream entry, or None."""
    if not entry.stream.startswith(BATCHES):
        return None
    try:
        event = decode(entry.fields)
    except DecodeError:
        return None
    return event if isinstance(event, BatchReady) else None
