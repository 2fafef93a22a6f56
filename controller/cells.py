"""Cells: a pool's engines started and stopped while the run goes on (``ScaleEngines``, ``rollout-bus scale``).

A pool's size is ``Core.sizes``: the configured one until a ``ScaleEngines`` command changes it. The
new size is written to the pool's policy record (``PolicyRecord.engines``) before any engine starts or
stops, so a controller that takes over mid-change reconciles to it instead of the configured size.
Scales run one at a time, each in a task of its own (a drain can take minutes; offload, onload and
weight checks are not held up behind it). A command is acknowledged as it is read, so a takeover
never applies a relative count (``+1``) twice.

Growing launches engines ``engine-<i>`` (``engine-<policy>-<i>``) of the lowest free indices through the
one launch path (``Lifecycle.launch``): each gets the current target of every policy its pool serves
(full weights, LoRA adapters) and passes the weight check before it is announced serving.

Shrinking stops the engines of the highest indices, each drained first: it leaves the serving set
(``draining``, ``EngineDraining``; executors stop choosing it at their next registry look), requests in
flight run to their end (the engine's ``/v1/loads`` says none run or wait, and ``drain_grace_s`` has
passed since it left the serving set, so a call an executor chose from an older snapshot has landed),
and only then does its process stop. Requests still running after ``drain_timeout_s`` are aborted
(their partial output goes back to the executors, which continue it on another engine) and the engine
stops: none is lost either way.

Every change is on the engine stream: ``EnginesScaled`` ``started`` (who asked, from and to), the
engines' own lifecycle events, then ``done`` or ``failed``; a bad command gets ``refused`` with what to fix.
"""

from __future__ import annotations

import asyncio
import logging
import time

from rollout_bus.controller.core import Core
from rollout_bus.controller.health import load_of
from rollout_bus.controller.lifecycle import Lifecycle
from rollout_bus.controller.state import EngineHandle
from rollout_bus.engine.http_client import EngineHTTPError
from rollout_bus.events.errors import InvalidRequest
from rollout_bus.events.registry import EngineState, PolicyRecord
from rollout_bus.events.schema import EngineDraining, EnginesScaled, ScaleEngines, scale_target

log = logging.getLogger(__name__)
S = EngineState


