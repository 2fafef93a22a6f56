"""The InferenceController service: miles' controller, speaking only through Redis.

Lifecycle: ``start()`` rebuilds the view (engine event log + registry + each engine's
``/model_info``; the base policy gets a launch record when the registry has none),
adopts live engines, replaces dead ones it launched, launches the missing ones, then
runs its loops: health checks, ``WeightsPublished`` intake,
offload/onload commands and the janitor (``events.janitor``: retention, payload sweep,
expired groups; reported as metrics and events). ``stop()`` ends the loops and, unless told to keep them,
stops the engines it launched. Only one instance per namespace should be started:
``controller.runner`` holds the lease that ensures it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from rollout_bus.controller.adapters import AdapterReconciler
from rollout_bus.controller.backends import ProcessHandle, make_backend, pid_alive
from rollout_bus.controller.bus import ControllerBus
from rollout_bus.controller.cells import Cells
from rollout_bus.controller.checks import WeightChecker
from rollout_bus.controller.config import OFFLOAD_TAGS, ControllerConfig
from rollout_bus.controller.core import Core
from rollout_bus.controller.health import check_all
from rollout_bus.controller.launched import Launched
from rollout_bus.controller.lifecycle import Lifecycle, adopted_engine_id
from rollout_bus.controller.metrics import ControllerMetrics
from rollout_bus.controller.recovery import KnownEngine, fold_engine_log, merge_registry
from rollout_bus.controller.state import EngineHandle
from rollout_bus.controller.updates import WeightUpdater
from rollout_bus.controller.versions import Target
from rollout_bus.controller.weights import BadWeights, verify
from rollout_bus.engine.http_client import EngineHTTPError, close_shared_session
from rollout_bus.events.connection import Redis
from rollout_bus.events.errors import Fenced, InvalidRequest
from rollout_bus.events.janitor import Janitor, JanitorConfig, JanitorReport
from rollout_bus.events.names import Keys
from rollout_bus.events.registry import EngineState, PolicyRecord
from rollout_bus.events.schema import (
    CheckWeights,
    CommandDone,
    EngineOffloaded,
    EngineOnloaded,
    EngineServing,
    EngineUnhealthy,
    OffloadEngines,
    OnloadEngines,
    Producer,
    ScaleEngines,
    WeightsChecked,
    WeightsPublished,
)

log = logging.getLogger(__name__)
S = EngineState


class InferenceController:
    # configuration
    config: ControllerConfig
    # wiring, built in __init__
    core: Core
    updater: WeightUpdater
    lifecycle: Lifecycle
    # running
    metrics_port: int | None
    _loops: list[asyncio.Task[None]]
    _stopping: asyncio.Event | None

    def __init__(self, config: ControllerConfig, client: Redis, *,
                 metrics: ControllerMetrics | None = None, fence: int | None = None, holder: str | None = None,
                 launched: Launched | None = None) -> None:
        """``fence``: the fencing token of the lease this instance holds (``controller.lease``); every
        registry write and engine call carries it. None (tests, one-off tools): unfenced. ``holder``: the
        lease's owner, so that the registry refuses an equal token from anyone else. ``launched``: the
        engines this process launched (``controller.launched``), shared by the services of one runner;
        default: those recorded in the log directory."""
        self.config = config.validate()
        keys = Keys(config.namespace)
        producer = Producer("controller", f"{config.instance}-{os.getpid()}")
        bus = ControllerBus(client, keys, producer, config.instance, fence=fence, holder=holder,
                           base_policy=config.base_policy)
        # no log directory given: a temporary one, removed again when the engines logging there are stopped
        self._temp_log_dir = not config.log_dir
        log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix=f"rollout-bus-engines-{config.namespace}-"))
        self.core = Core(config, bus, metrics or ControllerMetrics(), log_dir, fence=fence, launched=launched)
        self.lifecycle = Lifecycle(self.core, make_backend(config.backend, memory_saver=config.memory_saver),
                                   WeightUpdater(self.core, self._failed_in_update))
        self.updater = self.lifecycle.updater
        self.adapters = AdapterReconciler(self.core)
        self.checker = WeightChecker(self.core, self._failed_in_update)
        self.lifecycle.checker = self.checker
        self.cells = Cells(self.core, self.lifecycle)
        self.updater.after_applied = self._check_applied
        self.metrics_port = None
        self._loops = []
        self._stopping = None

    @property
    def engines(self) -> dict[str, EngineHandle]:
        return self.core.engines

    @property
    def fenced(self) -> asyncio.Event:
        """Set when a write was refused for an older fencing token: the runner steps this instance down."""
        return self.core.bus.fenced

    @property
    def fence_highest(self) -> int:
        """The highest fencing token an engine said it has seen when it refused this instance (0: none)."""
        return self.core.fence_highest

    # --- start / stop -------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self._stopping = asyncio.Event()
        if cfg.metrics_port is not None:
            self.metrics_port = self.core.metrics.serve(cfg.metrics_port)
        self.updater.load_reference()
        log_events, records, policies = await self.core.bus.snapshot()
        await self._seed_versions(policies)
        known = await self._with_launched(merge_registry(fold_engine_log(log_events), records))
        await self._reconcile_engines(known)
        await self.updater.joined()
        await self.core.bus.take_over()  # a predecessor's pending weights and commands, before the first read
        loops: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("health", self._health_loop), ("weights", self._weights_loop), ("commands", self._commands_loop)]
        if cfg.janitor_interval_s > 0:
            loops.append(("janitor", self._janitor_loop))
        self._loops = [asyncio.create_task(self._forever(name, loop), name=name) for name, loop in loops]
        log.info("controller up: %d engines (%s)", len(self.engines),
                 ", ".join(f"{h.engine_id}={h.state.value}" for h in self.engines.values()))

    async def stop(self, *, stop_engines: bool | None = None) -> None:
        if self._stopping is not None:
            self._stopping.set()
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        await self.core.cancel_tasks()
        engines_stopped = self.config.stop_engines_on_exit if stop_engines is None else stop_engines
        if engines_stopped:
            await asyncio.gather(*(self.lifecycle.stop(h, "controller shut down", kill=True)
                                   for h in self.engines.values() if h.managed and h.state != S.STOPPED))
        for h in self.engines.values():
            if h.process is not None:
                h.process.close_log()
        if engines_stopped and self._temp_log_dir:
            shutil.rmtree(self.core.log_dir, ignore_errors=True)
        self.core.bus.close(wait=stop_engines is not False)  # stepping down: a write stuck on Redis is fenced anyway
        self.core.metrics.close()
        await close_shared_session()

    async def wait_serving(self, timeout_s: float = 60.0, count: int | None = None) -> None:
        """Until ``count`` engines (default: all expected) serve; for scripts and tests."""
        want = self.config.total_engines if count is None else count
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(self.core.serving()) < want:
            if loop.time() > deadline:
                states = {h.engine_id: h.state.value for h in self.engines.values()}
                raise TimeoutError(f"{want} serving engines not reached in {timeout_s}s: {states}")
            await asyncio.sleep(0.05)

    # --- rebuilding the view ------------------------------------------------------------------
    async def _seed_versions(self, policies: dict[str, PolicyRecord]) -> None:
        """Seed the version book from the policy records; write the base policy's launch record if none.

        A record without a ``uri`` names no weights file (the launch record, or a target rolled back
        to the launch weights): it is never verified and seeds no target.
        """
        cfg = self.config
        for pool in sorted(self.core.pool_policies()):
            self.core.book.seed(pool, cfg.initial_version)
            if pool not in policies:
                launch = PolicyRecord(pool, published=cfg.initial_version)
                self.core.policies[pool] = launch
                await self.core.bus.put_policy(launch)
        bounds = cfg.max_sizes()
        for policy, record in policies.items():
            self.core.policies[policy] = record
            size = record.engines
            if policy in bounds and isinstance(size, int) and not isinstance(size, bool) and size >= 0:
                if size <= bounds[policy]:
                    self.core.sizes[policy] = size  # scaled at run time: that size, not the configured one
                else:
                    log.warning("pool %s was scaled to %d engines, above its bound of %d: keeping %d", policy, size,
                                bounds[policy], self.core.sizes[policy])
            if record.published < 0 or not record.uri:
                continue
            try:
                target: Target | None = await asyncio.to_thread(
                    verify, policy, record.published, record.uri, record.sha256, Path(cfg.weights_root),
                    self.updater.reference)
            except BadWeights as exc:
                log.warning("policy %s v%d from the registry is unusable now: %s", policy, record.published,
                            exc.reason)
                target = None
            if target is not None:
                try:
                    self.updater.check_servable(target)
                except BadWeights as exc:
                    log.warning("policy %s v%d from the registry cannot be served now: %s", policy,
                                record.published, exc.reason)
                    target = None
            self.core.book.seed(policy, record.published, target, proven=record.serving == record.published)

    async def _with_launched(self, known: dict[str, KnownEngine]) -> dict[str, KnownEngine]:
        """``known`` plus every engine this process launched that still runs and that neither the registry nor
        the engine log lists any more (Redis lost them): adopted like the others, or stopped if unwanted. One
        whose id the registry gives to another process is left over from before: it is stopped."""
        out = dict(known)
        for engine in self.core.launched.alive():
            listed = out.get(engine.engine_id)
            if listed is not None and listed.pid == engine.pid:
                continue
            if listed is not None:
                log.warning("engine %s: pid %d of ours is left over (the registry names pid %s): stopping it",
                            engine.engine_id, engine.pid, listed.pid)
                await ProcessHandle(engine.pid).stop(grace_s=5.0)
                self.core.launched.drop(engine.engine_id, engine.pid)
                continue
            log.warning("engine %s (pid %d, %s) runs but Redis no longer lists it: adopting it", engine.engine_id,
                        engine.pid, engine.url)
            out[engine.engine_id] = KnownEngine(engine.engine_id, engine.url, self.config.backend, True,
                                                S.UNHEALTHY, engine.pid)
        return out

    async def _reconcile_engines(self, known: dict[str, KnownEngine]) -> None:
        cfg = self.config
        expected = set(self.core.expected_engines())
        adopt_ids = {adopted_engine_id(url): url for url in cfg.adopt_urls}
        probes = await asyncio.gather(*(self._probe(k) for k in known.values()))
        tasks = []
        for engine, info in zip(known.values(), probes, strict=True):
            wanted = engine.engine_id in (expected if engine.managed else adopt_ids)
            tasks.append(self._take_over(engine, info, wanted))
        await asyncio.gather(*tasks)
        launches = [self.lifecycle.launch(i) for i in sorted(expected - set(self.engines))]
        launches += [self.lifecycle.introduce(url) for eid, url in adopt_ids.items() if eid not in self.engines]
        await asyncio.gather(*launches)

    async def _probe(self, engine: KnownEngine) -> dict[str, object] | None:
        """The engine's ``/model_info``; None when it does not answer. An engine that has seen our token or a
        newer one (``Core.check_fence``) raises ``Fenced``, before anything was adopted or replaced: a fenced
        reply is no sign of a dead engine."""
        try:
            await self.core.check_fence(engine.url, timeout_s=self.config.health_timeout_s)
            return await self.core.engine_client(engine.url).model_info(timeout_s=self.config.health_timeout_s)
        except EngineHTTPError as exc:
            if exc.fenced:
                raise Fenced(f"engine {engine.engine_id} refused our fencing token: {exc.message}") from None
            return None

    async def _take_over(self, engine: KnownEngine, info: dict[str, object] | None, wanted: bool) -> None:
        """Adopt a live engine from the view, replace a dead one, retire an unwanted one."""
        port = engine.url.rstrip("/").rsplit(":", 1)[-1]
        process = None
        if engine.managed and engine.pid is not None and pid_alive(engine.pid, int(port) if port.isdigit() else None):
            process = ProcessHandle(engine.pid)
        state = engine.state if engine.state != S.STOPPED else S.UNHEALTHY
        h = self.lifecycle.new_handle(engine.engine_id, engine.url, managed=engine.managed, state=state,
                                      process=process)
        h.record.backend = engine.backend
        h.record.versions = dict(engine.versions)
        h.record.offloaded_tags = list(engine.offloaded_tags)
        h.record.generate_url = engine.generate_url
        if not wanted:
            reason = "no longer in the controller's configuration"
            if h.managed and h.state in (S.SERVING, S.DRAINING) and info is not None:  # its requests end first
                self.core.spawn(self.cells.drain(h, reason), f"drain-{h.engine_id}")
            else:
                await self.lifecycle.stop(h, reason, kill=True)
            return
        if h.state == S.DRAINING:  # wanted again (the pool's size was lost): it must be brought up again
            h.record.state = S.UNHEALTHY
        alive = info is not None and (not engine.managed or process is not None)
        if not alive:
            if process is not None:
                await process.kill()  # launched by us, alive but not answering: replace it
            if h.state == S.RESTARTING:
                await self._interrupted(h)
            if h.state == S.UNHEALTHY:
                if h.managed:
                    await self.lifecycle.restart(h)
            else:
                await self.lifecycle.fail(h, "not answering when a new controller took over")
            return
        assert info is not None
        try:  # what the engine runs, from the engine: base version and loaded adapters (names carry versions)
            await self.lifecycle.read_versions(h)
        except EngineHTTPError as exc:
            await self.lifecycle.fail(h, f"not answering when a new controller took over: {exc.message}")
            return
        log.info("adopting live engine %s at %s (pid %s): %s", h.engine_id, h.record.url, h.record.pid,
                 h.record.versions)
        if h.state in (S.SERVING, S.OFFLOADED):
            if h.state == S.SERVING:
                try:  # the previous controller may have died between pause and continue
                    await h.client.continue_generation(timeout_s=self.config.request_timeout_s)
                except EngineHTTPError as exc:
                    await self.lifecycle.fail(h, f"continue_generation failed on adoption: {exc.message}")
                    return
            await self.core.save(h)
            return
        if h.state in (S.UNHEALTHY, S.RESTARTING):
            if h.state == S.RESTARTING:
                await self._interrupted(h)
            await self.lifecycle.recover(h)
            return
        async with self.core.operate(h):
            await self.lifecycle.bring_up(h, wait=False)

    async def _interrupted(self, h: EngineHandle) -> None:
        await self.core.transition(h, S.UNHEALTHY, self.core.event(
            EngineUnhealthy, engine_id=h.engine_id, reason="restart interrupted by a controller change", failures=0))

    # --- loops -------------------------------------------------------------------------------
    async def _forever(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run a loop; if it fails (Redis gone past the reconnect budget, a bug), log and start it again."""
        while True:
            try:
                await loop()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("controller %s loop failed; restarting it in 1s", name)
                await asyncio.sleep(1.0)

    async def _health_loop(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.health_interval_s)
            await self.check_health()

    async def check_health(self) -> None:
        """Check every serving engine (and every adopted unhealthy one) concurrently, once."""
        cfg = self.config
        candidates = {h.engine_id: h for h in self.engines.values()
                      if not h.busy and (h.state == S.SERVING or (h.state == S.UNHEALTHY and not h.managed))}
        for h in list(candidates.values()):
            if h.state == S.SERVING and h.process_dead():
                del candidates[h.engine_id]
                self.core.spawn(self._failed(h, f"engine process {h.record.pid} exited"), f"fail-{h.engine_id}")
        ops = {eid: self.core.ops(h) for eid, h in candidates.items()}
        loop = asyncio.get_running_loop()
        started = loop.time()
        results = await check_all({eid: h.client for eid, h in candidates.items()}, cfg.health_timeout_s,
                              with_load=True)
        self.core.metrics.health_round_seconds.observe(loop.time() - started)
        loaded: list[EngineHandle] = []
        for result in results:
            h = candidates[result.engine_id]
            self.core.metrics.health_check_seconds.labels("ok" if result.ok else "failed").observe(
                result.latency_s)
            if h.busy or self.core.ops(h) != ops[result.engine_id]:
                continue  # an update or offload ran meanwhile: this result says nothing
            if result.ok:
                h.failures = 0
                if h.state == S.UNHEALTHY:
                    self.core.spawn(self.lifecycle.recover(h), f"recover-{h.engine_id}")
                elif result.load is not None and result.load != h.record.load:
                    h.record.load = result.load
                    loaded.append(h)
                continue
            if h.state != S.SERVING or result.fenced:  # a fence refusal is the runner's to judge, no failure
                continue
            h.failures += 1
            log.warning("engine %s failed a health check (%d/%d): %s", h.engine_id, h.failures,
                        cfg.health_failure_threshold, result.reason)
            if h.failures >= cfg.health_failure_threshold or h.process_dead():
                self.core.spawn(self._failed(h, f"health check failed {h.failures} times: {result.reason}"),
                                f"fail-{h.engine_id}")
        await self.core.bus.put_engines(h.record for h in loaded)  # new loads: one round trip per health round
        healthy = [candidates[r.engine_id] for r in results if r.ok and candidates[r.engine_id].state == S.SERVING]
        for gone in await asyncio.gather(*(self.adapters.reconcile(h) for h in healthy)):
            for policy in gone:  # an adapter the engine no longer holds: the next round loads it again
                self.updater.wake(policy)

    async def _failed(self, h: EngineHandle, reason: str) -> None:
        await self.lifecycle.fail(h, reason)

    async def _failed_in_update(self, h: EngineHandle, reason: str) -> None:
        await self.lifecycle.fail(h, reason, restart_later=True)

    async def _weights_loop(self) -> None:
        while True:
            messages = await self.core.bus.read_weights()
            fresh = [m for m in messages if m.id not in self.updater.inflight]
            if messages and not fresh:
                await asyncio.sleep(0.2)  # only our own in-flight entries came back
            for msg in fresh:
                if not isinstance(msg.event, WeightsPublished):
                    await self.core.bus.ack_weights(msg.id)
                    continue
                misplaced = self.core.bus.weights.misplaced(msg)
                if misplaced is not None:
                    await self.core.bus.dead_letter_weights(msg, misplaced)
                    continue
                self.updater.inflight.add(msg.id)
                await self.updater.submit(msg.event, msg.id)

    async def _janitor_loop(self) -> None:
        cfg = self.config
        janitor = Janitor(self.core.bus.client, self.core.bus.keys, self.core.bus.publisher, JanitorConfig(
            interval_s=cfg.janitor_interval_s, max_len=cfg.retention_max_len or None,
            max_age_s=cfg.retention_max_age_s or None, payload_max_age_s=cfg.payload_max_age_s,
            payload_roots=tuple(cfg.payload_roots)))
        try:
            while True:
                await asyncio.sleep(cfg.janitor_interval_s)
                self.record_janitor(await asyncio.to_thread(janitor.run_once))
        finally:
            janitor.close()

    def record_janitor(self, report: JanitorReport) -> None:
        metrics = self.core.metrics
        metrics.janitor_seconds.observe(report.seconds)
        for stream, n in report.trimmed.items():
            metrics.janitor_removed.labels("stream_entries", stream).inc(n)
        for kind, n in report.swept.payloads.items():
            metrics.janitor_removed.labels("payloads", kind).inc(n)
        if report.swept.leftovers:
            metrics.janitor_removed.labels("payload_leftovers", "stores").inc(report.swept.leftovers)
        for expired in report.expired:
            metrics.janitor_removed.labels("groups", expired.stream).inc()

    async def _commands_loop(self) -> None:
        while True:
            for msg in await self.core.bus.read_commands():
                event = msg.event
                try:
                    if isinstance(event, OffloadEngines | OnloadEngines):
                        await self.memory_command(event)
                    elif isinstance(event, CheckWeights):
                        await self.check_weights(event.engine_ids, event.request_id)
                    elif isinstance(event, ScaleEngines):  # acked as read: a takeover never applies "+1" twice
                        self.core.spawn(self.cells.scale(event), f"scale-{event.policy}")
                except InvalidRequest as exc:
                    log.warning("ignoring command %s: %s", msg.id, exc)
                    if isinstance(event, CheckWeights):  # the asker waits for an answer: it gets the reason
                        await self.core.bus.weights_event(self.core.event(
                            WeightsChecked, engine_id="", policy="", version=-1, outcome="refused", expected="",
                            actual="", reason=str(exc), request_id=event.request_id))
                await self.core.bus.ack_commands(msg.id)

    # --- checking weights -----------------------------------------------------------------------
    async def check_weights(self, engine_ids: Sequence[str] | None = None,
                            request_id: str = "") -> list[WeightsChecked]:
        """Compare each engine's weights digest with the published one (``controller.checks``); a mismatched
        engine leaves the serving set. ``InvalidRequest`` for an unknown engine id."""
        return await self.checker.check(engine_ids, request_id)

    async def _check_applied(self, engines: list[EngineHandle]) -> None:
        await asyncio.gather(*(self.checker.check_engine(h) for h in engines))

    # --- offload / onload -------------------------------------------------------------------------
    def _targets(self, tags: Sequence[str], engine_ids: Sequence[str] | None,
                 policy: str = "") -> list[EngineHandle]:
        unknown = sorted(set(tags) - set(OFFLOAD_TAGS))
        if unknown or not tags:
            raise InvalidRequest(f"tags must be a non-empty subset of {list(OFFLOAD_TAGS)}, got {list(tags)}")
        if engine_ids is None and policy:
            if policy not in self.core.pool_policies() and policy not in self.core.policies:
                raise InvalidRequest(f"unknown policy {policy!r}: no pool serves it")
            return [h for h in self.core.members(policy) if h.state != S.STOPPED]
        if engine_ids is None:
            return list(self.engines.values())
        missing = sorted(set(engine_ids) - set(self.engines))
        if missing:
            raise InvalidRequest(f"unknown engines {missing}")
        return [self.engines[e] for e in engine_ids]

    async def offload(self, tags: Sequence[str], engine_ids: Sequence[str] | None = None,
                      policy: str = "") -> dict[str, str]:
        """Release engine memory by tag; engines go ``offloaded`` and leave the serving set."""
        return await self._on_each(self._offload_one, tags, engine_ids, policy)

    async def onload(self, tags: Sequence[str], engine_ids: Sequence[str] | None = None,
                     policy: str = "") -> dict[str, str]:
        """Resume engine memory by tag; with nothing left released, an engine serves again."""
        return await self._on_each(self._onload_one, tags, engine_ids, policy)

    async def memory_command(self, event: OffloadEngines | OnloadEngines) -> dict[str, str]:
        """An offload or onload command; one that carries a ``request_id`` is answered with ``CommandDone``
        (refused with the reason when it is bad)."""
        name = "offload" if isinstance(event, OffloadEngines) else "onload"
        started = time.perf_counter()
        try:
            results = await (self.offload if name == "offload" else self.onload)(
                event.tags, event.engine_ids, event.policy)
        except InvalidRequest as exc:
            if event.request_id:
                await self.core.bus.engine(self.core.event(
                    CommandDone, request_id=event.request_id, command=name, outcome="refused", reason=str(exc)))
            raise
        elapsed = time.perf_counter() - started
        self.core.metrics.memory_seconds.labels(name).observe(elapsed)
        if event.request_id:
            refused = {e: r for e, r in results.items() if r.startswith("refused")}
            failed = {e: r for e, r in results.items() if r != "ok" and not r.startswith(("refused", "skipped"))}
            outcome = "failed" if failed else "refused" if refused else "ok"
            reason = "; ".join(f"{e}: {r}" for e, r in sorted({**refused, **failed}.items()))
            await self.core.bus.engine(self.core.event(
                CommandDone, request_id=event.request_id, command=name, outcome=outcome, reason=reason,
                results=results, duration_ms=elapsed * 1000))
        return results

    async def _on_each(self, one: Callable[[EngineHandle, list[str]], Awaitable[str]], tags: Sequence[str],
                       engine_ids: Sequence[str] | None, policy: str = "") -> dict[str, str]:
        """Run ``one`` on every targeted engine at once; engine id -> outcome."""
        targets = self._targets(tags, engine_ids, policy)
        results = await asyncio.gather(*(one(h, list(tags)) for h in targets))
        return dict(zip((h.engine_id for h in targets), results, strict=True))

    async def _offload_one(self, h: EngineHandle, tags: list[str]) -> str:
        """Release memory the way SGLang allows it: only an idle engine may release (its scheduler asserts
        so, and the server dies otherwise). A serving engine first leaves the serving set (the registry
        says ``offloaded``, so executors stop choosing it), then pauses in ``abort`` mode (requests in
        flight end with their partial output, which executors continue elsewhere), then releases."""
        cfg = self.config
        async with self.core.operate(h):
            if h.state not in (S.SERVING, S.OFFLOADED):
                return f"skipped: engine is {h.state.value}"
            already = sorted(set(tags) & set(h.record.offloaded_tags))
            if already:
                return f"refused: {already} already released on {h.engine_id}"
            was_serving = h.state == S.SERVING
            try:
                if was_serving:
                    await self.core.transition(h, S.OFFLOADED, None)
                    await h.client.pause_generation("abort", timeout_s=cfg.request_timeout_s)
                await h.client.release_memory_occupation(tags, timeout_s=cfg.request_timeout_s)
            except EngineHTTPError as exc:
                if not exc.rejected:
                    problem = f"release_memory_occupation failed: {exc.message}"
                else:
                    if was_serving:  # back to serving: nothing was released
                        try:
                            await h.client.continue_generation(timeout_s=cfg.request_timeout_s)
                            await self.core.transition(h, S.SERVING, None)
                            return f"refused: {exc.message}"
                        except EngineHTTPError as again:
                            problem = f"continue_generation failed after a refused release: {again.message}"
                    else:
                        return f"refused: {exc.message}"
            else:
                h.record.offloaded_tags = sorted(set(h.record.offloaded_tags) | set(tags))
                await self.core.save(h, self.core.event(EngineOffloaded, engine_id=h.engine_id, tags=tags))
                return "ok"
        await self.lifecycle.fail(h, problem)
        return problem

    async def _onload_one(self, h: EngineHandle, tags: list[str]) -> str:
        """Resume released memory; tags that were never released are refused here, never sent (SGLang's
        scheduler raises on them and the server dies). With nothing left released, generation continues,
        the latest weights are loaded, and the engine serves again."""
        cfg = self.config
        async with self.core.operate(h):
            if h.state != S.OFFLOADED:
                return f"skipped: engine is {h.state.value}"
            never = sorted(set(tags) - set(h.record.offloaded_tags))
            if never:
                return (f"refused: {never} not offloaded on {h.engine_id} "
                        f"(offloaded: {h.record.offloaded_tags}); nothing was sent")
            try:
                await h.client.resume_memory_occupation(tags, timeout_s=cfg.request_timeout_s)
            except EngineHTTPError as exc:
                if exc.rejected:
                    return f"refused: {exc.message}"
                problem = f"resume_memory_occupation failed: {exc.message}"
            else:
                h.record.offloaded_tags = sorted(set(h.record.offloaded_tags) - set(tags))
                await self.core.save(h, self.core.event(EngineOnloaded, engine_id=h.engine_id, tags=tags))
                if h.record.offloaded_tags:
                    return "ok"
                try:
                    await h.client.continue_generation(timeout_s=cfg.request_timeout_s)
                except EngineHTTPError as exc:
                    problem = f"continue_generation failed after onload: {exc.message}"
                else:
                    outcome = await self.updater.catch_up(h)
                    if outcome is None:
                        await self.core.transition(h, S.SERVING, self.core.event(
                            EngineServing, engine_id=h.engine_id, url=h.record.url,
                            versions=dict(h.record.versions)))
                        await self.updater.joined()
                        return "ok"
                    problem = f"could not load the latest weights after onload: {outcome.reason}"
        await self.lifecycle.fail(h, problem)
        return problem
