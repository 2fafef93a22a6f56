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
- the service reports that a write was fenced (``service.fenced``): another controller
  holds a newer token.

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

from rollout_bus.controller.lease import Lease
from rollout_bus.events.errors import BusError

log = logging.getLogger(__name__)


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self, *, stop_engines: bool | None = None) -> None: ...


class LeaderRunner:
    def __init__(self, lease: Lease, factory: Callable[[], Service], ttl_s: float) -> None:
        self.lease = lease
        self.factory = factory
        self.ttl_s = ttl_s
        self.period_s = max(ttl_s / 3, 0.05)
        self.margin_s = ttl_s / 4
        self.active = asyncio.Event()
        self.lost = asyncio.Event()
        self.service: Service | None = None
        self.last_good: float = 0.0
        """``time.monotonic()`` when the last renewal that succeeded was sent."""
        self.step_downs = 0

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
                await _wait(stop, self.period_s)
                continue
            self.last_good = sent
            await self._lead(stop)

    async def _lead(self, stop: asyncio.Event) -> None:
        self.lost.clear()
        renewer = asyncio.create_task(self._renew(), name="lease-renew")
        service = self.factory()
        self.service = service
        starting = asyncio.create_task(service.start(), name="controller-start")
        stopped = asyncio.create_task(stop.wait())
        lost = asyncio.create_task(self.lost.wait())
        fenced_event: asyncio.Event | None = getattr(service, "fenced", None)
        fenced = asyncio.create_task(fenced_event.wait() if fenced_event is not None else asyncio.Event().wait())
        try:
            await asyncio.wait({starting, stopped, lost, fenced}, return_when=asyncio.FIRST_COMPLETED)
            if starting.done() and not starting.cancelled() and starting.exception() is None:
                self.active.set()
                log.info("controller active (lease %s, fencing token %s)", self.lease.owner, self.lease.token)
                await asyncio.wait({stopped, lost, fenced}, return_when=asyncio.FIRST_COMPLETED)
            elif starting.done() and not starting.cancelled():
                log.error("controller failed to start", exc_info=starting.exception())
            if fenced.done():
                log.error("a write was fenced: another controller holds a newer token")
                self.lost.set()
        finally:
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            self.active.clear()
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)
            for task in (stopped, lost, fenced):
                task.cancel()
            if self.lost.is_set():
                self.step_downs += 1
                log.error("lease lost: stepping down, leaving the engines to the next controller")
                await service.stop(stop_engines=False)
            else:
                await service.stop()
                with contextlib.suppress(BusError):  # unreleased, it lapses by itself
                    await asyncio.to_thread(self.lease.release)
            self.service = None
        if not stop.is_set() and not self.lost.is_set():
            await _wait(stop, self.period_s)

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
