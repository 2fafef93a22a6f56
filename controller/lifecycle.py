"""Engine lifecycles: launch, bring-up, failure, restart, adoption, stop.

Bring-up is the only road into ``serving`` for a new, restarted or recovered engine:
it waits until the engine answers ``/health_generate`` (``EngineReady``), pushes the
target weights of every policy, and only then announces ``EngineServing``. A failure
anywhere makes the engine ``unhealthy``; a launched engine is then restarted (with
backoff, up to ``max_restart_attempts``), an adopted one waits until it answers again.

Fence refusals are never failures: once an engine (or the registry) refused this controller's
token, ``core.halted`` holds and nothing here marks, restarts or stops an engine, so no refusal
spends the restart budget; the leader runner decides what the refusal means. The budget counts
restarts since the engine last served; a restart whose start-up fails counts once, and the
engine is stopped only when the budget is spent, with the last start-up failure as its reason.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from urllib.parse import urlsplit

from rollout_bus.controller.backends import Backend, LaunchSpec, ProcessHandle, launch
from rollout_bus.controller.checks import WeightChecker
from rollout_bus.controller.config import ControllerConfig
from rollout_bus.controller.core import Core
from rollout_bus.controller.state import EngineHandle
from rollout_bus.controller.updates import WeightUpdater
from rollout_bus.controller.versions import base_version, loaded_adapters
from rollout_bus.engine.http_client import EngineHTTPError
from rollout_bus.events.embedded import free_port
from rollout_bus.events.registry import EngineRecord, EngineState
from rollout_bus.events.schema import (
    EngineLaunching,
    EngineReady,
    EngineRestarting,
    EngineServing,
    EngineStopped,
    EngineUnhealthy,
)

log = logging.getLogger(__name__)
S = EngineState


def adopted_engine_id(url: str) -> str:
    """``adopted-<host>-<port>``, the host's dots and colons as '-': an engine id is a name (``events.names``)."""
    parts = urlsplit(url)
    host = "".join(ch if ch.isascii() and (ch.isalnum() or ch in "_-") else "-" for ch in parts.hostname or "")
    tail = f"-{parts.port}"
    return f"adopted-{host[:64 - len('adopted') - len(tail)]}{tail}"


def launch_spec(cfg: ControllerConfig, engine_id: str, port: int,
                addresses: tuple[str, str] | None = None, expected: dict[str, str] | None = None) -> LaunchSpec:
    """How to start ``engine_id``: engine ``i`` of the configuration (counted over every pool, in id
    order) gets the GPUs from ``base_gpu_id + i * tp_size`` on. ``addresses``: (listen, advertise),
    resolved from the configuration when not given; ``expected``: the engines the pools call for now
    (default: the configured ones)."""
    order = sorted(cfg.expected_engines() if expected is None else expected)
    index = order.index(engine_id) if engine_id in order else 0
    listen, advertise = addresses or cfg.engine_addresses()
    return LaunchSpec(engine_id=engine_id, host=listen, advertise_host=advertise, port=port,
                      model_path=cfg.model_path,
                      weight_version=cfg.initial_version, python=cfg.python, extra_args=tuple(cfg.engine_args),
                      token_delay_ms=cfg.token_delay_ms, seed=cfg.seed, api_key=cfg.engine_api_key,
                      enable_lora=cfg.enable_lora, max_loras_per_batch=cfg.max_loras_per_batch,
                      max_lora_rank=cfg.max_lora_rank, lora_target_modules=tuple(cfg.lora_target_modules),
                      tp_size=cfg.tp_size, base_gpu_id=cfg.base_gpu_id + index * cfg.tp_size,
                      dist_timeout_s=cfg.group_timeout_s if cfg.weight_sync == "broadcast" else 0.0,
                      weights_root=str(Path(cfg.weights_root).resolve()) if cfg.weights_root else "")


