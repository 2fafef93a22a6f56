"""The bus's housekeeping, run by the active controller on a timer: nothing is left behind.

One ``Janitor.run_once`` pass, over every stream of the namespace:

1. **Groups**: a group whose owner is known dead (its consumers stopped beating, ``Consumer.beat``
   and its heartbeat thread, lapse time in ``keys.group_beats``; *and* none of its consumers
   touched the stream within the group's TTL, ``events.groups.owner_alive``) is unregistered and
   destroyed, and dropped as a reader of its policy's payloads (those left with no reader are
   deleted). Where it stood is kept first (``keys.expired_groups``): a consumer of it that comes
   back resumes there, not at ``$``. A group registered without beats (a payload hold for export)
   never lapses.
2. **Streams**: each is trimmed to ``max_len`` entries and/or ``max_age_s`` by
   ``events.retention.trim``, which never passes the oldest entry a registered group has not
   acked (its oldest pending entry, or its first undelivered one).
3. **Payloads**: those older than ``payload_max_age_s`` go whatever their readers, through a
   store of the kind each was written to (``BatchChannel.sweep``).

What it removed is returned (for metrics) and published on ``keys.housekeeping_stream`` as
``GroupExpired``, ``StreamsTrimmed`` and ``PayloadsSwept``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import redis

from rollout_bus.events.batches import BatchChannel, Swept
from rollout_bus.events.connection import Guard, as_str
from rollout_bus.events.groups import owner_alive, record_expired
from rollout_bus.events.names import BATCHES, Keys, logical_stream
from rollout_bus.events.paging import discover_streams
from rollout_bus.events.publish import Publisher
from rollout_bus.events.retention import trim
from rollout_bus.events.schema import GroupExpired, PayloadsSwept, StreamsTrimmed

log = logging.getLogger(__name__)

# KEYS[1] group beats, KEYS[2] registered groups, KEYS[3] group ttls; ARGV[1] group. Unregisters the group if its registration
# lapsed: returns -1 when it has not (or it has no beat), else ms since it lapsed. (The stream itself is
# not a key of the script: a janitor's ACL user may only trim streams and destroy groups there.)
_EXPIRE = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local lapse = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not lapse or tonumber(lapse) > now then return -1 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return now - tonumber(lapse)
"""


@dataclass
class JanitorConfig:
    interval_s: float = 30.0
    """How often the active controller runs a pass; 0 turns the janitor off."""
    max_len: int | None = 100_000
    """Entries kept per stream (never past what a live group still needs); None: no length limit."""
    max_age_s: float | None = None
    """Entries older than this go (same rule); None: no age limit."""
    payload_max_age_s: float = 24 * 3600
    """Payloads older than this go whatever their readers."""
    payload_roots: tuple[str, ...] = ()
    """Directories of shm and file payload stores this process may delete from."""


@dataclass
class JanitorReport:
    trimmed: dict[str, int] = field(default_factory=dict)
    """Entries removed, by logical stream."""
    swept: Swept = field(default_factory=Swept)
    expired: list[GroupExpired] = field(default_factory=list)
    seconds: float = 0.0


class Janitor:
    def __init__(self, client: redis.Redis, keys: Keys, publisher: Publisher, config: JanitorConfig | None = None,
                 *, guard: Guard | None = None) -> None:
        self.client = client
        self.keys = keys
        self.publisher = publisher
        self.config = config or JanitorConfig()
        self.guard = guard or Guard(client, name="janitor")
        self.channel = BatchChannel(client, keys, publisher=publisher, guard=self.guard)
        self._expire = client.register_script(_EXPIRE)

    def run_once(self) -> JanitorReport:
        started = time.perf_counter()
        report = JanitorReport()
        streams = discover_streams(self.client, self.keys, guard=self.guard)
        for stream in streams:
            report.expired += self._expire_groups(stream)
        cfg = self.config
        if cfg.max_len is not None or cfg.max_age_s is not None:
            for stream in streams:
                removed = trim(self.client, self.keys, stream, max_len=cfg.max_len,
                               max_age_ms=None if cfg.max_age_s is None else int(cfg.max_age_s * 1000),
                               guard=self.guard)
                if removed:
                    report.trimmed[logical_stream(self.keys, stream)] = removed
        report.swept = self.channel.sweep(cfg.payload_max_age_s, roots=cfg.payload_roots)
        self._announce(report)
        report.seconds = time.perf_counter() - started
        if report.trimmed or report.swept.total or report.expired:
            log.info("janitor: trimmed %s, swept %s payload(s) and %d leftover(s), expired %d group(s) in %.2fs",
                     report.trimmed or "nothing", report.swept.payloads or 0, report.swept.leftovers,
                     len(report.expired), report.seconds)
        return report

    def _expire_groups(self, stream: str) -> list[GroupExpired]:
        beats = self.keys.group_beats(stream)
        sec, usec = self.guard.call(lambda c: c.time())
        now_ms = int(sec) * 1000 + int(usec) // 1000
        lapsed = [as_str(g) for g in self.guard.call(lambda c: c.zrangebyscore(beats, "-inf", now_ms))]
        logical = logical_stream(self.keys, stream)
        out: list[GroupExpired] = []
        for group in lapsed:
            alive = self.guard.call(lambda c: owner_alive(c, self.keys, stream, group))  # noqa: B023
            if alive is not None:  # beats lapsed (a paused heartbeat?) but the group is in use: not expired
                log.info("janitor: group %s of %s stopped beating but is alive (%s); kept", group, logical, alive)
                continue
            script_keys = [beats, self.keys.registered_groups(stream), self.keys.group_ttls(stream)]
            args = [group]
            since_ms = int(self.guard.call(lambda c: self._expire(keys=script_keys, args=args, client=c)))  # noqa: B023
            if since_ms < 0:  # a consumer beat meanwhile
                continue
            resume = self.guard.call(lambda c: record_expired(c, self.keys, stream, group, now_ms))  # noqa: B023
            self.guard.call(lambda c: _destroy_group(c, stream, group))  # noqa: B023
            released = 0
            if logical.startswith(BATCHES):
                released = self.channel.drop_reader(logical[len(BATCHES):], group,
                                                    roots=self.config.payload_roots)
            log.warning("janitor: group %s of %s is dead (beat lapsed %.0fs ago, no consumer within its TTL): "
                        "unregistered, destroyed (a consumer that comes back resumes after %s), released as the "
                        "reader of %d payload(s)", group, logical, since_ms / 1000, resume, released)
            out.append(GroupExpired(producer=self.publisher.producer, stream=logical, group=group,
                                    lapsed_s=since_ms / 1000, payloads_released=released))
        return out

    def _announce(self, report: JanitorReport) -> None:
        events: list[GroupExpired | StreamsTrimmed | PayloadsSwept] = list(report.expired)
        producer = self.publisher.producer
        if report.trimmed:
            events.append(StreamsTrimmed(producer=producer, entries=dict(report.trimmed)))
        if report.swept.payloads:
            events.append(PayloadsSwept(producer=producer, payloads=dict(report.swept.payloads),
                                        max_age_s=self.config.payload_max_age_s))
        if events:
            self.publisher.publish_many(self.keys.housekeeping_stream, events)

    def close(self) -> None:
        self.channel.close()


def _destroy_group(c: redis.Redis, stream: str, group: str) -> None:
    """``XGROUP DESTROY``; a stream or group already gone is fine (a consumer that comes back recreates it)."""
    try:
        c.xgroup_destroy(stream, group)
    except redis.ResponseError as exc:
        if "requires the key to exist" not in str(exc):
            raise
