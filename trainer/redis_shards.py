"""One trainer over several independent Redis primaries: the bus past one primary's ceiling.

rq does not run on Redis Cluster (its pipelines touch keys of different hash slots), so the bus scales
out with independent primaries, each optionally a Sentinel group. A **shard** is one whole bus: its
Redis, its controller and engines, its rq queue and executors, with the same namespace and key layout
as a single-Redis deployment (``events.names.Keys``). Nothing crosses between shards but the trainer,
the one role that sees them all (docs/architecture.md, "Beyond one Redis"):

- ``ShardedClient`` (the trainer's ``RolloutClient`` over every shard): each request goes to the live
  shard with the fewest of this trainer's requests in flight; batches are read from every shard's
  batch stream through the trainer's consumer group there, and acked on the shard they came from. It
  holds the policy lease on every shard, joins each and announces every step on each.
- ``ShardedWeights`` (the trainer's ``WeightPublisher``): a version is written once, to the shared
  weights root, and announced on every live shard, whose controller pushes it to its engines; serving
  means served on every live shard. Old versions are deleted once every live shard is done with them.
- A monitor thread reads each shard's bus epoch every ``probe_s``. A shard unreachable for
  ``lost_after_s`` (or whose epoch vanished: restarted empty) is **lost**: its client is abandoned, so a
  call blocked in its reconnect loop gives up at once, and the trainer's thread then resubmits the
  requests in flight there, unchanged (same request id, same returned items, a fresh deadline), to the
  live shards. A shard that answers again for ``rejoin_after_s`` rejoins with a new client: lease,
  group, ``TrainerJoined`` and the current version announced there, then it takes requests again.

Exactly one batch per request holds on every shard (each shard's own guarantees, unchanged), and the
trainer trains each rollout once: a request moved to another shard that still delivers from the old
one (a shard lost while its batch was on the way, then back) gives a second batch of the same rollout,
which the trainer acks unused as it does any batch no request of its waits for. A batch read from a
shard before it was lost is trained as any other; its ack cannot reach the lost shard, which
redelivers it if it comes back with its data, and the trainer's checkpoint lists it as done.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from rollout_bus.events.connection import (
    UNREACHABLE,
    Guard,
    ReconnectPolicy,
    Redis,
    abandon,
    connect,
    probe_client,
    redact,
)
from rollout_bus.events.epoch import BusEpoch
from rollout_bus.events.errors import BusError, BusUnavailable
from rollout_bus.events.names import Keys
from rollout_bus.events.rollouts import RolloutRequest, now_ms
from rollout_bus.events.schema import Event, Producer
from rollout_bus.lm.files import version_dir
from rollout_bus.trainer.client import ClientConfig, Handing, ReceivedBatch, RolloutClient
from rollout_bus.trainer.weights import Published, ServingTimeout, WeightPublisher

log = logging.getLogger(__name__)

SHARD_ERRORS = UNREACHABLE
"""What a call on a shard raises when that shard is gone (``BusUnavailable`` once its client is abandoned, or past
a guard's reconnect budget). Anything else (a refused lease, a command error) is the trainer's to handle."""
PROBE_ERRORS: tuple[type[BaseException], ...] = (BusError, *UNREACHABLE)
"""What a look at a shard that may be gone may raise (a command error too: nothing to decide on)."""


@dataclass
class ShardSettings:
    probe_s: float = 1.0
    """How often the monitor reads each shard's bus epoch."""
    lost_after_s: float = 5.0
    """A shard unreachable this long is lost: its requests in flight go to the live shards."""
    rejoin_after_s: float = 3.0
    """A lost shard answering again this long rejoins."""

    def __post_init__(self) -> None:
        if min(self.probe_s, self.lost_after_s, self.rejoin_after_s) <= 0:
            raise ValueError("shard settings: probe_s, lost_after_s and rejoin_after_s must be > 0")


@dataclass
class Shard:
    """One Redis primary as the trainer sees it."""

    index: int
    url: str
    client: Redis
    rollouts: RolloutClient
    weights: WeightPublisher
    up: bool = True
    """Not lost (a lost shard takes nothing until it rejoins)."""
    suspect: bool = False
    """Up, but its last probe or call failed: left out (its client abandoned, so no call waits on it) until it
    answers again (a new client) or is lost."""
    lost_reason: str = ""
    unreachable_since: float | None = None
    reachable_since: float | None = None
    epoch: str | None = None
    """The shard's bus epoch when the trainer joined it (None: not known yet)."""


@dataclass
class Pending:
    """A request of this trainer not yet answered: where it is, and what to send elsewhere if that shard is lost."""

    shard: int
    request: RolloutRequest


@dataclass
class ShardStats:
    lost: int = 0
    rejoined: int = 0
    resubmitted: int = 0
    acks_lost: int = 0
    """Acks that could not reach a lost shard (the batch was trained; it comes back there only if the shard does)."""
    per_shard_requests: dict[int, int] = field(default_factory=dict)


ShardFactory = Callable[[int, str, Redis], tuple[RolloutClient, WeightPublisher]]


class ShardSet:
    """The trainer's shards, their state, and the monitor thread that finds lost and returning ones."""

    def __init__(self, urls: list[str], keys: Keys, factory: ShardFactory, settings: ShardSettings | None = None,
                 *, connect_fn: Callable[[str], Redis] = connect) -> None:
        if len(urls) < 1:
            raise ValueError("a shard set needs at least one Redis url")
        if len(set(urls)) != len(urls):
            raise ValueError(f"the same Redis is named twice among the shards: {urls}")
        self.keys = keys
        self.factory = factory
        self.settings = settings or ShardSettings()
        self.connect = connect_fn
        self.stats = ShardStats()
        self.shards: list[Shard] = []
        for i, url in enumerate(urls):
            client = connect_fn(url)
            rollouts, weights = factory(i, url, client)
            self.shards.append(Shard(i, url, client, rollouts, weights))
        self._events: list[tuple[str, int, str]] = []
        """('lost' | 'back', shard, reason) found by the monitor, handled on the trainer's thread."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._probes: dict[int, tuple[Redis, BusEpoch]] = {}
        self._thread: threading.Thread | None = None
        self.on_lost: list[Callable[[Shard], None]] = []
        self.on_rejoin: list[Callable[[Shard], None]] = []

    # --- which shards -------------------------------------------------------------------
    def live(self) -> list[Shard]:
        """The shards calls go to now: up and answering."""
        return [s for s in self.shards if s.up and not s.suspect]

    def require_live(self) -> list[Shard]:
        """``live``, waiting while every shard left is only suspect (each answers again or is lost within
        ``lost_after_s``); ``BusUnavailable`` once every shard is lost."""
        while True:
            live = self.live()
            if live:
                return live
            if not any(s.up for s in self.shards):
                raise BusUnavailable("every Redis shard of this trainer is lost: "
                                     + "; ".join(f"shard {s.index} ({redact(s.url)}): {s.lost_reason}"
                                                 for s in self.shards))
            time.sleep(min(0.05, self.settings.probe_s))
            self.handle()

    def describe(self) -> str:
        return ", ".join(f"{s.index}={'lost' if not s.up else 'suspect' if s.suspect else 'up'}" for s in self.shards)

    # --- start and stop -----------------------------------------------------------------
    def start(self, join: Callable[[Shard], None]) -> None:
        """``join`` every shard (a shard that cannot be reached is lost from the start); the monitor then runs."""
        for shard in self.shards:
            try:
                join(shard)
                shard.epoch = self._probe(shard.index, shard.url).join()
            except SHARD_ERRORS as exc:
                self._lose(shard, f"unreachable at start: {exc}")
        self.require_live()
        self._thread = threading.Thread(target=self._monitor, name="redis-shards", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.settings.probe_s + 5.0)
        for client, _ in self._probes.values():
            client.close()

    # --- failures -----------------------------------------------------------------------
    def suspend(self, shard: Shard, exc: BaseException | str) -> None:
        """A call on ``shard`` failed as an unreachable shard's calls do: leave it out until the monitor finds it
        answering again (a new client) or lost (its requests moved)."""
        if shard.up and not shard.suspect:
            self._suspect(shard, str(exc))

    def _suspect(self, shard: Shard, reason: str) -> None:
        shard.suspect = True
        abandon(shard.client)  # a call waiting in a reconnect loop there gives up at its next try
        self._say_suspect(shard, reason)

    def _say_suspect(self, shard: Shard, reason: str) -> None:
        log.warning("Redis shard %d (%s) does not answer (%s): left out until it does, lost after %.1fs (%s)",
                    shard.index, redact(shard.url), reason, self.settings.lost_after_s, self.describe())

    def lose(self, shard: Shard, exc: BaseException | str) -> None:
        """Take ``shard`` out for good now: its requests in flight go to the live shards."""
        if shard.up:
            self._lose(shard, str(exc))

    def _lose(self, shard: Shard, reason: str) -> None:
        shard.up, shard.suspect = False, False
        shard.lost_reason = reason
        shard.reachable_since = None
        abandon(shard.client)  # calls still waiting in its guards' reconnect loops give up at their next try
        shard.rollouts.lease.release()  # stops renewing (the release itself fails quietly: the lease lapses there)
        self.stats.lost += 1
        log.error("Redis shard %d (%s) lost: %s; its requests in flight go to the live shards (%s)", shard.index,
                  redact(shard.url), reason, self.describe())
        for hook in self.on_lost:
            hook(shard)

    def handle(self) -> None:
        """Apply what the monitor found (on the trainer's thread: only it touches the shards' clients)."""
        with self._lock:
            found, self._events = self._events, []
        for what, index, reason in found:
            shard = self.shards[index]
            if what == "suspect" and shard.up:
                self._say_suspect(shard, reason)  # the monitor left it out already
            elif what == "lost" and shard.up:
                self._lose(shard, reason)
            elif what == "back" and (not shard.up or shard.suspect):
                self._rejoin(shard)

    def _rejoin(self, shard: Shard) -> None:
        """A new client for a shard answering again (lost, or only suspect: its requests are still queued there,
        and the batches its old client held come back to the new one, the same consumer)."""
        old = shard.rollouts
        abandon(shard.client)
        client = self.connect(shard.url)
        rollouts, weights = self.factory(shard.index, shard.url, client)
        candidate = replace(shard, client=client, rollouts=rollouts, weights=weights)
        try:
            for hook in self.on_rejoin:
                hook(candidate)
            candidate.epoch = self._probe(shard.index, shard.url).join()
        except PROBE_ERRORS as exc:  # unreachable again, or refused (the policy taken there meanwhile): stays out
            log.warning("Redis shard %d (%s) answered but could not be joined again: %s", shard.index,
                        redact(shard.url), exc)
            abandon(client)
            return
        rollouts.adopt_buffer(old)  # batches read before, not taken yet (a redelivery of one is skipped)
        try:
            old.stop()  # its lease renewal and payload reader
        except PROBE_ERRORS as exc:
            log.debug("shard %d: the old client stopped with %s", shard.index, exc)
        shard.client, shard.rollouts, shard.weights = client, rollouts, weights
        was = "lost" if not shard.up else "not answering"
        shard.epoch, shard.up, shard.suspect, shard.lost_reason = candidate.epoch, True, False, ""
        shard.unreachable_since = None
        self.stats.rejoined += 1
        log.warning("Redis shard %d (%s), %s, is back: it takes requests again (%s)", shard.index,
                    redact(shard.url), was, self.describe())

    # --- the monitor --------------------------------------------------------------------
    def _probe(self, index: int, url: str) -> BusEpoch:
        """A client of its own per shard with short timeouts, and the shard's epoch read through it."""
        if index not in self._probes:
            client = probe_client(url) if url.startswith(("redis://", "rediss://", "unix://", "redis+sentinel://")) \
                else self.connect(url)
            guard = Guard(client, ReconnectPolicy(max_wait_s=0.0, base_s=0.01, cap_s=0.01), name=f"shard {index} probe")
            self._probes[index] = (client, BusEpoch(client, self.keys, guard=guard))
        return self._probes[index][1]

    def _monitor(self) -> None:
        while not self._stop.wait(self.settings.probe_s):
            for shard in list(self.shards):
                self._look(shard)

    def _look(self, shard: Shard) -> None:
        now = time.monotonic()
        epoch = self._probe(shard.index, shard.url)
        try:
            current = epoch.guard.call(lambda c: c.get(self.keys.bus_epoch))
            reachable, reset = True, None
            value = None if current is None else (current.decode() if isinstance(current, bytes) else str(current))
            if shard.up and shard.epoch is not None and value != shard.epoch:
                reset = (f"its bus epoch {shard.epoch} {'is gone' if value is None else 'was replaced'} "
                         "(restarted without its data)")
        except PROBE_ERRORS:
            reachable, reset = False, None
        if reset is not None:
            self._found("lost", shard, reset)
            return
        if reachable:
            shard.unreachable_since = None
            if not shard.up or shard.suspect:
                shard.reachable_since = shard.reachable_since or now
                if now - shard.reachable_since >= self.settings.rejoin_after_s:
                    self._found("back", shard, "")
            return
        shard.reachable_since = None
        shard.unreachable_since = shard.unreachable_since or now
        if shard.up and not shard.suspect:
            # from the first failed look: no call of the trainer waits on it (the trainer's thread, at its next
            # call, sees it left out); the requests stay there until it is lost
            shard.suspect = True
            abandon(shard.client)
            self._found("suspect", shard, "a probe found it unreachable")
        if shard.up and now - shard.unreachable_since >= self.settings.lost_after_s:
            self._found("lost", shard, f"unreachable for {now - shard.unreachable_since:.1f}s")

    def _found(self, what: str, shard: Shard, reason: str) -> None:
        with self._lock:
            if (what, shard.index) not in {(w, i) for w, i, _ in self._events}:
                self._events.append((what, shard.index, reason))


class ShardedLease:
    """The trainer's policy lease on every live shard (``verify`` before a write outside Redis)."""

    def __init__(self, shards: ShardSet) -> None:
        self.shards = shards

    def verify(self) -> None:
        for shard in self.shards.require_live():
            try:
                shard.rollouts.lease.verify()
            except SHARD_ERRORS as exc:
                self.shards.suspend(shard, exc)
        self.shards.require_live()


class ShardedClient(Handing):
    """``RolloutClient``'s interface over every shard of a ``ShardSet`` (see the module docstring)."""

    def __init__(self, shards: ShardSet, config: ClientConfig) -> None:
        self.shards = shards
        self.config = config
        self.lease = ShardedLease(shards)
        self.pending: dict[int, Pending] = {}
        """This trainer's unanswered requests by rollout id (the newest attempt of each)."""
        self._rotation = 0
        shards.on_lost.append(self._resubmit_from)
        shards.on_rejoin.append(self._join)

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self.shards.start(self._join)

    @staticmethod
    def _join(shard: Shard) -> None:
        shard.rollouts.start()

    def stop(self) -> None:
        self.shards.stop()
        for shard in self.shards.shards:
            if not shard.up:
                abandon(shard.client)
            try:
                shard.rollouts.stop()
            except SHARD_ERRORS as exc:
                log.info("shard %d: %s", shard.index, exc)
            shard.client.close()

    # --- requests -----------------------------------------------------------------------
    def request_id(self, run_id: str, rollout_id: int, attempt: int = 1) -> str:
        return self.shards.shards[0].rollouts.request_id(run_id, rollout_id, attempt)

    def _pick(self, avoid: int | None = None) -> Shard:
        live = [s for s in self.shards.require_live() if s.index != avoid] or self.shards.require_live()
        load = {s.index: 0 for s in live}
        for p in self.pending.values():
            if p.shard in load:
                load[p.shard] += 1
        self._rotation += 1
        return min(live, key=lambda s: (load[s.index], (s.index - self._rotation) % len(self.shards.shards)))

    def request(self, rollout_id: int, request_id: str, *, timeout_s: float | None = None,
                returned: list[dict[str, Any]] | None = None) -> RolloutRequest:
        self.shards.handle()
        while True:
            shard = self._pick()
            try:
                request = shard.rollouts.request(rollout_id, request_id, timeout_s=timeout_s, returned=returned)
            except SHARD_ERRORS as exc:
                self.shards.suspend(shard, exc)
                continue
            self._note(rollout_id, shard, request)
            return request

    def _note(self, rollout_id: int, shard: Shard, request: RolloutRequest) -> None:
        self.pending[rollout_id] = Pending(shard.index, request)
        stats = self.shards.stats.per_shard_requests
        stats[shard.index] = stats.get(shard.index, 0) + 1

    def _resubmit_from(self, lost: Shard) -> None:
        """The requests in flight on a lost shard, unchanged (a fresh deadline if theirs is near), elsewhere; with
        no shard up, they wait for one to come back (``poll`` moves them then)."""
        held = {b.request_id for b in lost.rollouts.buffered()}  # their batches are here already
        moved = []
        for rollout_id, p in sorted(self.pending.items()):
            if p.shard != lost.index or p.request.request_id in held:
                continue
            if not any(s.up for s in self.shards.shards):
                log.error("no Redis shard is up for request %s: it waits for one to come back", p.request.request_id)
                return
            request = p.request
            remaining = request.remaining_s()
            if remaining is not None and remaining < self.config.rollout.timeout_s / 2:
                request = replace(request, deadline_ms=now_ms() + int(self.config.rollout.timeout_s * 1000))
            while True:
                target = self._pick(avoid=lost.index)
                try:
                    target.rollouts.lease.verify()
                    target.rollouts.submitter.submit(request)
                except SHARD_ERRORS as exc:
                    self.shards.suspend(target, exc)  # another shard, or this one once it answers again
                    if not any(s.up for s in self.shards.shards):
                        return
                    continue
                break
            self._note(rollout_id, target, request)
            self.shards.stats.resubmitted += 1
            moved.append(f"{request.request_id} -> shard {target.index}")
        if moved:
            log.warning("resubmitted %d request(s) of lost shard %d: %s", len(moved), lost.index, ", ".join(moved))

    # --- receiving ----------------------------------------------------------------------
    def poll(self, block_ms: int | None = None) -> int:
        self.shards.handle()
        stranded = {p.shard for p in self.pending.values() if not self.shards.shards[p.shard].up}
        for index in stranded:  # lost while no other shard was up: moved now that one may be
            if any(s.up for s in self.shards.shards):
                self._resubmit_from(self.shards.shards[index])
        live = self.shards.live()
        if not live:
            time.sleep((block_ms if block_ms is not None else self.config.block_ms) / 1000)
            return 0
        share = max(1, (block_ms if block_ms is not None else self.config.block_ms) // len(live))
        added = 0
        for shard in live:
            try:
                added += shard.rollouts.poll(share)
            except SHARD_ERRORS as exc:
                self.shards.suspend(shard, exc)
        return added

    def _batches(self) -> Iterator[tuple[Shard, ReceivedBatch]]:
        for shard in self.shards.shards:
            for batch in shard.rollouts.buffered():
                yield shard, batch

    def buffered(self) -> list[ReceivedBatch]:
        out = []
        for shard, batch in self._batches():
            batch.shard = shard.index
            out.append(batch)
        return sorted(out, key=lambda b: b.received_at)

    def take(self, predicate: Any = None) -> ReceivedBatch | None:
        """The first batch to arrive, on any shard (that ``predicate`` accepts)."""
        best: tuple[Shard, ReceivedBatch] | None = None
        for shard, batch in self._batches():
            if (predicate is None or predicate(batch)) and (best is None or batch.received_at < best[1].received_at):
                best = (shard, batch)
        if best is None:
            return None
        shard, chosen = best
        taken = shard.rollouts.take(lambda b: b is chosen)
        assert taken is chosen
        taken.shard = shard.index
        return taken

    def refused(self) -> list[ReceivedBatch]:
        out = []
        for shard in self.shards.shards:
            for batch in shard.rollouts.refused():
                batch.shard = shard.index
                out.append(batch)
        return out

    def refuse(self, batch: ReceivedBatch, reason: str) -> None:
        shard = self.shards.shards[batch.shard]
        if shard.up and not shard.suspect:
            try:
                shard.rollouts.refuse(batch, reason)
                return
            except SHARD_ERRORS as exc:
                self.shards.suspend(shard, exc)
        log.warning("batch %s of shard %d, which does not answer, refused (%s): not dead-lettered there",
                    batch.batch_id, shard.index, reason)

    # --- acknowledging ------------------------------------------------------------------
    def ack(self, batch: ReceivedBatch, *, staleness: int, accepted: bool, reason: str = "") -> None:
        p = self.pending.get(batch.rollout_id)
        if p is not None and p.request.request_id == batch.request_id:
            del self.pending[batch.rollout_id]
        shard = self.shards.shards[batch.shard]
        if shard.up and not shard.suspect:
            try:
                shard.rollouts.ack(batch, staleness=staleness, accepted=accepted, reason=reason)
                return
            except SHARD_ERRORS as exc:
                self.shards.suspend(shard, exc)
        self.shards.stats.acks_lost += 1
        log.warning("batch %s came from shard %d, which does not answer: its ack is not recorded there (if the shard "
                    "comes back with its data, the batch is delivered again and skipped as done)", batch.batch_id,
                    shard.index)

    def announce(self, stream: str, event: Event, idempotency_key: str) -> None:
        """Publish ``event`` on every live shard, bound to the lease there."""
        for shard in self.shards.require_live():
            try:
                shard.rollouts.announce(stream, event, idempotency_key)
            except SHARD_ERRORS as exc:
                self.shards.suspend(shard, exc)


class ShardedWeights:
    """``WeightPublisher``'s interface over every shard: written once, announced on each live shard."""

    def __init__(self, shards: ShardSet, policy: str, weights_root: str, *, keep_versions: int = 4) -> None:
        self.shards = shards
        self.policy = policy
        self.root = weights_root
        self.keep_versions = keep_versions
        self._published: list[int] = []
        self._latest = -1
        shards.on_rejoin.append(self._catch_up)

    def _each(self, fn: Callable[[WeightPublisher], Any]) -> list[Any]:
        out = []
        for shard in self.shards.require_live():
            try:
                out.append(fn(shard.weights))
            except SHARD_ERRORS as exc:
                self.shards.suspend(shard, exc)
        self.shards.require_live()
        return out

    def adopt(self, current: int) -> None:
        self._latest = current
        self._each(lambda w: w.adopt(current))

    def save(self, model: Any, version: int, **kwargs: Any) -> Any:
        for shard in self.shards.require_live():  # one writer: the first live shard's (its lease guards the rename)
            try:
                return shard.weights.save(model, version, **kwargs)
            except SHARD_ERRORS as exc:
                self.shards.suspend(shard, exc)
        raise BusUnavailable("every Redis shard of this trainer is lost: version not saved")

    def publish(self, model: Any | None, version: int, **kwargs: Any) -> Published:
        self.shards.handle()
        if model is not None:
            self.save(model, version, **kwargs)
        published = self._each(lambda w: w.publish(None, version))
        self._latest = max(self._latest, version)
        self._published.append(version)
        self._prune()
        return published[0]

    def _catch_up(self, shard: Shard) -> None:
        """A shard back after a loss: its engines get the current version."""
        shard.weights.adopt(self._latest)
        if self._latest >= 0 and version_dir(self.root, self.policy, self._latest).is_dir():
            shard.weights.publish(None, self._latest)

    def serving_version(self) -> int:
        return min(self._each(lambda w: w.serving_version()))

    def published_version(self) -> int:
        return min(self._each(lambda w: w.published_version()))

    def wait_engines(self, timeout_s: float) -> None:
        self._each(lambda w: w.wait_engines(timeout_s))

    def wait_serving(self, version: int, timeout_s: float, after_id: str = "0") -> float:
        """Until every live shard serves ``version`` (the entry id is each shard's own: followed from its start)."""
        started = time.monotonic()
        for shard in self.shards.require_live():
            remaining = max(0.001, timeout_s - (time.monotonic() - started))
            try:
                shard.weights.wait_serving(version, remaining)
            except ServingTimeout as exc:
                raise ServingTimeout(f"shard {shard.index}: {exc}") from None
            except SHARD_ERRORS as exc:
                self.shards.suspend(shard, exc)
        return time.monotonic() - started

    def _prune(self) -> None:
        """Delete versions beyond the newest ``keep_versions`` older than what every live shard serves."""
        if self.keep_versions <= 0 or len(self._published) <= self.keep_versions:
            return
        try:
            served = self.serving_version()
        except PROBE_ERRORS:
            return
        newest = set(sorted(self._published)[-self.keep_versions:])
        for old in sorted(self._published):
            if old not in newest and old < served:
                self._published.remove(old)
                shutil.rmtree(version_dir(self.root, self.policy, old), ignore_errors=True)


def sharded(urls: list[str], keys: Keys, config: ClientConfig, producer: Producer, *, weights_root: str,
            keep_versions: int, settings: ShardSettings | None = None) -> tuple[ShardedClient, ShardedWeights]:
    """The trainer's client and weight publisher over the shards at ``urls`` (each shard's publisher keeps every
    version: deleting is ``ShardedWeights``' job, once every live shard is done with one)."""
    def factory(index: int, url: str, client: Redis) -> tuple[RolloutClient, WeightPublisher]:
        rollouts = RolloutClient(client, keys, config, producer)
        weights = WeightPublisher(client, keys, config.policy, weights_root, producer, keep_versions=0,
                                  lease=rollouts.lease)
        return rollouts, weights

    shards = ShardSet(urls, keys, factory, settings)
    return ShardedClient(shards, config), ShardedWeights(shards, config.policy, weights_root,
                                                         keep_versions=keep_versions)




__all__ = ["SHARD_ERRORS", "Shard", "ShardSet", "ShardSettings", "ShardedClient", "ShardedWeights", "sharded"]