class Lifecycle:
    def __init__(self, core: Core, backend: Backend, updater: WeightUpdater) -> None:
        self.core = core
        self.backend = backend
        self.updater = updater
        self.checker: WeightChecker | None = None
        """Vets an engine's weights digest at bring-up, before it serves (set by the service)."""
        self._addresses: tuple[str, str] | None = None

    def new_handle(self, engine_id: str, url: str, *, managed: bool, state: EngineState = S.LAUNCHING,
                   process: ProcessHandle | None = None) -> EngineHandle:
        cfg = self.core.config
        base_policy = self.core.pool_of_engine(engine_id)
        record = EngineRecord(engine_id=engine_id, url=url, state=state,
                              backend=cfg.backend if managed else "external", managed=managed,
                              pause_mode=cfg.pause_mode, base_policy=base_policy,
                              pid=process.pid if process else None,
                              role="eval" if engine_id in cfg.eval_engine_ids() else "train")
        handle = EngineHandle(record, self.core.engine_client(url), process)
        self.core.engines[engine_id] = handle
        self.core.refresh_state_metrics()
        return handle

    async def read_versions(self, h: EngineHandle) -> None:
        """What the engine runs, from the engine itself: its base weights' version (``/model_info``) and
        the adapters it has loaded (``/v1/models``, whose names carry their versions). Adapter names of
        older versions of a policy are unloaded."""
        cfg = self.core.config
        info = await h.client.model_info(timeout_s=cfg.request_timeout_s)
        versions: dict[str, int] = {}
        base = base_version(info)
        if base is not None:
            versions[h.record.base_policy] = base
        adapters: dict[str, str] = {}
        try:
            loaded = loaded_adapters(await h.client.models(timeout_s=cfg.request_timeout_s))
        except EngineHTTPError as exc:
            log.info("engine %s lists no adapters (%s)", h.engine_id, exc.message)
            loaded = {}
        for policy, names in loaded.items():
            (version, name), *older = names
            versions[policy], adapters[policy] = version, name
            for _, old in older:
                try:
                    await h.client.unload_lora_adapter(old, timeout_s=cfg.update_timeout_s)
                except EngineHTTPError as exc:
                    log.warning("engine %s: unloading stale adapter %s failed: %s", h.engine_id, old, exc.message)
        h.record.versions, h.record.adapters = versions, adapters

    # --- launching ---------------------------------------------------------------------------
    def _spawn_process(self, engine_id: str) -> tuple[ProcessHandle, str, str]:
        """The engine's process, its url, and where executors send ``/generate`` ("": the url)."""
        if self._addresses is None:  # resolved once: the route to Redis does not change under a controller
            self._addresses = self.core.config.engine_addresses()
            log.info("engines listen on %s and register as %s", *self._addresses)
        spec = self.backend.prepare(launch_spec(self.core.config, engine_id, free_port(), self._addresses,
                                                self.core.expected_engines()))
        process = launch(self.backend, spec, self.core.log_dir)
        self.core.launched.add(engine_id, spec.url, process.pid)  # known here even if Redis loses it
        return process, spec.url, self.backend.generate_url(spec)

    async def launch(self, engine_id: str) -> EngineHandle:
        """Start a new engine and bring it up; returns its handle whatever the outcome."""
        process, url, generate_url = self._spawn_process(engine_id)
        h = self.new_handle(engine_id, url, managed=True, process=process)
        h.record.generate_url = generate_url
        async with self.core.operate(h):
            await self.core.save(h, self.core.event(
                EngineLaunching, engine_id=engine_id, url=h.record.url, backend=h.record.backend, managed=True))
            ok = await self.bring_up(h)
        if not ok:
            self.core.spawn(self.restart(h), f"restart-{engine_id}")
        return h

    async def introduce(self, url: str) -> EngineHandle:
        """Take over an engine someone else launched (an adopt URL seen for the first time)."""
        h = self.new_handle(adopted_engine_id(url), url, managed=False)
        async with self.core.operate(h):
            await self.core.save(h, self.core.event(
                EngineLaunching, engine_id=h.engine_id, url=url, backend="external", managed=False))
            await self.bring_up(h)
        return h

    # --- bring-up ----------------------------------------------------------------------------
    async def _wait_ready(self, h: EngineHandle) -> str | None:
        """None once the engine answers ``/health_generate``; else why it never did."""
        cfg = self.core.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.startup_timeout_s
        last = "no answer yet"
        while loop.time() < deadline:
            if h.process_dead():
                tail = h.process.log_tail() if h.process else ""
                return f"engine process exited during startup: {tail[-500:]}"
            try:
                await h.client.health_generate(timeout_s=cfg.health_timeout_s)
                return None
            except EngineHTTPError as exc:
                last = exc.message
            await asyncio.sleep(0.1)
        return f"not ready after {cfg.startup_timeout_s:g}s: {last}"

    async def bring_up(self, h: EngineHandle, *, wait: bool = True) -> bool:
        """launching/unhealthy/offloaded -> pending_weights -> serving; the caller holds the lock."""
        if wait:
            problem = await self._wait_ready(h)
            if problem is not None:
                await self._mark_unhealthy(h, problem)
                return False
        if h.state != S.PENDING_WEIGHTS:
            await self.core.transition(h, S.PENDING_WEIGHTS,
                                       self.core.event(EngineReady, engine_id=h.engine_id, url=h.record.url))
        try:
            await h.client.continue_generation(timeout_s=self.core.config.request_timeout_s)
            await self.read_versions(h)
        except EngineHTTPError as exc:
            await self._mark_unhealthy(h, f"engine stopped answering after it was ready: {exc.message}")
            return False
        if h.engine_id in self.core.suspect_weights:  # it failed a weights check: what it reports is not proof
            h.record.versions.pop(h.record.base_policy, None)
            self.core.suspect_weights.discard(h.engine_id)
        outcome = await self.updater.catch_up(h)
        if outcome is not None:
            await self._mark_unhealthy(h, f"could not load the latest weights: {outcome.reason}")
            return False
        problem = await self.checker.vet(h) if self.checker is not None else None
        if problem is not None:
            await self._mark_unhealthy(h, problem)
            return False
        h.failures = 0
        h.restart_attempts = 0
        await self.core.transition(h, S.SERVING, self.core.event(
            EngineServing, engine_id=h.engine_id, url=h.record.url, versions=dict(h.record.versions)))
        await self.updater.joined()
        return True

    async def _mark_unhealthy(self, h: EngineHandle, reason: str) -> None:
        log.warning("engine %s unhealthy: %s", h.engine_id, reason)
        h.last_failure = reason[:500]
        await self.core.transition(h, S.UNHEALTHY, self.core.event(
            EngineUnhealthy, engine_id=h.engine_id, reason=reason[:2000], failures=h.failures))

    # --- failure and restart -------------------------------------------------------------------
    async def fail(self, h: EngineHandle, reason: str, *, restart_later: bool = False) -> None:
        """Take a failing engine out of serving; restart it when we launched it.

        ``restart_later`` returns once the engine is out of serving and relaunches it in a task
        of its own: a weight update round that found it dead must not wait for the relaunch,
        or the healthy engines would get no newer version until it is back."""
        if self.core.halted:
            log.warning("engine %s: not failed (%s): this controller was fenced", h.engine_id, reason)
            return
        async with self.core.operate(h):
            if h.state in (S.UNHEALTHY, S.RESTARTING, S.STOPPED):
                return
            await self._mark_unhealthy(h, reason)
        if not h.managed:
            return
        if restart_later:
            self.core.spawn(self.restart(h), f"restart-{h.engine_id}")
        else:
            await self.restart(h)

    async def restart(self, h: EngineHandle) -> None:
        """Stop the old process, then restarting -> launching -> (bring-up); retried with backoff."""
        cfg = self.core.config
        while True:
            async with self.core.operate(h):
                if h.state != S.UNHEALTHY or not h.managed or self.core.halted:
                    return
                if h.restart_attempts >= cfg.max_restart_attempts:
                    await self.stop_locked(h, f"gave up after {h.restart_attempts} restart attempts; the last "
                                               f"one: {h.last_failure}", kill=True)
                    return
                h.restart_attempts += 1
                if h.process is not None:
                    await h.process.stop(grace_s=2.0)
                if h.restart_attempts > 1:
                    await asyncio.sleep(min(0.5 * 2 ** (h.restart_attempts - 2), 10.0))
                await self.core.transition(h, S.RESTARTING, self.core.event(
                    EngineRestarting, engine_id=h.engine_id, attempt=h.restart_attempts))
                self.core.metrics.engine_restarts.inc()
                try:
                    h.process, h.record.url, h.record.generate_url = self._spawn_process(h.engine_id)
                except OSError as exc:
                    await self._mark_unhealthy(h, f"relaunch failed: {exc}")
                    continue
                h.record.pid = h.process.pid
                h.record.versions, h.record.adapters = {}, {}
                h.client = self.core.engine_client(h.record.url)
                await self.core.transition(h, S.LAUNCHING, self.core.event(
                    EngineLaunching, engine_id=h.engine_id, url=h.record.url, backend=h.record.backend,
                    managed=True))
                if await self.bring_up(h):
                    return

    async def recover(self, h: EngineHandle) -> None:
        """An adopted engine answers again: re-apply the latest weights, then serve."""
        async with self.core.operate(h):
            if h.state != S.UNHEALTHY:
                return
            log.info("adopted engine %s answers again", h.engine_id)
            await self.bring_up(h, wait=False)

    # --- stopping ------------------------------------------------------------------------------
    async def stop(self, h: EngineHandle, reason: str, *, kill: bool) -> None:
        async with self.core.operate(h):
            await self.stop_locked(h, reason, kill=kill)

    async def stop_locked(self, h: EngineHandle, reason: str, *, kill: bool) -> None:
        if h.state == S.STOPPED:
            return
        if kill and h.managed and h.process is not None:
            await h.process.stop(grace_s=5.0)
            self.core.launched.drop(h.engine_id, h.process.pid)
        await self.core.transition(h, S.STOPPED, self.core.event(EngineStopped, engine_id=h.engine_id,
                                                                  reason=reason))
