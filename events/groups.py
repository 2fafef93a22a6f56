"""A consumer group's life beside its consumers: heartbeats, the janitor's liveness test, and where a
group that vanished resumes.

``Heartbeat`` renews a group's registration from a thread of its own, so a consumer busy for longer
than ``group_ttl_s`` (a training step) keeps its group. The janitor expires a group only when its
owner is known dead (``owner_alive``: the beat lapsed *and* no consumer of the group touched the
stream within the TTL); before it destroys the group it records where the group stood
(``record_expired``: after the last entry every consumer acked). A consumer that finds its group
gone recreates it there, or after the last entry it acked itself, never at ``$``
(``resume_point``), and says what it could not get back (``lost_after``).
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from rollout_bus.events.connection import Guard, ReconnectPolicy, as_str
from rollout_bus.events.errors import BusError
from rollout_bus.events.names import Keys

log = logging.getLogger(__name__)

# KEYS[1] group beats, KEYS[2] group ttls; ARGV[1] group, ARGV[2] ttl ms. The registration lapses at now + ttl
# (Redis clock); the ttl is kept for the janitor's liveness test.
BEAT = """
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], t[1] * 1000 + math.floor(t[2] / 1000) + tonumber(ARGV[2]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""


# --- stream ids ----------------------------------------------------------------------------------

def parse_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def id_before(entry_id: str) -> str:
    """The greatest stream id below ``entry_id`` (a group created there delivers ``entry_id`` next)."""
    ms, seq = parse_id(entry_id)
    if seq > 0:
        return f"{ms}-{seq - 1}"
    return f"{ms - 1}-18446744073709551615" if ms > 0 else "0-0"


def earliest(*ids: str | None) -> str | None:
    found = [i for i in ids if i]
    return min(found, key=parse_id) if found else None


# --- heartbeat -----------------------------------------------------------------------------------

class Heartbeat:
    """Calls ``beat(owner, guard)`` every ``period_s`` from a daemon thread while ``owner`` lives and until
    ``stop``.

    The thread holds the owner weakly (``beat`` must not be a bound method of it): a consumer dropped
    without ``close`` stops beating, so its group can lapse as before.
    """

    def __init__(self, owner: Any, beat: Callable[[Any, Guard], None], period_s: float, name: str) -> None:
        self._stop = threading.Event()
        self._guard: Guard | None = None
        self.beats = 0
        self.failures = 0
        ref = weakref.ref(owner)
        self._thread = threading.Thread(target=_beat_loop, args=(ref, self, beat, period_s, name),
                                        name=f"heartbeat {name}", daemon=True)

    def start(self, guard: Guard) -> Heartbeat:
        self._guard = guard
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def _beat_loop(ref: weakref.ref[Any], hb: Heartbeat, beat: Callable[[Any, Guard], None], period_s: float,
               name: str) -> None:
    while not hb._stop.wait(period_s):
        owner = ref()
        if owner is None or hb._guard is None:
            return
        try:
            beat(owner, hb._guard)
            hb.beats += 1
        except BusError as exc:  # the next beat tries again; the TTL allows four misses
            hb.failures += 1
            log.warning("heartbeat %s: %s", name, exc)
        finally:
            del owner


def heartbeat_guard(client: redis.Redis, name: str, period_s: float) -> Guard:
    """A guard of the heartbeat thread's own (its outages are not the reader's), waiting one period at most."""
    return Guard(client, ReconnectPolicy(max_wait_s=max(period_s, 0.5)), name=f"heartbeat {name}")


# --- the janitor's side --------------------------------------------------------------------------

def owner_alive(c: redis.Redis, keys: Keys, stream: str, group: str) -> str | None:
    """Why ``group``'s owner is still alive although its beats lapsed (a consumer of the group touched the
    stream within the group's TTL), or None when it is known dead."""
    raw_ttl = c.hget(keys.group_ttls(stream), group)
    try:  # written by the group's consumers: a value that is not a positive number counts as no TTL
        ttl_ms = int(raw_ttl) if raw_ttl is not None else 0
    except ValueError:
        log.warning("group %s of %s has a malformed TTL %r: its owner is taken as dead", group, stream,
                    str(raw_ttl)[:40])
        ttl_ms = 0
    if ttl_ms <= 0:
        return None
    try:
        consumers = c.xinfo_consumers(stream, group)
    except redis.ResponseError:  # the group or the stream is gone already
        return None
    for consumer in consumers:
        idle = int(consumer.get("idle", ttl_ms))
        if idle < ttl_ms:
            return f"consumer {as_str(consumer['name'])} touched the stream {idle / 1000:.1f}s ago"
    return None


def record_expired(c: redis.Redis, keys: Keys, stream: str, group: str, expired_ms: int) -> str | None:
    """Keep where ``group`` stood before the janitor destroys it: after its oldest unacked entry (or its last
    delivered one); the consumer that comes back resumes there. Returns that id (None: no such group)."""
    try:
        info = next((g for g in c.xinfo_groups(stream) if as_str(g["name"]) == group), None)
    except redis.ResponseError:
        return None
    if info is None:
        return None
    resume = as_str(info["last-delivered-id"])
    record: dict[str, Any] = {"resume_after": resume, "expired_ms": expired_ms}
    if info.get("entries-read") is not None:  # entries up to ``resume`` (Redis 7): lets a gap be counted
        record["entries_read"] = int(info["entries-read"])
    summary = c.xpending(stream, group)
    if summary and int(summary.get("pending", 0)) > 0 and summary.get("min"):
        resume = record["resume_after"] = earliest(resume, id_before(as_str(summary["min"]))) or resume
        record.pop("entries_read", None)
    c.hset(keys.expired_groups(stream), group, json.dumps(record))
    return resume


def expired_record(c: redis.Redis, keys: Keys, stream: str, group: str) -> dict[str, Any] | None:
    """What ``record_expired`` kept for ``group``; None if nothing (or something unreadable: untrusted)."""
    raw = c.hget(keys.expired_groups(stream), group)
    if raw is None:
        return None
    try:
        record = json.loads(raw)
        return record if isinstance(record, dict) and isinstance(record.get("resume_after"), str) else None
    except (ValueError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class Gap:
    """Entries of a stream in ``(after, upto]`` that can no longer be delivered; ``count`` when known."""

    after: str
    upto: str
    count: int | None

    def describe(self) -> str:
        many = "entries" if self.count is None else f"{self.count} entr{'y' if self.count == 1 else 'ies'}"
        return f"{many} up to {self.upto}"


def lost_after(c: redis.Redis, stream: str, after: str, entries_read: int | None = None) -> Gap | None:
    """What ``stream`` can no longer deliver past ``after`` (trimmed or deleted); None when nothing.

    Trimming cuts from the head: when the oldest entry kept is newer than ``after``, whatever lay between
    them is gone. ``entries_read`` (entries ever added up to ``after``, Redis 7's counter) makes that a
    count, and nothing is reported when the cut fell right after ``after``; without it the range is
    reported all the same (perhaps empty), never hidden.
    """
    try:
        info = c.xinfo_stream(stream)
    except redis.ResponseError:
        return None
    start = parse_id(after)
    deleted = as_str(info.get("max-deleted-entry-id") or "0-0")
    if parse_id(deleted) > start:  # XDEL past ``after``: those entries are gone whatever else holds
        return Gap(after, deleted, None)
    first = info.get("first-entry")
    upto = id_before(as_str(first[0])) if first else as_str(info.get("last-generated-id") or "0-0")
    if parse_id(upto) <= start:
        return None
    added, length = info.get("entries-added"), int(info.get("length", 0))
    if entries_read is not None and added is not None:
        count = int(added) - entries_read - length
        return Gap(after, upto, count) if count > 0 else None
    return Gap(after, upto, None)
