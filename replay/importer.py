"""Import a log file into a namespace of any Redis, keeping order and, where possible, entry ids.

Each stream keeps the original entry ids when it is missing or its last id is older than
the first imported entry (XADD with explicit ids). A stream that already holds the log's
first entry (an earlier import was cut short) is resumed: entries it holds are skipped.
Otherwise its entries get new ids (``*``), in the same order, and a warning says so. Payloads are restored through a
``PayloadSink`` *before* the entry that refers to them; when the sink stores them under
a new reference, the ``BatchReady`` entry is re-encoded with it (same event id and time),
so every imported reference resolves. Consumer groups can be recreated where each one
stood at export (its first unacknowledged entry), so a trainer resumes where it was.

An id is kept only if it is no later than the target server's clock (plus ``FUTURE_ALLOWANCE_MS``).
A genuine export holds ids Redis made before the export, so a later one is forged or comes from a
server whose clock ran ahead; kept, it would move the stream's last id into the future, and the
greatest id (``18446744073709551615-18446744073709551615``) would make every later XADD on the
stream fail. Such an entry and the rest of its stream get new ids (remapped, not refused: the
events are kept, in order, and their groups start early enough to get each of them).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rollout_bus.events.connection import Guard, Redis, as_str
from rollout_bus.events.consume import register_group
from rollout_bus.events.errors import DecodeError, RedisCommandError
from rollout_bus.events.names import Keys, stream_key
from rollout_bus.events.schema import BatchReady, decode, encode
from rollout_bus.replay.logfile import Header, LogEntry, LogReader, Payload, id_key, is_batch_ready

log = logging.getLogger(__name__)
_FLUSH_EVERY = 256
FUTURE_ALLOWANCE_MS = 5 * 60 * 1000
"""How far ahead of the target server's clock an imported id may be and still be kept (clock skew)."""


class PayloadSink(Protocol):
    """Stores a batch's bytes in the target namespace; returns the reference that resolves there."""

    def write(self, event: BatchReady, data: bytes | memoryview) -> dict[str, Any]: ...


@dataclass
class ImportStats:
    entries: dict[str, int] = field(default_factory=dict)
    ids_preserved: dict[str, bool] = field(default_factory=dict)
    payloads: int = 0
    rewritten_refs: int = 0
    skipped: int = 0
    groups: list[str] = field(default_factory=list)


def _last_id(client: Redis, stream: str) -> tuple[int, int] | None:
    if not client.exists(stream):
        return None
    info = client.xinfo_stream(stream)
    return id_key(as_str(info["last-generated-id"]))


def _equal_fields(stored: Any, fields: dict[bytes, bytes]) -> bool:
    """The same entry: the same fields, or the same event (a BatchReady may carry a rewritten reference)."""
    if stored == fields:
        return True
    try:
        return decode(stored).event_id == decode(fields).event_id
    except DecodeError:
        return False


def before(entry_id: str) -> str:
    """The greatest id smaller than ``entry_id`` (``0-0`` for the first possible one)."""
    ms, seq = id_key(entry_id)
    if seq > 0:
        return f"{ms}-{seq - 1}"
    return f"{ms - 1}-18446744073709551615" if ms > 0 else "0-0"


