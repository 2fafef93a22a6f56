"""Weight updates: from ``WeightsPublished`` to ``WeightVersionServing``.

``submit`` checks a publication (ordering, where it can be served, then the directory:
root, manifest, every file's sha256, finite values, shapes or adapter fit) and either
refuses it with ``WeightUpdateFailed`` (engines keep serving the old version and the
event says why) or makes it the policy's target. One worker per policy converges the
serving engines of the policy's pool to the target: each round pushes the target to
every one that does not run it, in parallel, then announces. Full weights: pause with
the configured mode, ``/update_weights_from_disk`` (with ``flush_cache`` off under an
``in_place`` pause, whose held requests SGLang cannot flush; they are then retracted and
``/flush_cache`` empties the prefix cache of the old weights' KV), continue. An adapter:
``/load_lora_adapter`` under ``<policy>@v<version>``, the registry switched to the new
name, then the old name unloaded in the background (SGLang lets requests that use it
finish; no gap, no pause). Rounds always read the newest target, so a newer version
supersedes an older one and the older one is never applied after it. Policies have
separate workers, so one policy's push does not stall another's; an engine's lock
keeps two pushes to one engine from interleaving.

Pools: a full-weight policy is served by the pool whose base it is (``--num-engines``
for the base policy, ``--pool POLICY=N`` for others); an adapter policy by the base
pool. A publication that no pool can serve is refused with the reason.

The policy record (``events.registry.PolicyRecord``) names the weights engines must run:
``published``/``uri``/``sha256`` are written when a version is accepted (and rewritten if
it is rolled back), ``serving`` when every serving engine runs it. Before any publication,
the base policy has a launch record (``published`` = the launch version, no uri), written
at startup when the registry has none; ``announce_launch`` sets its ``serving`` once every
serving engine runs the launch version. A restarted controller seeds its targets from the
records that name weights, and re-reads its own unacknowledged ``WeightsPublished``
entries: an entry is acknowledged only once its update settled.

Per-engine outcomes: ``applied``; ``rejected`` (the engine answered 4xx and kept its
old weights, or answered 5xx to an adapter load and still generates on its base weights: the
version is refused, not the engine); ``failed`` (no answer, any other 5xx, timeout: the engine
leaves the serving set through the unhealthy -> restart path). If every engine rejects a version and none
runs it, the target rolls back to the last good one and engines stay as they were; if
some took it, the ones that refused leave the serving set rather than serve old
weights unannounced.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rollout_bus.controller.broadcast import WeightBroadcast
from rollout_bus.controller.core import Core
from rollout_bus.controller.state import EngineHandle
from rollout_bus.controller.versions import Target
from rollout_bus.controller.weights import BadWeights, reference_shapes, verify, writer_problem
from rollout_bus.engine.http_client import EngineHTTPError
from rollout_bus.events.registry import EngineState, PolicyRecord, adapter_name
from rollout_bus.events.schema import (
    WeightsApplied,
    WeightsPublished,
    WeightUpdateFailed,
    WeightUpdateStarted,
    WeightVersionServing,
)
from rollout_bus.lm.files import Shapes

log = logging.getLogger(__name__)

Status = Literal["applied", "rejected", "failed", "skipped"]
FailHook = Callable[[EngineHandle, str], Awaitable[None]]


@dataclass(frozen=True)
class EngineOutcome:
    engine_id: str
    status: Status
    reason: str = ""
    duration_s: float = 0.0


MISSING_FIRST_DELAY_S = 0.25
MISSING_MAX_DELAY_S = 4.0
"""Backoff between looks at a published directory not visible yet (see ``weights_missing_wait_s``)."""

ADAPTER_RETIRE_DELAY_S = 1.0
"""How long an old adapter name stays loaded after the registry names the new one (executors re-read
the registry every 0.5 s; one that still sends the old name after this retries on a 400)."""


def lags(h: EngineHandle, target: Target) -> bool:
    """Whether the engine runs an older version of the target's policy (or none): engines never go back."""
    current = h.record.versions.get(target.policy)
    return current is None or current < target.version


