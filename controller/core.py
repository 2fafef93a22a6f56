"""State shared by the controller's parts: engines, versions, the bus, metrics, tasks.

``Core.transition`` is the one place an engine changes state: it checks the move
against the state machine, updates the metrics, and writes the engine's registry
record and its event (record first). ``Core.operate`` is the per-engine critical
section for anything that changes an engine (update, offload, restart); health
results gathered across one are discarded.

An engine's fenced reply (409: a token newer than ours was seen) is no engine failure: it sets
``bus.fenced`` (and ``fence_highest``) before it is raised, which stops every write and restart
of this instance until the leader runner has checked the lease (``controller.runner``). A highest
token beyond any the counter can hold (``lease.MAX_TOKEN``) was never a controller's: that reply is
left an ordinary refusal, and the engine is treated like a failing one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

from rollout_bus.controller.bus import ControllerBus
from rollout_bus.controller.config import ControllerConfig
from rollout_bus.controller.launched import Launched
from rollout_bus.controller.lease import MAX_TOKEN
from rollout_bus.controller.metrics import ControllerMetrics
from rollout_bus.controller.state import EngineHandle
from rollout_bus.controller.versions import VersionBook
from rollout_bus.engine.http_client import EngineClient, EngineHTTPError
from rollout_bus.events.registry import EngineState, PolicyRecord
from rollout_bus.events.schema import Event, Producer

log = logging.getLogger(__name__)


class Core:
    def __init__(self, config: ControllerConfig, bus: ControllerBus, metrics: ControllerMetrics,
                 log_dir: Path, *, fence: int | None = None, launched: Launched | None = None) -> None:
        self.config = config
        self.fence = fence
        self.bus = bus
        self.metrics = metrics
        self.log_dir = log_dir
        self.producer: Producer = bus.producer
        self.book = VersionBook()
        self.engines: dict[str, EngineHandle] = {}
        self.policies: dict[str, PolicyRecord] = {}
        self.sizes: dict[str, int] = config.sizes()
        """Each pool's size: the configured one until it is scaled at run time (``controller.cells``)."""
        self.launched = launched if launched is not None else Launched.in_dir(config.log_dir, config.instance)
        self.fence_highest = 0
        self.suspect_weights: set[str] = set()
        """Engines whose base weights failed a check: their next bring-up loads the target whatever they report."""
        """The highest fencing token an engine said it has seen, when one refused us (0: none did)."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ops: dict[str, int] = {}

    def engine_client(self, url: str) -> EngineClient:
        """A client for an engine that sends this controller's fencing token with every call."""
        return EngineClient(url, timeout_s=self.config.request_timeout_s, api_key=self.config.engine_api_key,
                            fence=self.fence, on_fenced=self._engine_fenced)

    async def check_fence(self, url: str, *, timeout_s: float) -> None:
        """Before this tenure's first call to an engine: ask what it has seen with token 0, which an engine that
        saw any token refuses (409) saying its highest, and changes nothing. An engine that saw our own number
        saw it from another tenure (Redis handed it out again after it lost the counter): it is fenced like a
        newer one, so the counter is raised past it. SGLang ignores the header and answers."""
        if self.fence is None:
            return
        probe = EngineClient(url, timeout_s=timeout_s, api_key=self.config.engine_api_key, fence=0)
        try:
            await probe.model_info(timeout_s=timeout_s)
        except EngineHTTPError as exc:
            if not exc.fenced:
                raise
            if exc.fence_highest is not None and exc.fence_highest >= self.fence:
                exc.message = f"fenced: the engine has seen token {exc.fence_highest}, ours is {self.fence}"
                self._engine_fenced(exc)
                raise exc from None

    @property
    def halted(self) -> bool:
        """A write or an engine call was fenced: change nothing until the lease was checked again."""
        return self.bus.fenced.is_set()

    def _engine_fenced(self, error: EngineHTTPError) -> None:
        highest = error.fence_highest
        if highest is not None and highest > MAX_TOKEN:
            log.error("engine %s claims fencing token %d, beyond any a controller can hold: treated as a failing "
                      "engine, not as a fence", error.url, highest)
            error.fence_highest = None
            error.status = 502
            return
        if highest is not None:
            self.fence_highest = max(self.fence_highest, highest)
        if not self.bus.fenced.is_set():
            log.error("engine %s refused our fencing token %s (%s): halting until the lease is checked",
                      error.url, self.fence, error.message)
        self.bus.fenced.set()

    # --- events and transitions -------------------------------------------------------------
    def event(self, cls: type[Event], **fields: Any) -> Event:
        return cls(producer=self.producer, **fields)

    async def transition(self, h: EngineHandle, target: EngineState, event: Event | None) -> None:
        previous = h.move(target)
        log.info("engine %s: %s -> %s", h.engine_id, previous.value, target.value)
        self.refresh_state_metrics()
        await self.bus.engine(event, h.record)

    async def save(self, h: EngineHandle, event: Event | None = None) -> None:
        """Write the engine's record (and an event) without a state change."""
        await self.bus.engine(event, h.record)

    def refresh_state_metrics(self) -> None:
        self.metrics.set_states(h.state for h in self.engines.values())

    # --- views --------------------------------------------------------------------------------
    def serving(self) -> list[EngineHandle]:
        return [h for h in self.engines.values() if h.state == EngineState.SERVING]

    def pool_policies(self) -> set[str]:
        """Policies with an engine pool of their own (full weights): the base policy and ``--pool`` ones."""
        return {self.config.base_policy, *self.config.pool_sizes()}

    def expected_engines(self) -> dict[str, str]:
        """Engine id -> pool of every engine the pools' current sizes call for."""
        return self.config.expected_engines(self.sizes)

    def pool_of_engine(self, engine_id: str) -> str:
        """The pool a launched engine's id names (any size up to the pool's bound); the base pool for others."""
        bounds = self.config.max_sizes()
        widest = {p: max(bounds.get(p, 0), n) for p, n in self.sizes.items()}
        return self.config.expected_engines(widest).get(engine_id, self.config.base_policy)

    def pool_of(self, policy: str) -> str:
        """The pool that serves ``policy``: its own, or the base pool for an adapter policy."""
        return policy if policy in self.pool_policies() else self.config.base_policy

    def members(self, policy: str) -> list[EngineHandle]:
        """Every engine that serves (or will serve) ``policy``."""
        pool = self.pool_of(policy)
        return [h for h in self.engines.values() if h.record.base_policy == pool]

    def serving_members(self, policy: str) -> list[EngineHandle]:
        return [h for h in self.members(policy) if h.state == EngineState.SERVING]

    def ops(self, h: EngineHandle) -> int:
        return self._ops.get(h.engine_id, 0)

    @contextlib.asynccontextmanager
    async def operate(self, h: EngineHandle) -> AsyncIterator[None]:
        async with h.lock:
            self._ops[h.engine_id] = self._ops.get(h.engine_id, 0) + 1
            yield

    # --- background tasks -----------------------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("controller task %s failed", task.get_name(), exc_info=task.exception())

    async def cancel_tasks(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
