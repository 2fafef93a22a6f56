"""Consumer groups: blocking reads, acks, reclaiming idle entries, dead letters.

A ``Consumer`` has a stable name (host + role + index), so a restart first re-reads
its own pending entries, then takes over entries other consumers left idle for
``claim_idle_ms`` (XAUTOCLAIM), then reads new ones. An entry whose fields cannot be
decoded is dead-lettered at once; an entry delivered more than ``max_deliveries``
times is dead-lettered with that reason; either way it is acked, so it never blocks
the entries behind it and never crashes the consumer.

A consumer that holds entries for a while before acking them (a trainer's buffer) keeps
them from being reclaimed with ``touch``. Each group's registration is kept alive by a heartbeat
thread of the consumer (every quarter of ``group_ttl_s`` in ``keys.group_beats``, whether it reads
or is busy: ``events.groups.Heartbeat``) until ``close``; the janitor expires a registration only
when its owner is known dead (beats lapsed and no consumer of the group touched the stream within
the TTL: ``events.janitor``), so a reader that left does not pin every later entry and payload. A
reader that never reads but must keep entries (a payload hold for export) registers with
``register_group`` alone and has no beat to lapse.

A consumer whose group vanished (the janitor expired it while the process was paused) never
resumes at ``$``: it recreates the group after the last entry it acked (it tracks what it holds
and acks) or where the janitor recorded the group stood, whichever is earlier, and reports any
entries removed from the stream meanwhile (log, ``rollout_bus_consumer_group_gaps_total``, a note
on the dead-letter stream).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis
from prometheus_client import Counter

from rollout_bus.events.connection import Guard, Lane, as_str, is_busygroup, pack, raise_errors
from rollout_bus.events.errors import DecodeError, RedisCommandError
from rollout_bus.events.groups import (
    BEAT,
    Heartbeat,
    earliest,
    expired_record,
    heartbeat_guard,
    id_before,
    lost_after,
    parse_id,
)
from rollout_bus.events.leased import LeaseFence, guarded, leased
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import entries_of, stream_entries
from rollout_bus.events.schema import Event, decode

log = logging.getLogger(__name__)
GROUP_RECREATED = Counter("rollout_bus_consumer_group_recreated", "Consumer groups found gone and recreated at the "
                          "consumer's last known position", ["stream", "group"])
GROUP_GAPS = Counter("rollout_bus_consumer_group_gaps", "Recreated groups whose stream lost entries meanwhile "
                     "(reported on the dead-letter stream)", ["stream", "group"])


def stable_consumer_name(role: str, index: int = 0) -> str:
    return f"{socket.gethostname()}-{role}-{index}"


@dataclass
class ConsumerConfig:
    """``block_ms``: how long a read waits for new entries; 0 returns at once (not Redis' wait forever)."""

    block_ms: int = 1000
    count: int = 32
    claim_idle_ms: int = 30_000
    claim_every_ms: int = 1_000
    max_deliveries: int = 5
    start_id: str = "0"
    auto_ack: bool = True
    group_ttl_s: float | None = 900.0
    """The group's registration lapses when none of its consumers beat (a thread of each, until ``close``)
    or touched the stream for this long; None: it never does."""


@dataclass
class Message:
    stream: str
    id: str
    event: Event
    deliveries: int
    fields: dict[bytes, bytes] = field(repr=False)


Handler = Callable[[Message], Any]


class Consumer:
    """One named consumer in one group of one stream."""

    def __init__(self, client: redis.Redis, keys: Keys, stream: str, group: str, name: str,
                 config: ConsumerConfig | None = None, *, guard: Guard | None = None,
                 decoder: Callable[[Any], Event] = decode) -> None:
        self.client = client
        self.keys = keys
        self.stream = stream
        self.group = group
        self.name = name
        self.config = config or ConsumerConfig()
        self.guard = guard or Guard(client, name=f"consumer {group}/{name}")
        self.decoder = decoder
        self._lane = Lane(client)  # reads and acks go out packed on a kept connection
        self._recovering = True
        self._recover_from = "0"
        self._outages_seen = self.guard.outages
        self._last_claim = 0.0
        self._claim_cursor = "0-0"
        self._group_ready = False
        self._unacked: list[str] = []  # handled in run(): acked together with the next read
        self._packed_reads: dict[tuple[str, int, int | None], bytes] = {}
        self._beat_due = 0.0
        self._beat = client.register_script(BEAT)
        self._leased_ack: Any = None  # XACK bound to a lease (``ack(lease=...)``), registered on first use
        self._leased_dead_letter: Any = None
        self._heartbeat: Heartbeat | None = None
        self._group_lost = False
        self._held: set[str] = set()  # delivered to us and not acked yet
        self._acked_max: str | None = None  # the newest entry acked (or the group's position when joined)
        self.dead_lettered = 0
        self.recreated = 0

    # --- group management -------------------------------------------------------------
    def ensure_group(self) -> None:
        """Create the group (idempotent) and register it as a reader the stream must keep entries for.

        A group that vanished is created again after the last entry known handled (see the module
        docstring), never at ``start_id``; ``start_id`` applies only to a group that never existed.
        """
        lost = self._group_lost
        self.guard.call(lambda c: self._create(c, lost))
        self._group_lost = False
        self._group_ready = True
        self._beat_due = 0.0
        self.beat()
        ttl = self.config.group_ttl_s
        if ttl is not None and (self._heartbeat is None or not self._heartbeat.alive):
            period = ttl / 4
            name = f"{self.group}/{self.name}"
            self._heartbeat = Heartbeat(self, Consumer._send_beat, period, name).start(
                heartbeat_guard(self.client, name, period))

    def _create(self, c: redis.Redis, lost: bool) -> None:
        record = expired_record(c, self.keys, self.stream, self.group)
        mine = self._resume_point() if lost else None
        after = earliest(record["resume_after"] if record else None, mine)
        created = register_group(c, self.keys, self.stream, self.group, after or self.config.start_id)
        if record is not None:
            c.hdel(self.keys.expired_groups(self.stream), self.group)
        if created and after is not None:
            counted = record is not None and record["resume_after"] == after
            entries_read = record.get("entries_read") if counted and record else None
            self._report_recreated(c, after, "expired by the janitor" if record else "gone",
                                   entries_read if isinstance(entries_read, int) else None)
        if self._acked_max is None:  # where the group stands as we join: what a vanished group resumes from
            info = next((g for g in c.xinfo_groups(self.stream) if as_str(g["name"]) == self.group), None)
            if info is not None:
                self._acked_max = as_str(info["last-delivered-id"])

    def _resume_point(self) -> str | None:
        """After the last entry this consumer handled: before the oldest it holds, else its newest ack."""
        if self._held:
            return id_before(min(self._held, key=parse_id))
        return self._acked_max

    def _report_recreated(self, c: redis.Redis, after: str, why: str, entries_read: int | None) -> None:
        self.recreated += 1
        GROUP_RECREATED.labels(self.stream, self.group).inc()
        lost = lost_after(c, self.stream, after, entries_read)
        if lost is None:
            log.warning("group %s of %s was %s: recreated after %s; every later entry is delivered",
                        self.group, self.stream, why, after)
            return
        reason = (f"group {self.group} was {why}: recreated after {after}, but {lost.describe()} were removed "
                  "from the stream meanwhile and are not delivered")
        log.error("%s (noted on %s)", reason, self.keys.dead_letters)
        GROUP_GAPS.labels(self.stream, self.group).inc()
        note = dead_letter_fields(self.stream, self.group, self.name, after, {}, reason, 0)
        c.xadd(self.keys.dead_letters, note)  # type: ignore[arg-type]

    def beat(self) -> None:
        """Tell the janitor this group still has a live consumer (at most every quarter of ``group_ttl_s``)."""
        ttl = self.config.group_ttl_s
        now = time.monotonic()
        if ttl is None or now < self._beat_due:
            return
        self._send_beat(self.guard)
        self._beat_due = now + ttl / 4

    def _send_beat(self, guard: Guard) -> None:
        ttl = self.config.group_ttl_s
        if ttl is not None:
            script_keys = [self.keys.group_beats(self.stream), self.keys.group_ttls(self.stream)]
            guard.call(lambda c: self._beat(keys=script_keys, args=[self.group, int(ttl * 1000)], client=c))

    def close(self) -> None:
        """Stop beating: the group lapses ``group_ttl_s`` after its last consumer closed (or stopped reading)."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    def _lose_group(self, exc: BaseException) -> None:
        log.warning("group %s on %s is gone (%s); recreating it after the last entry handled", self.group,
                    self.stream, exc)
        self._group_ready = False
        self._group_lost = True
        self._recovering = True
        self._recover_from = "0"

    def _acked(self, ids: list[str] | tuple[str, ...]) -> None:
        if not ids:
            return
        self._held.difference_update(ids)
        newest = max(ids, key=parse_id)
        if self._acked_max is None or parse_id(newest) > parse_id(self._acked_max):
            self._acked_max = newest

    def touch(self, *ids: str) -> None:
        """Reset the idle time of entries this consumer holds, so that no claim takes them (nor counts a
        delivery): ``XCLAIM ... JUSTID`` to ourselves."""
        if ids:
            try:
                self.guard.call(lambda c: c.xclaim(self.stream, self.group, self.name, min_idle_time=0,
                                                   message_ids=list(ids), justid=True))
            except RedisCommandError as exc:
                if not _group_gone(exc):
                    raise
                self._lose_group(exc)

    # --- reading ----------------------------------------------------------------------
    def read(self, block_ms: int | None = None, count: int | None = None) -> list[Message]:
        """The next entries for this consumer: own pending first, then idle ones of others, then new."""
        if not self._group_ready:
            self.ensure_group()
        self.beat()
        count = count or self.config.count
        try:
            return self._read(block_ms if block_ms is not None else self.config.block_ms, count)
        except RedisCommandError as exc:
            if _group_gone(exc):
                self._lose_group(exc)
                return []
            raise

    def _read(self, block_ms: int, count: int) -> list[Message]:
        if self.guard.outages != self._outages_seen:
            # a read whose reply died with the connection left its entries pending to us, unseen
            self._outages_seen = self.guard.outages
            self._recovering = True
            self._recover_from = "0"
        if self._recovering:
            # page through our own pending list once: entries handed out but not yet acked
            # (a consumer that acks after long work) are not handed out again
            raw = self._xreadgroup(self._recover_from, count, None)
            if raw:
                self._recover_from = as_str(raw[-1][0])
                return self._accept(raw, pending=True)
            self._recovering = False
            self._recover_from = "0"
        now = time.monotonic()
        if (now - self._last_claim) * 1000 >= self.config.claim_every_ms:
            self._last_claim = now
            claimed = self._autoclaim(count)
            if claimed:
                return self._accept(claimed, pending=True)
        raw = self._xreadgroup(">", count, block_ms)
        return self._accept(raw, pending=False)

    def _xreadgroup(self, start: str, count: int, block_ms: int | None) -> list[tuple[Any, Any]]:
        block = block_ms if block_ms else None  # BLOCK 0 would wait forever and never see a stop request
        if self._lane.direct:
            return self._xreadgroup_direct(start, count, block)
        reply = self._call_with_acks(lambda c: c.xreadgroup(
            self.group, self.name, {self.stream: start}, count=count, block=block))
        return [(e.entry_id, e.fields) for e in stream_entries(reply)]

    def _xreadgroup_direct(self, start: str, count: int, block: int | None) -> list[tuple[Any, Any]]:
        """``_xreadgroup`` on the lane: the pending acks (XACK first) and the read in one packed send."""
        key = (start, count, block)
        packed = self._packed_reads.get(key) if start == ">" else None
        if packed is None:
            if block is None:
                packed = pack("XREADGROUP", "GROUP", self.group, self.name, "COUNT", count, "STREAMS", self.stream,
                              start)
            else:
                packed = pack("XREADGROUP", "GROUP", self.group, self.name, "COUNT", count, "BLOCK", block,
                              "STREAMS", self.stream, start)
            if start == ">":  # the same few reads over and over: packed once
                self._packed_reads[key] = packed
        acks = self._unacked
        if acks:
            packed = pack("XACK", self.stream, self.group, *acks) + packed
        lane = self._lane
        replies = self.guard.call(lambda c: raise_errors(lane.execute(packed, 2 if acks else 1)))
        if acks:
            self._unacked = []
            self._acked(acks)
        return entries_of(replies[-1])

    def _autoclaim(self, count: int) -> list[tuple[Any, Any]]:
        """Take over entries idle for ``claim_idle_ms``, resuming the scan where the last one stopped.

        XAUTOCLAIM looks at no more than ``10 * count`` pending entries per call: always starting at
        ``0-0`` would never reach idle entries behind a long run of busy ones.
        """
        start = self._claim_cursor
        reply = self._call_with_acks(lambda c: c.xautoclaim(
            self.stream, self.group, self.name, min_idle_time=self.config.claim_idle_ms,
            start_id=start, count=count))
        self._claim_cursor = as_str(reply[0]) if reply else "0-0"
        entries = list(reply[1]) if reply else []
        deleted = list(reply[2]) if reply and len(reply) > 2 else []
        if deleted:  # trimmed away while pending: nothing left to process
            self.guard.call(lambda c: c.xack(self.stream, self.group, *deleted))
            self._acked([as_str(i) for i in deleted])
        return entries

    def _call_with_acks(self, command: Callable[[Any], Any]) -> Any:
        """Run one read-side command; acks still waiting to be sent go first, in the same round trip.

        They go first so that nothing this consumer has handled is read or claimed again.
        """
        acks = self._unacked
        if not acks:
            return self.guard.call(command)

        def both(c: redis.Redis) -> Any:
            pipe = c.pipeline(transaction=False)
            pipe.xack(self.stream, self.group, *acks)
            command(pipe)
            return pipe.execute()[1]
        result = self.guard.call(both)
        self._unacked = []
        self._acked(acks)
        return result

    def _deliveries(self, ids: list[str]) -> dict[str, int]:
        """Delivery counts of entries just re-delivered to us (only re-deliveries pay for this)."""
        rows = self.guard.call(lambda c: c.xpending_range(
            self.stream, self.group, min=ids[0], max=ids[-1], count=len(ids) + 64, consumername=self.name))
        counts = {as_str(r["message_id"]): int(r["times_delivered"]) for r in rows}
        missing = [i for i in ids if i not in counts]
        if missing:  # more of our own pending entries lie between them than the range fetched

            def each(c: redis.Redis) -> list[Any]:
                pipe = c.pipeline(transaction=False)
                for i in missing:
                    pipe.xpending_range(self.stream, self.group, min=i, max=i, count=1, consumername=self.name)
                return pipe.execute()
            for found in self.guard.call(each):
                counts.update({as_str(r["message_id"]): int(r["times_delivered"]) for r in found})
        return counts

    def _accept(self, raw: list[tuple[Any, Any]], pending: bool) -> list[Message]:
        ids = [entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id) for entry_id, _ in raw]
        self._held.update(ids)
        counts = self._deliveries(ids) if pending and ids else {}
        out: list[Message] = []
        trimmed: list[str] = []
        decoder, stream, max_deliveries = self.decoder, self.stream, self.config.max_deliveries
        for (_entry_id, fields), sid in zip(raw, ids, strict=True):
            if not fields:  # trimmed while pending: Redis gives nil, redis-py 8 an empty map
                trimmed.append(sid)
                continue
            deliveries = counts.get(sid, 1) if counts else 1
            if deliveries > max_deliveries:
                self.dead_letter(sid, fields, f"delivered {deliveries} times (max {max_deliveries})", deliveries)
                continue
            try:
                event = decoder(fields)
            except DecodeError as exc:
                self.dead_letter(sid, fields, exc.reason, deliveries)
                continue
            out.append(Message(stream, sid, event, deliveries, fields))
        if trimmed:
            self.ack(*trimmed)
        return out

    # --- acknowledging ------------------------------------------------------------------
    def ack(self, *ids: str, lease: LeaseFence | None = None) -> None:
        """XACK ``ids``; with ``lease``, only while that lease holds (checked in the same script, ``LeaseLost``)."""
        if not ids:
            return
        if lease is not None:
            script = self._leased_ack = self._leased_ack or self.client.register_script(leased(_ACK))
            script_keys, script_args = lease.keys(self.stream), lease.args(self.group, *ids)
            guarded(self.guard, lambda c: script(keys=script_keys, args=script_args, client=c))
        elif self._lane.direct:
            packed = pack("XACK", self.stream, self.group, *ids)
            self.guard.call(lambda c: raise_errors(self._lane.execute(packed)))
        else:
            self.guard.call(lambda c: c.xack(self.stream, self.group, *ids))
        self._acked(ids)

    def flush_acks(self) -> None:
        """Send the acks that ``run`` and ``run_until_idle`` hold for the next read."""
        ids, self._unacked = self._unacked, []
        self.ack(*ids)

    def dead_letter(self, entry_id: str, fields: Any, reason: str, deliveries: int, *,
                    lease: LeaseFence | None = None) -> None:
        """Move an entry to the dead-letter stream with its reason and ack it, atomically; with ``lease``,
        only while that lease holds (checked in the same script, ``LeaseLost``)."""
        log.warning("dead-lettering %s %s (group %s): %s", self.stream, entry_id, self.group, reason)
        record = dead_letter_fields(self.stream, self.group, self.name, entry_id, fields, reason, deliveries)
        if lease is not None:
            script = self._leased_dead_letter = self._leased_dead_letter or self.client.register_script(
                leased(_DEAD_LETTER))
            pairs = [x for kv in record.items() for x in kv]
            script_keys, script_args = lease.keys(self.stream, self.keys.dead_letters), lease.args(
                self.group, entry_id, *pairs)
            guarded(self.guard, lambda c: script(keys=script_keys, args=script_args, client=c))
        else:
            def move(c: redis.Redis) -> None:
                pipe = c.pipeline(transaction=True)
                pipe.xadd(self.keys.dead_letters, record)  # type: ignore[arg-type]
                pipe.xack(self.stream, self.group, entry_id)
                pipe.execute()
            self.guard.call(move)
        self._acked([entry_id])
        self.dead_lettered += 1

    # --- loops --------------------------------------------------------------------------
    def process(self, handler: Handler, block_ms: int | None = None) -> int:
        """Read once and hand each message to ``handler``; returns how many were handled.

        A handler that raises leaves its entry pending: it is retried after ``claim_idle_ms``
        and dead-lettered after ``max_deliveries``. With ``auto_ack`` the entries handled are
        acked together, in one XACK, before this returns.
        """
        return self._process(handler, block_ms, defer_acks=False)

    def _process(self, handler: Handler, block_ms: int | None, defer_acks: bool) -> int:
        done: list[str] = []
        try:
            for msg in self.read(block_ms):
                try:
                    handler(msg)
                except Exception:
                    log.exception("handler failed on %s %s (delivery %d)", self.stream, msg.id, msg.deliveries)
                    continue
                done.append(msg.id)
        finally:
            if self.config.auto_ack:
                if defer_acks:
                    self._unacked += done
                else:
                    self.ack(*done)
        return len(done)

    def run(self, handler: Handler, stop: threading.Event) -> None:
        """Process until ``stop`` is set.

        The acks of one batch travel in the same round trip as the next read (XACK first), and
        whatever is left is acked on the way out; a crash in between only means redelivery.
        """
        try:
            while not stop.is_set():
                self._process(handler, None, defer_acks=True)
        finally:
            self.flush_acks()

    def run_until_idle(self, handler: Handler, idle_block_ms: int = 50, max_rounds: int = 100_000) -> int:
        """Process until a read comes back empty and nothing of ours is pending; for tests and drains.

        Acks are sent as in ``run``; all are sent before this returns.
        """
        total = 0
        try:
            for _ in range(max_rounds):
                before_dead = self.dead_lettered
                n = self._process(handler, idle_block_ms, defer_acks=True)
                total += n
                if n == 0 and self.dead_lettered == before_dead and not self._recovering:
                    return total
            return total
        finally:
            self.flush_acks()


def _group_gone(exc: BaseException) -> bool:
    """A reply saying the group (or its stream) no longer exists: NOGROUP, or a blocked read the
    group's destruction woke."""
    text = str(exc)
    return "NOGROUP" in text or "no longer exists" in text


def dead_letter_fields(stream: str, group: str, consumer: str, entry_id: str, fields: Any, reason: str,
                       deliveries: int) -> dict[bytes, bytes]:
    try:
        raw = msgpack.packb(fields, use_bin_type=True)
    except Exception:
        raw = msgpack.packb(repr(fields), use_bin_type=True)
    return {
        b"source": stream.encode(), b"group": group.encode(), b"consumer": consumer.encode(),
        b"entry_id": entry_id.encode(), b"reason": reason.encode(), b"deliveries": str(deliveries).encode(),
        b"raw": raw, b"ts_ms": str(time.time_ns() // 1_000_000).encode(),
    }


def create_group(c: redis.Redis, stream: str, group: str, start_id: str = "$") -> bool:
    """``XGROUP CREATE ... MKSTREAM``; False when the group exists already (other errors raise)."""
    try:
        c.xgroup_create(stream, group, id=start_id, mkstream=True)
    except redis.ResponseError as exc:
        if not is_busygroup(exc):
            raise
        return False
    return True


def register_group(c: redis.Redis, keys: Keys, stream: str, group: str, start_id: str = "$") -> bool:
    """Create ``group`` if needed and register it as a reader that ``stream`` must keep entries for."""
    created = create_group(c, stream, group, start_id)
    c.sadd(keys.registered_groups(stream), group)
    c.hset(keys.group_hosts(stream), group, socket.gethostname())
    return created


# KEYS[1] stream; ARGV[1] group, ARGV[2..] entry ids (run through ``events.leased``: only while a lease holds).
_ACK = "return redis.call('XACK', KEYS[1], unpack(ARGV))"

# KEYS[1] stream, KEYS[2] dead letters; ARGV[1] group, ARGV[2] entry id, ARGV[3..] the record's field/value pairs.
_DEAD_LETTER = """
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
return redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
"""