def keeps(h: EngineHandle, policy: str) -> str:
    version = h.record.versions.get(policy)
    return f"engine keeps serving version {version}" if version is not None else (
        f"engine keeps serving no weights of {policy!r}")


class WeightUpdater:
    def __init__(self, core: Core, on_failed: FailHook) -> None:
        self.core = core
        self.on_failed = on_failed
        self.root = Path(core.config.weights_root)
        self.reference: Shapes | None = None
        self._wake: dict[str, asyncio.Event] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._entries: dict[str, list[tuple[int, str | None]]] = {}
        self._served: dict[str, set[int]] = {}
        self._running: set[str] = set()
        self.inflight: set[str] = set()
        self.broadcast: WeightBroadcast | None = WeightBroadcast(core) if core.config.weight_sync == "broadcast" else None
        """Full weights by collective where the trainer offers them (``--weight-sync broadcast``)."""
        self.after_applied: Callable[[list[EngineHandle]], Awaitable[object]] | None = None
        """Runs on the engines that applied a version, before it is announced (the weight check)."""

    def load_reference(self) -> None:
        try:
            self.reference = reference_shapes(self.core.config.model_path)
        except BadWeights as exc:
            log.warning("no reference shapes from %s: %s", self.core.config.model_path, exc.reason)

    # --- intake ------------------------------------------------------------------------------
    async def submit(self, event: WeightsPublished, entry_id: str | None = None, *,
                     first_seen: float | None = None) -> str | None:
        """Take a publication; returns the reason it was refused, None when it became the target (or is
        looked for again).

        A directory this host does not see yet is looked for again, with backoff, for up to
        ``weights_missing_wait_s`` (the entry stays unacknowledged meanwhile): a shared mount may be late.
        Any refusal made here is final, and lets the version be announced again."""
        book = self.core.book
        reason = book.stale_reason(event.policy, event.version)
        current = book.target(event.policy)
        if reason is not None and current is not None and (current.version, current.sha256) == (
                event.version, event.sha256.lower()):
            log.info("weights %s v%d are already the target (a redelivery)", event.policy, event.version)
        elif reason is not None:
            log.info("ignoring weights %s v%d: %s", event.policy, event.version, reason)
            await self._refuse(event, reason, per_engine=False)
        else:
            problem = writer_problem(event.producer, event.policy, await self.core.bus.trainer_lease_owner(event.policy))
            try:
                if problem is not None:
                    raise BadWeights(problem)
                target = await asyncio.to_thread(verify, event.policy, event.version, event.uri, event.sha256,
                                                 self.root, self.reference)
                if event.group_address and target.kind == "full":  # offered by collective too
                    target = dataclasses.replace(target, group_address=event.group_address,
                                                 group_backend=event.group_backend,
                                                 buckets=tuple(tuple(b) for b in event.buckets))
                self.check_servable(target)
            except BadWeights as exc:
                reason = exc.reason
                if exc.transient and self._look_again(event, entry_id, first_seen, reason):
                    return None
                log.warning("refusing weights %s v%d: %s", event.policy, event.version, reason)
                # the holder may announce the version again once its directory is fixed; a publication from
                # another writer leaves the holder's own (its dedupe key) alone
                await self._refuse(event, reason, per_engine=True, forget=problem is None)
            else:
                book.accept(target)
                log.info("weights %s v%d accepted (%s)", event.policy, event.version, target.engine_path)
                await self._record_target(event.policy)
                self._entries.setdefault(event.policy, []).append((event.version, entry_id))
                self.wake(event.policy)
                return None
        if entry_id is not None:
            await self._ack(entry_id)
        return reason

    def _look_again(self, event: WeightsPublished, entry_id: str | None, first_seen: float | None,
                    reason: str) -> bool:
        """Submit ``event`` again after a backoff (0.25 s doubling, at most 4 s) while it has waited less than
        ``weights_missing_wait_s``; False when its time is up."""
        now = time.monotonic()
        first = now if first_seen is None else first_seen
        waited, limit = now - first, self.core.config.weights_missing_wait_s
        if waited >= limit:
            return False
        delay = min(MISSING_MAX_DELAY_S, max(MISSING_FIRST_DELAY_S, waited), limit - waited)
        log.info("weights %s v%d not visible yet (%s); looking again in %.2fs (waited %.1fs of %.1fs)",
                 event.policy, event.version, reason, delay, waited, limit)

        async def again() -> None:
            await asyncio.sleep(delay)
            await self.submit(event, entry_id, first_seen=first)
        self.core.spawn(again(), f"weights-{event.policy}-v{event.version}-again")
        return True

    def check_servable(self, target: Target) -> None:
        """``BadWeights`` when no engine pool can serve ``target`` as published."""
        cfg = self.core.config
        pools = self.core.pool_policies()
        if target.kind == "full" and target.policy not in pools:
            raise BadWeights(
                f"policy {target.policy!r} publishes full weights, but no engine pool runs it as its base: start "
                f"the controller with --pool {target.policy}=N (engines of its own), or publish a LoRA adapter "
                f"(served on the {cfg.base_policy!r} engines)")
        if target.kind == "adapter" and target.policy in pools:
            raise BadWeights(f"policy {target.policy!r} is the base of an engine pool: publish full weights for it, "
                             "not an adapter")
        if target.kind == "adapter" and not cfg.enable_lora:
            raise BadWeights(f"policy {target.policy!r} publishes a LoRA adapter, but the engines run without "
                             "LoRA: start the controller with --enable-lora")

    async def _refuse(self, event: WeightsPublished, reason: str, per_engine: bool, *, forget: bool = False) -> None:
        self.core.metrics.weight_update_failures.labels(event.policy, "refused").inc()
        if forget:
            await self.core.bus.forget_publication(event.policy, event.version)
        engines = self.core.serving_members(event.policy) if per_engine else []
        for h in engines:
            await self.core.bus.weights_event(self.core.event(
                WeightUpdateFailed, policy=event.policy, version=event.version, engine_id=h.engine_id,
                reason=f"{reason}; {keeps(h, event.policy)}"))
        if not engines:
            await self.core.bus.weights_event(self.core.event(
                WeightUpdateFailed, policy=event.policy, version=event.version, engine_id="", reason=reason))

    # --- workers -------------------------------------------------------------------------------
    def wake(self, policy: str) -> None:
        self._wake.setdefault(policy, asyncio.Event()).set()
        if policy not in self._workers or self._workers[policy].done():
            self._workers[policy] = self.core.spawn(self._worker(policy), f"weights-{policy}")

    def wake_all(self) -> None:
        for policy in self.core.book.targets():
            self.wake(policy)

    async def joined(self) -> None:
        """Engines began serving: converge every policy to its target, and announce the launch weights."""
        self.wake_all()
        await self.announce_launch()

    async def _worker(self, policy: str) -> None:
        wake = self._wake[policy]
        while True:
            await wake.wait()
            wake.clear()
            self._running.add(policy)
            try:
                await self.round(policy)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("weight update round of %s failed; retrying in 1s", policy)
                await asyncio.sleep(1.0)
                wake.set()
            finally:
                self._running.discard(policy)

    def idle(self) -> bool:
        """No round running or due, for any policy."""
        return not self._running and not any(w.is_set() for w in self._wake.values())

    async def round(self, policy: str) -> list[EngineOutcome]:
        """Push the policy's current target to every serving engine that lacks it, then announce."""
        target = self.core.book.target(policy)
        if target is None:
            return []
        behind = [h for h in self.core.serving_members(policy) if lags(h, target)]
        outcomes: list[EngineOutcome] = []
        if behind:
            await self.core.bus.weights_event(self.core.event(
                WeightUpdateStarted, policy=policy, version=target.version,
                engine_ids=[h.engine_id for h in behind]))
            started = time.perf_counter()
            if self.broadcast is not None and self.broadcast.takes(target):
                outcomes = await self.broadcast_all(target, behind)
            else:
                outcomes = await self.apply_all(target, behind)
            applied = [h for h, o in zip(behind, outcomes, strict=True) if o.status == "applied"]
            if applied and self.after_applied is not None:
                await self.after_applied(applied)
            await self._settle(target, behind, outcomes, time.perf_counter() - started)
        await self.announce(policy)
        return outcomes

    async def apply_all(self, target: Target, engines: list[EngineHandle], *,
                        parallel: bool = True) -> list[EngineOutcome]:
        """Push ``target`` to ``engines``: all at once, or one after another (for comparison)."""
        if parallel:
            return list(await asyncio.gather(*(self._update_engine(h, target) for h in engines)))
        return [await self._update_engine(h, target) for h in engines]

    async def _settle(self, target: Target, engines: list[EngineHandle], outcomes: list[EngineOutcome],
                      elapsed_s: float) -> None:
        by_status: dict[str, list[EngineOutcome]] = {}
        for outcome in outcomes:
            by_status.setdefault(outcome.status, []).append(outcome)
        handles = {h.engine_id: h for h in engines}
        anyone_runs = any(h.record.versions.get(target.policy) == target.version
                          for h in self.core.serving_members(target.policy))
        for outcome in by_status.get("failed", []):
            self.core.metrics.weight_update_failures.labels(target.policy, "engine_failed").inc()
            await self.on_failed(handles[outcome.engine_id], f"weight update failed: {outcome.reason}")
        rejected = by_status.get("rejected", [])
        if rejected:
            self.core.metrics.weight_update_failures.labels(target.policy, "rejected").inc(len(rejected))
        proven = self.core.book.good(target.policy) == target  # engines ran it before: they are the problem
        if rejected and (anyone_runs or proven):
            for outcome in rejected:
                await self.on_failed(handles[outcome.engine_id],
                                     f"refused weights v{target.version} that engines run or ran: {outcome.reason}")
        elif rejected and not by_status.get("applied"):
            good = self.core.book.rollback(target.policy, target.version)
            log.warning("every engine refused %s v%d; back to %s", target.policy, target.version,
                        f"v{good.version}" if good else "the launch weights")
            await self._record_target(target.policy)
        outcome_kind = "applied" if by_status.get("applied") else "rejected" if rejected else "other"
        self.core.metrics.weight_update_seconds.labels(target.policy, outcome_kind).observe(elapsed_s)

    def _skip_reason(self, h: EngineHandle, target: Target) -> str | None:
        if h.state != EngineState.SERVING:
            return f"engine is {h.state.value}"
        if self.core.book.superseded(target.policy, target.version):
            return "superseded by a newer version"
        if not lags(h, target):
            return "already runs it (or a newer one)"
        return None

    async def _update_engine(self, h: EngineHandle, target: Target) -> EngineOutcome:
        async with self.core.operate(h):
            skip = self._skip_reason(h, target)
            if skip is not None:
                return EngineOutcome(h.engine_id, "skipped", skip)
            return await self.push(h, target, pause=True)

    async def broadcast_all(self, target: Target, engines: list[EngineHandle]) -> list[EngineOutcome]:
        """Push full weights to ``engines`` together through their weight-update group (``controller.broadcast``),
        by disk where the collective fails; every engine's lock is held meanwhile."""
        assert self.broadcast is not None
        outcomes: dict[str, EngineOutcome] = {}
        async with contextlib.AsyncExitStack() as stack:
            for h in sorted(engines, key=lambda e: e.engine_id):  # one order: no two rounds wait on each other
                await stack.enter_async_context(self.core.operate(h))
            ready = []
            for h in engines:
                skip = self._skip_reason(h, target)
                if skip is not None:
                    outcomes[h.engine_id] = EngineOutcome(h.engine_id, "skipped", skip)
                else:
                    ready.append(h)
            for h in ready:
                h.record.updating[target.policy] = target.version
                await self.core.save(h)
            started = time.perf_counter()
            try:
                results = await self.broadcast.push_all(target, ready) if ready else {}
            finally:
                for h in ready:
                    h.record.updating.pop(target.policy, None)
            duration = time.perf_counter() - started
            for h in ready:
                status, reason = results.get(h.engine_id, ("failed", "no outcome"))
                outcomes[h.engine_id] = await self._record(h, target, status, reason, duration)  # type: ignore[arg-type]
        return [outcomes[h.engine_id] for h in engines]

    async def push(self, h: EngineHandle, target: Target, *, pause: bool) -> EngineOutcome:
        """Load ``target`` on one engine; the caller holds the engine's lock."""
        h.record.updating[target.policy] = target.version
        await self.core.save(h)
        started = time.perf_counter()
        try:
            if target.kind == "adapter":
                status, reason = await self._load_adapter(h, target)
            else:
                status, reason = await self._load_weights(h, target, pause=pause)
        finally:
            h.record.updating.pop(target.policy, None)
        return await self._record(h, target, status, reason, time.perf_counter() - started)

    async def _record(self, h: EngineHandle, target: Target, status: Status, reason: str,
                      duration: float) -> EngineOutcome:
        """The engine's outcome of a push: its record, ``WeightsApplied`` or ``WeightUpdateFailed``."""
        if status == "applied":
            h.record.versions[target.policy] = target.version
            old = h.record.adapters.get(target.policy)
            if target.kind == "adapter":
                h.record.adapters[target.policy] = adapter_name(target.policy, target.version)
            await self.core.bus.weights_event(self.core.event(
                WeightsApplied, policy=target.policy, version=target.version, engine_id=h.engine_id,
                duration_ms=duration * 1000), h.record)
            log.info("engine %s runs %s v%d (%.0f ms)", h.engine_id, target.policy, target.version,
                     duration * 1000)
            if old is not None and old != h.record.adapters.get(target.policy):
                self.core.spawn(self._retire_adapter(h, old), f"retire-{h.engine_id}-{old}")
        else:
            if status == "rejected":
                reason = f"engine refused the weights: {reason}; {keeps(h, target.policy)}"
            await self.core.bus.weights_event(self.core.event(
                WeightUpdateFailed, policy=target.policy, version=target.version, engine_id=h.engine_id,
                reason=reason), h.record)
            log.warning("engine %s: %s v%d %s: %s", h.engine_id, target.policy, target.version, status, reason)
        return EngineOutcome(h.engine_id, status, reason, duration)

    async def _load_weights(self, h: EngineHandle, target: Target, *, pause: bool) -> tuple[Status, str]:
        """Pause, ``/update_weights_from_disk``, continue. Under an ``in_place`` pause the held requests'
        cache cannot be flushed, so none is asked for; if SGLang still answers that the weights were
        loaded but not flushed, they are in: the version is set with ``/update_weight_version``.

        The prefix cache still holds KV the old weights computed, and the held requests hold more:
        before generation continues they are retracted (a ``retract`` pause over the ``in_place`` one:
        their KV is recomputed under the new weights when they resume) and ``/flush_cache`` empties the
        cache, so no request is ever served from the old weights' KV under the new version."""
        cfg = self.core.config
        client = h.client
        status: Status = "applied"
        reason = ""
        try:
            if pause:
                await client.pause_generation(cfg.pause_mode, timeout_s=cfg.request_timeout_s)
            try:
                await client.update_weights_from_disk(
                    target.engine_path, weight_version=target.version,
                    flush_cache=not (pause and cfg.pause_mode == "in_place"), timeout_s=cfg.update_timeout_s)
            except EngineHTTPError as exc:
                if not exc.unflushed:
                    status, reason = ("rejected" if exc.rejected else "failed"), exc.message
                else:
                    log.info("engine %s loaded %s v%d without a cache flush; setting its version",
                             h.engine_id, target.policy, target.version)
                    await client.update_weight_version(target.version, abort_all_requests=False,
                                                       timeout_s=cfg.request_timeout_s)
            if pause and cfg.pause_mode == "in_place" and status == "applied":
                await client.pause_generation("retract", timeout_s=cfg.request_timeout_s)
                await client.flush_cache(timeout_s=cfg.request_timeout_s)
            if pause:
                await client.continue_generation(timeout_s=cfg.request_timeout_s)
        except EngineHTTPError as exc:
            status, reason = "failed", f"{exc.path}: {exc.message}"
        return status, reason

    async def _load_adapter(self, h: EngineHandle, target: Target) -> tuple[Status, str]:
        """Load the target's adapter. A 4xx is a refusal of this version; so is a 5xx from an engine that still
        generates on its base weights right after (the adapter broke, not the engine, which a restart would
        not mend: it would load the same adapter again). No reply, or no generation after, is a failure."""
        name = adapter_name(target.policy, target.version)
        try:
            await h.client.load_lora_adapter(name, target.engine_path, timeout_s=self.core.config.update_timeout_s)
        except EngineHTTPError as exc:
            if exc.rejected and "already loaded" in exc.message:
                return "applied", ""  # loaded before a controller change: the name pins the version
            if exc.rejected:
                return "rejected", exc.message
            if not exc.transport and not exc.timed_out and await self._still_generates(h):
                return "rejected", (f"HTTP {exc.status} loading adapter {name} ({exc.message}); the engine still "
                                    "generates on its base weights")
            return "failed", exc.message
        return "applied", ""

    async def _still_generates(self, h: EngineHandle) -> bool:
        try:
            await h.client.health_generate(timeout_s=self.core.config.health_timeout_s)
        except EngineHTTPError as exc:
            log.warning("engine %s does not generate after a failed adapter load: %s", h.engine_id, exc.message)
            return False
        return True

    async def _retire_adapter(self, h: EngineHandle, name: str) -> None:
        """Unload an adapter name the registry no longer gives out (SGLang finishes its requests first)."""
        await asyncio.sleep(ADAPTER_RETIRE_DELAY_S)
        if name in h.record.adapters.values():
            return
        try:
            await h.client.unload_lora_adapter(name, timeout_s=self.core.config.update_timeout_s)
            log.info("engine %s unloaded adapter %s", h.engine_id, name)
        except EngineHTTPError as exc:
            log.warning("engine %s: unloading adapter %s failed: %s", h.engine_id, name, exc.message)

    async def catch_up(self, h: EngineHandle) -> EngineOutcome | None:
        """Give an engine that is not serving yet the target of every policy; None when all applied."""
        for _ in range(5):
            behind = [t for t in self.core.book.targets().values()
                      if self.core.pool_of(t.policy) == h.record.base_policy and lags(h, t)]
            if not behind:
                return None
            for target in behind:
                outcome = await self.push(h, target, pause=False)
                if outcome.status == "rejected" and not self._vouched(target):
                    await self._give_up(target, f"engine {h.engine_id} refused it: {outcome.reason}")
                elif outcome.status != "applied":
                    return outcome
        return EngineOutcome(h.engine_id, "failed", "targets kept changing while catching up")

    def _vouched(self, target: Target) -> bool:
        """Whether engines ran ``target`` (or run it now): then one that refuses it is the problem, not the version."""
        return self.core.book.good(target.policy) == target or any(
            h.record.versions.get(target.policy) == target.version for h in self.core.serving_members(target.policy))

    async def _give_up(self, target: Target, reason: str) -> None:
        """Refuse a version no engine ever ran that an engine coming up refused: the engine serves without it
        (relaunching it would only load the same version again). As after every engine refused it in a round,
        the version stays accepted: a newer one must follow."""
        good = self.core.book.rollback(target.policy, target.version)
        log.warning("%s v%d refused (%s); back to %s", target.policy, target.version, reason,
                    f"v{good.version}" if good else "the launch weights")
        await self._record_target(target.policy)
        await self.core.bus.weights_event(self.core.event(
            WeightUpdateFailed, policy=target.policy, version=target.version, engine_id="", reason=reason))

    # --- announcing ------------------------------------------------------------------------------
    async def announce(self, policy: str) -> None:
        """``WeightVersionServing`` once every serving engine runs the target; ack what it settles."""
        target = self.core.book.target(policy)
        if target is None:
            return
        serving = self.core.serving_members(policy)
        behind = [h for h in serving if h.record.versions.get(policy) != target.version]
        if behind:
            lagging = [h for h in behind if lags(h, target)]
            if lagging:  # a new round waits for each engine's lock, then pushes
                self._wake.setdefault(policy, asyncio.Event()).set()
            else:
                log.warning("engines %s run a newer %s than the target v%d; not pushing an older version",
                            [h.engine_id for h in behind], policy, target.version)
            return
        self.core.book.mark_good(target)
        record = self.core.policies.setdefault(policy, PolicyRecord(policy))
        if serving and record.serving != target.version:
            record.serving = target.version
            await self.core.bus.put_policy(record)
            await self.core.bus.weights_event(self.core.event(
                WeightVersionServing, policy=policy, version=target.version,
                engine_ids=sorted(h.engine_id for h in serving)), durable=True)
            self._served.setdefault(policy, set()).add(target.version)
            log.info("all %d serving engines run %s v%d", len(serving), policy, target.version)
        if not self._wake.setdefault(policy, asyncio.Event()).is_set():
            await self._settle_entries(target)

    async def announce_launch(self) -> None:
        """A pool's launch record says ``serving`` once every serving engine of the pool runs the launch version.

        A launch record names a version but no weights file (``_seed_versions`` writes it when the registry
        has none); once a publication becomes the target, ``announce`` writes ``serving`` instead.
        """
        for policy in sorted(self.core.pool_policies()):
            record = self.core.policies.get(policy)
            if (record is None or record.uri or record.serving >= record.published
                    or self.core.book.target(policy) is not None):
                continue
            serving = self.core.serving_members(policy)
            if serving and all(h.record.versions.get(policy) == record.published for h in serving):
                record.serving = record.published
                await self.core.bus.put_policy(record)
                log.info("all %d serving engines run the launch weights of %s (v%d)", len(serving), policy,
                         record.published)

    async def _record_target(self, policy: str) -> None:
        """The policy record names the weights engines must run: ``published``, ``uri``, ``sha256``."""
        target = self.core.book.target(policy)
        record = self.core.policies.setdefault(policy, PolicyRecord(policy))
        if target is None:
            record.uri = record.sha256 = ""
        else:
            record.published, record.uri, record.sha256 = target.version, target.uri, target.sha256
        await self.core.bus.put_policy(record)

    async def _settle_entries(self, target: Target) -> None:
        """Ack every publication of the policy handled so far (applied, superseded or refused)."""
        entries = self._entries.pop(target.policy, [])
        served = self._served.pop(target.policy, set())
        for version, _entry_id in entries:
            if version < target.version and version not in served:
                await self.core.bus.weights_event(self.core.event(
                    WeightUpdateFailed, policy=target.policy, version=version, engine_id="",
                    reason=f"superseded by version {target.version} before every serving engine ran it"))
        entry_ids = [entry_id for _version, entry_id in entries if entry_id is not None]
        if entry_ids:  # one XACK for all of them, after their events
            await self._ack(*entry_ids)

    async def _ack(self, *entry_ids: str) -> None:
        self.inflight.difference_update(entry_ids)
        await self.core.bus.ack_weights(*entry_ids)