class Importer:
    """Writes a log's records into ``keys``' namespace; ``run`` drives it from a reader."""

    def __init__(self, client: Redis, keys: Keys, *, payloads: PayloadSink | None = None,
                 streams: Sequence[str] | None = None, guard: Guard | None = None) -> None:
        self.client = client
        self.keys = keys
        self.payloads = payloads
        self.only = set(streams) if streams is not None else None
        self.guard = guard or Guard(client, name="import")
        self.stats = ImportStats()
        self._pending: dict[tuple[str, str], Payload] = {}
        self._group_start: dict[str, str] = {}
        self._mode: dict[str, str] = {}
        self._last: dict[str, tuple[int, int]] = {}
        self._groups_done: set[str] = set()
        self._queue: list[tuple[str, dict[bytes, bytes], str, LogEntry]] = []
        self._now_ms: int | None = None
        self._kept_last: dict[str, str] = {}
        self._remapped_after: dict[str, str] = {}

    def run(self, reader: LogReader, *, restore_groups: bool = False) -> ImportStats:
        if restore_groups:  # groups of streams that do not exist yet: before the entries, so payloads get readers
            self.restore_groups(reader.header, only_missing=True)
        for record in reader:
            if self.only is not None and record.stream not in self.only:
                continue
            if isinstance(record, Payload):
                self._pending[(record.stream, record.entry_id)] = record
            else:
                self.add(record)
        self.flush()
        if restore_groups:
            self.restore_groups(reader.header)
        return self.stats

    def add(self, entry: LogEntry) -> None:
        target = stream_key(self.keys, entry.stream)
        mode = self._mode.get(entry.stream) or self._decide(entry, target)
        if mode == "resume":
            if entry.sort_key <= self._last[entry.stream]:
                if self._holds(target, entry):  # imported by an earlier, interrupted run
                    self._pending.pop((entry.stream, entry.id), None)
                    self.stats.skipped += 1
                    return
                log.warning("%s holds other entries than the log at %s: the rest get new ids", target, entry.id)
                mode = self._set_mode(entry.stream, "new")
            else:
                mode = self._set_mode(entry.stream, "preserve")
        if mode == "preserve" and entry.sort_key[0] > self._server_ms() + FUTURE_ALLOWANCE_MS:
            log.warning("%s: entry id %s is ahead of this server's clock: it and the rest of the stream get new ids",
                        target, entry.id)
            self._remapped_after[entry.stream] = self._kept_last.get(entry.stream, "0-0")
            mode = self._set_mode(entry.stream, "new")
        if mode == "preserve":
            self._kept_last[entry.stream] = entry.id
        fields = self._restore_payload(entry)
        self._queue.append((target, fields, entry.id if mode == "preserve" else "*", entry))
        self.stats.entries[entry.stream] = self.stats.entries.get(entry.stream, 0) + 1
        if len(self._queue) >= _FLUSH_EVERY:
            self.flush()

    def _decide(self, entry: LogEntry, target: str) -> str:
        """Keep ids on a missing or older stream, resume one an earlier import began, else new ids."""
        self.flush()
        last = self.guard.call(lambda c: _last_id(c, target))
        if last is None or last < entry.sort_key:
            return self._set_mode(entry.stream, "preserve")
        self._last[entry.stream] = last
        if self._holds(target, entry):
            return self._set_mode(entry.stream, "resume")
        log.warning("%s already holds entries up to %s-%s: imported entries get new ids", target, *last)
        self._group_start[entry.stream] = f"{last[0]}-{last[1]}"
        return self._set_mode(entry.stream, "new")

    def _server_ms(self) -> int:
        if self._now_ms is None:
            sec, usec = self.guard.call(lambda c: c.time())
            self._now_ms = int(sec) * 1000 + int(usec) // 1000
        return self._now_ms

    def _set_mode(self, stream: str, mode: str) -> str:
        self._mode[stream] = mode
        self.stats.ids_preserved[stream] = mode != "new" and self.stats.ids_preserved.get(stream, True)
        return mode

    def _holds(self, target: str, entry: LogEntry) -> bool:
        self.flush()
        return self.guard.call(lambda c: self._holds_on(c, target, entry))

    def flush(self) -> None:
        """Send the queued XADDs in one pipeline.

        The pipeline is rebuilt on each try, so a reconnect resends it; an explicit id that a
        lost reply had already added is recognised (the same entry is there) and not an error.
        """
        if not self._queue:
            return
        queue, self._queue = self._queue, []

        def send(c: Redis) -> None:
            pipe = c.pipeline(transaction=False)
            for target, fields, entry_id, _ in queue:
                pipe.xadd(target, fields, id=entry_id)  # type: ignore[arg-type]
            for (target, _, entry_id, entry), result in zip(queue, pipe.execute(raise_on_error=False), strict=True):
                if isinstance(result, Exception) and not (entry_id != "*" and self._holds_on(c, target, entry)):
                    raise result
        self.guard.call(send)

    @staticmethod
    def _holds_on(c: Redis, target: str, entry: LogEntry) -> bool:
        rows: list[Any] = c.xrange(target, min=entry.id, max=entry.id, count=1) or []
        return bool(rows) and as_str(rows[0][0]) == entry.id and _equal_fields(rows[0][1], entry.fields)

    def _restore_payload(self, entry: LogEntry) -> dict[bytes, bytes]:
        payload = self._pending.pop((entry.stream, entry.id), None)
        if payload is None or self.payloads is None:
            return entry.fields
        event = is_batch_ready(entry)
        if event is None:
            return entry.fields
        ref = self.payloads.write(event, payload.data)
        self.stats.payloads += 1
        if ref == event.payload:
            return entry.fields
        self.stats.rewritten_refs += 1
        return encode(dataclasses.replace(event, payload=ref))

    def restore_groups(self, header: Header, *, only_missing: bool = False) -> None:
        """Create each exported group at its first unacknowledged entry.

        Where the stream's entries got new ids, the group starts before the first imported
        entry instead, so it gets every imported entry again (at least once, never skipped).
        ``only_missing`` restores only the groups of streams the target does not have yet.
        """
        for rng in header.ranges:
            if rng.stream in self._groups_done or (self.only is not None and rng.stream not in self.only):
                continue
            target = stream_key(self.keys, rng.stream)
            if only_missing and self._exists(target):
                continue
            for group in rng.groups:
                start = self._group_start.get(rng.stream)
                if start is None:
                    first = group.get("first_needed_id")
                    start = before(first) if isinstance(first, str) else "0"
                    remapped = self._remapped_after.get(rng.stream)
                    if remapped is not None and id_key(remapped) < id_key(start):
                        start = remapped  # before the first entry that got a new id
                self._create_group(target, group["name"], start)
            self._groups_done.add(rng.stream)

    def _exists(self, stream: str) -> bool:
        return bool(self.guard.call(lambda c: c.exists(stream)))

    def _create_group(self, stream: str, name: str, start: str) -> None:
        def create(c: Redis) -> None:
            if not register_group(c, self.keys, stream, name, start):
                log.warning("group %s already exists on %s: left as it is", name, stream)
        try:
            self.guard.call(create)
        except RedisCommandError:
            log.exception("could not recreate group %s on %s", name, stream)
            raise
        self.stats.groups.append(f"{stream}/{name}@{start}")


def import_log(client: Redis, keys: Keys, path: str | Path, *, payloads: PayloadSink | None = None,
               streams: Sequence[str] | None = None, restore_groups: bool = False,
               allow_truncated: bool = False, guard: Guard | None = None) -> ImportStats:
    """Import the log at ``path`` into ``keys``' namespace; ``streams`` limits it to those logical names."""
    with LogReader(path, allow_truncated=allow_truncated) as reader:
        return Importer(client, keys, payloads=payloads, streams=streams, guard=guard).run(
            reader, restore_groups=restore_groups)
