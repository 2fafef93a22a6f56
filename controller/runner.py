"""Running a controller under the namespace lease: stand by, take over, renew, step down.

``LeaderRunner`` loops: try to take the lease (every ``ttl/3``) -> start the service ->
renew every ``ttl/3`` while running -> on stop, stop the service and release the lease.
It steps down, stopping the service at once without touching the engines, and stands by
again, when:

- a renewal finds someone else's token (the lease was lost);
- its last good renewal is older than the lease less a margin (``ttl/4``): it cannot reach
  Redis, and a standby is about to take over. A renewal that raises or hangs counts as
  not good; the deadline is measured from the moment the last good renewal was sent, so
  the leader is gone before the lease it last extended can lapse;
- the service reports a fence refusal (``service.fenced``: a registry write, or an engine's
  409 with the highest token it has seen, ``service.fence_highest``) and the lease, checked
  again, is no longer ours.

A fence refusal is the runner's to judge, never the engine's or the service's: it checks the
lease with ``Lease.raise_above``. Lost: it steps down. Still ours: Redis lost data (restarted
empty, or without the tail of its log) and an engine saw a token the counter no longer reaches.
The counter is raised past every highest seen, in the same script that checks the lease, and
the runner takes over again at once with the new token: the service is stopped without
touching the engines and a new one adopts them (``controller.launched`` names the engines
this process launched when the registry no longer does). ``MAX_RETAKES`` such retakes within
ten leases mean something else keeps raising tokens: it steps down instead, releases the lease
and waits a lease before it tries again.

A leader that steps down hands its engines over: the next leader adopts them from the
registry. An engine the registry does not list with its pid (Redis lost it) could never be
adopted, so while another controller holds the lease it is stopped (``hand_over``).

Renewal starts as soon as the lease is taken, so a slow start (engines launching) does
not let it lapse. A standby that cannot reach Redis keeps trying.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from rollout_bus.controller.backends import ProcessHandle
from rollout_bus.controller.launched import Launched
from rollout_bus.controller.lease import Lease
from rollout_bus.events.errors import BusError
from rollout_bus.events.registry import Registry

log = logging.getLogger(__name__)


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self, *, stop_engines: bool | None = None) -> None: ...


MAX_RETAKES = 3


class LeaderRunner:
    def __init__(self, lease: Lease, factory: Callable[[], Service], ttl_s: float, *,
                 launched: Launched | None = None, registry: Registry | None = None) -> None:
        """``launched`` and ``registry``: the engines this process launched and the registry to read (unfenced);
        with both, engines nobody can adopt are stopped after a step-down (``hand_over``)."""
        self.lease = lease
        self.factory = factory
        self.ttl_s = ttl_s
        self.period_s = max(ttl_s / 3, 0.05)
        self.margin_s = ttl_s / 4
        self.launched = launched
        self.registry = registry
        self.active = asyncio.Event()
        self.lost = asyncio.Event()
        self.service: Service | None = None
        self.last_good: float = 0.0
        """``time.monotonic()`` when the last renewal that succeeded was sent."""
        self.step_downs = 0
        self.retakes: list[float] = []
        """``time.monotonic()`` of each takeover with a raised fencing token."""
        self.cooling = False

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop`` is set: stand by, lead, and stand by again if the lease is lost."""
        while not stop.is_set():
            sent = time.monotonic()
            try:
                taken = await asyncio.to_thread(self.lease.try_acquire)
            except BusError as exc:
                log.warning("cannot reach Redis to take the lease (%s); standing by", exc)
                taken = False
            if not taken:
                await self.hand_over()
                await _wait(stop, self.period_s)
                continue
            self.last_good = sent
            await self._lead(stop)

    async def _lead(self, stop: asyncio.Event) -> None:
        self.lost.clear()
        renewer = asyncio.create_task(self._renew(), name="lease-renew")
        service = self.factory()
        self.service = service
        bus = getattr(getattr(service, "core", None), "bus", None)
        if bus is not None and hasattr(bus, "may_read"):
            bus.may_read = self.lease_fresh
        starting = asyncio.create_task(service.start(), name="controller-start")
        stopped = asyncio.create_task(stop.wait())
        lost = asyncio.create_task(self.lost.wait())
        fenced_event: asyncio.Event = getattr(service, "fenced", None) or asyncio.Event()
        fenced = asyncio.create_task(fenced_event.wait())
        retake = False
        try:
            await asyncio.wait({starting, stopped, lost, fenced}, return_when=asyncio.FIRST_COMPLETED)
            if fenced_event.is_set():
                pass
            elif starting.done() and not starting.cancelled() and starting.exception() is None:
                self.active.set()
                log.info("controller active (lease %s, fencing token %s)", self.lease.owner, self.lease.token)
                await asyncio.wait({stopped, lost, fenced}, return_when=asyncio.FIRST_COMPLETED)
            elif starting.done() and not starting.cancelled():
                log.error("controller failed to start", exc_info=starting.exception())
        finally:
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            self.active.clear()
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)
            for task in (stopped, lost, fenced):
                task.cancel()
            if fenced_event.is_set() and not self.lost.is_set():
                retake = await self._check_after_fence(service)
                if not retake:
                    self.lost.set()
            if self.lost.is_set():
                self.step_downs += 1
                log.error("lease lost: stepping down, handing the engines over to the next controller")
                await service.stop(stop_engines=False)
            elif retake:
                await service.stop(stop_engines=False)  # the next service adopts them, with the raised token
            else:
                await service.stop()
                await self._stop_launched()
                with contextlib.suppress(BusError):  # unreleased, it lapses by itself
                    await asyncio.to_thread(self.lease.release)
            self.service = None
        if self.cooling:  # something keeps raising tokens: let another controller try, then try again
            self.cooling = False
            with contextlib.suppress(BusError):
                await asyncio.to_thread(self.lease.release)
            await _wait(stop, self.ttl_s)
        if self.lost.is_set():
            await self.hand_over()
        elif not stop.is_set() and not retake:
            await _wait(stop, self.period_s)

    async def _check_after_fence(self, service: Service) -> bool:
        """A fence refusal: True when the lease is still ours and the counter was raised past every token an
        engine said it has seen (take over again with it); False to step down."""
        highest = int(getattr(service, "fence_highest", 0) or 0)
        now = time.monotonic()
        self.retakes = [t for t in self.retakes if now - t < 10 * self.ttl_s]
        if len(self.retakes) >= MAX_RETAKES:
            log.error("fenced again after %d takeovers with a raised token within %.0fs: stepping down and "
                      "releasing the lease for a lease's time", len(self.retakes), 10 * self.ttl_s)
            self.cooling = True
            return False
        try:
            token = await asyncio.to_thread(self.lease.raise_above, max(highest, self.lease.token or 0))
        except (BusError, ValueError) as exc:
            log.error("fenced, and the lease cannot be checked (%s): stepping down", exc)
            return False
        if not token:
            log.error("fenced: the lease %s is no longer ours", self.lease.key)
            return False
        log.error("fenced while Redis says the lease is ours: Redis lost data (an engine saw token %d); taking "
                  "over again with token %d", highest, token)
        self.retakes.append(now)
        return True

    async def _stop_launched(self) -> None:
        """A stop that leaves no leader behind: every engine this process launched that its service did not
        stop (one the service never took over: a stop that came while it was starting) is stopped too."""
        if self.launched is None:
            return
        for engine in self.launched.alive():
            log.warning("engine %s (pid %d) was not taken over by the service that stopped: stopping it",
                        engine.engine_id, engine.pid)
            await ProcessHandle(engine.pid).stop(grace_s=5.0)
            self.launched.drop(engine.engine_id, engine.pid)

    async def hand_over(self) -> None:
        """While another controller holds the lease: stop each engine this process launched that the registry
        does not list with its pid (that leader cannot adopt it); the listed ones are its engines now."""
        if self.launched is None or self.registry is None or not self.launched.engines():
            return
        registry = self.registry
        try:
            holder = await asyncio.to_thread(self.lease.holder)
            if holder is None or holder == self.lease.owner:
                return  # nobody leads (we may take over again and adopt them), or we do
            records = await asyncio.to_thread(registry.engines)
        except BusError as exc:
            log.warning("cannot read the registry to hand the engines over (%s); trying again", exc)
            return
        for engine in self.launched.alive():
            if engine.listed_in(records):
                log.info("engine %s (pid %d) handed over to %s", engine.engine_id, engine.pid, holder)
            else:
                log.warning("engine %s (pid %d) is not in the registry %s leads from: stopping it",
                            engine.engine_id, engine.pid, holder)
                await ProcessHandle(engine.pid).stop(grace_s=5.0)
            self.launched.drop(engine.engine_id, engine.pid)

    def lease_fresh(self) -> bool:
        """Whether the lease is still good by this process's clock: its last good renewal was sent less than the
        renewal deadline ago (the same deadline ``_renew`` steps down at; a process paused past it wakes with
        this False)."""
        return time.monotonic() < self.last_good + self.ttl_s - self.margin_s

    async def _renew(self) -> None:
        deadline_s = self.ttl_s - self.margin_s
        while True:
            await asyncio.sleep(min(self.period_s, max(0.0, self.last_good + deadline_s - time.monotonic())))
            left = self.last_good + deadline_s - time.monotonic()
            if left <= 0:
                log.error("no good lease renewal for %.2fs (lease %.2fs): stepping down before a standby takes "
                          "over", time.monotonic() - self.last_good, self.ttl_s)
                self.lost.set()
                return
            sent = time.monotonic()
            try:
                held = await asyncio.wait_for(asyncio.to_thread(self.lease.renew), timeout=left)
            except TimeoutError:
                log.warning("lease renewal did not answer within %.2fs", left)
                continue
            except Exception as exc:
                log.warning("lease renewal failed: %s", exc)
                continue
            if not held:
                log.error("lease %s is held by someone else now", self.lease.key)
                self.lost.set()
                return
            self.last_good = sent


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)