class Cells:
    def __init__(self, core: Core, lifecycle: Lifecycle) -> None:
        self.core = core
        self.lifecycle = lifecycle
        self._lock = asyncio.Lock()

    # --- views ------------------------------------------------------------------------------
    def live(self, pool: str) -> list[EngineHandle]:
        """The pool's launched engines that count toward its size (neither stopped nor draining)."""
        return [h for h in self.core.engines.values()
                if h.managed and h.record.base_policy == pool and h.state not in (S.STOPPED, S.DRAINING)]

    def check(self, command: ScaleEngines) -> tuple[int, int]:
        """(current size, asked size) of the command's pool; ``InvalidRequest`` saying what to fix."""
        pools = sorted(self.core.pool_policies())
        policy = command.policy
        if policy not in pools:
            hint = (f" (it is a LoRA adapter served on the {self.core.config.base_policy!r} pool: scale that one)"
                    if policy in self.core.policies else "")
            raise InvalidRequest(f"policy {policy!r} has no engine pool{hint}; the pools are {pools}")
        current = len(self.live(policy))
        target = scale_target(command.count, current)
        bound = self.core.config.max_sizes().get(policy, self.core.config.max_engines)
        if target < 0:
            raise InvalidRequest(f"cannot scale {policy!r} to {target} engines ({command.count} from {current}): "
                                 "a pool has 0 engines or more")
        if target > bound:
            raise InvalidRequest(f"cannot scale {policy!r} to {target} engines ({command.count} from {current}): "
                                 f"its bound is {bound} (the controller's --max-engines, or --max-pool "
                                 f"{policy}=N)")
        return current, target

    # --- scaling ------------------------------------------------------------------------------
    async def scale(self, command: ScaleEngines) -> EnginesScaled:
        """Apply one ``ScaleEngines``; returns its last answer (``done``, ``failed`` or ``refused``)."""
        async with self._lock:
            asked_by = str(command.producer)
            try:
                current, target = self.check(command)
            except InvalidRequest as exc:
                log.warning("refusing to scale %s (%s, asked by %s): %s", command.policy, command.count, asked_by,
                            exc)
                live = len(self.live(command.policy))
                return await self._answer(command, live, live, "refused", str(exc))
            pool = command.policy
            if target == current:
                return await self._answer(command, current, target, "done", f"{pool} already has {current} engines")
            log.info("scaling %s from %d to %d engines (asked by %s)", pool, current, target, asked_by)
            self.core.sizes[pool] = target
            record = self.core.policies.setdefault(pool, PolicyRecord(pool))
            record.engines = target
            await self.core.bus.put_policy(record)
            await self._answer(command, current, target, "started")
            if target > current:
                ids, problems = await self._grow(pool, target)
            else:
                ids, problems = await self._shrink(pool, current - target, f"scaled down by {asked_by}")
            self.core.metrics.engines_scaled.labels(pool, "up" if target > current else "down").inc(len(ids))
            return await self._answer(command, current, target, "failed" if problems else "done",
                                      "; ".join(problems), ids)

    async def _answer(self, command: ScaleEngines, current: int, target: int, outcome: str, reason: str = "",
                      engine_ids: list[str] | None = None) -> EnginesScaled:
        event = self.core.event(EnginesScaled, policy=command.policy, requested_by=str(command.producer),
                                from_count=current, to_count=target, outcome=outcome, reason=reason,
                                engine_ids=sorted(engine_ids or []), request_id=command.request_id)
        assert isinstance(event, EnginesScaled)
        await self.core.bus.engine(event)
        return event

    async def _grow(self, pool: str, target: int) -> tuple[list[str], list[str]]:
        """Launch engines up to ``target``: the pool's ids of the lowest free indices."""
        taken = {h.engine_id for h in self.core.engines.values() if h.state != S.STOPPED}
        wanted = [eid for eid, p in self.core.expected_engines().items() if p == pool and eid not in taken]
        handles = await asyncio.gather(*(self.lifecycle.launch(eid) for eid in wanted))
        problems = [f"{h.engine_id} is {h.state.value}: {h.last_failure or 'not serving'}"
                    for h in handles if h.state != S.SERVING]
        return [h.engine_id for h in handles], problems

    async def _shrink(self, pool: str, n: int, reason: str) -> tuple[list[str], list[str]]:
        """Drain and stop the ``n`` live engines of the highest indices."""
        victims = sorted(self.live(pool), key=lambda h: _index(h.engine_id), reverse=True)[:n]
        outcomes = await asyncio.gather(*(self.drain(h, reason) for h in victims))
        return [h.engine_id for h in victims], [o for o in outcomes if o]

    # --- draining -------------------------------------------------------------------------------
    async def drain(self, h: EngineHandle, reason: str) -> str:
        """Take ``h`` out of serving, let its requests in flight end, stop it; "" or what went wrong."""
        async with self.core.operate(h):
            if h.state == S.STOPPED:
                return ""
            problem = ""
            if h.state == S.SERVING:
                await self.core.transition(h, S.DRAINING, self.core.event(
                    EngineDraining, engine_id=h.engine_id, reason=reason))
            if h.state == S.DRAINING:
                left = await self._wait_idle(h)
                if left:
                    problem = (f"{h.engine_id}: {left} requests still in flight after {self.core.config.drain_timeout_s:g}s"
                               ": aborted (executors continue them elsewhere)")
                    log.warning("%s", problem)
                    try:
                        await h.client.pause_generation("abort", timeout_s=self.core.config.request_timeout_s)
                    except EngineHTTPError as exc:
                        log.warning("engine %s: abort before stopping failed: %s", h.engine_id, exc.message)
            await self.lifecycle.stop_locked(h, reason, kill=True)
            return problem

    async def _wait_idle(self, h: EngineHandle) -> int:
        """Until the engine has nothing running or waiting, no sooner than ``drain_grace_s`` after it left the
        serving set; returns what is left in flight when ``drain_timeout_s`` ran out (0: drained)."""
        cfg = self.core.config
        started = time.monotonic()
        load = 0
        while True:
            if h.process_dead():
                return 0
            try:
                load = load_of(await h.client.loads(timeout_s=cfg.health_timeout_s)) or 0
            except EngineHTTPError as exc:
                log.warning("engine %s stopped answering while draining (%s): stopping it", h.engine_id, exc.message)
                return 0
            waited = time.monotonic() - started
            if load == 0 and waited >= cfg.drain_grace_s:
                return 0
            if waited >= cfg.drain_timeout_s:
                return load
            await asyncio.sleep(0.1)


def _index(engine_id: str) -> int:
    tail = engine_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1
