"""Running a controller under the namespace lease: stand by, take over, renew, step down.

``LeaderRunner`` loops: try to take the lease (every ``ttl/3``) -> start the service ->
renew every ``ttl/3`` while running -> on stop, stop the service and release the lease;
on a lost lease (a renewal that finds someone else's token), stop the service at once
without touching the engines, and stand by again. Renewal starts as soon as the lease
is taken, so a slow start (engines launching) does not let it lapse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from rollout_bus.controller.lease import Lease

log = logging.getLogger(__name__)


class Service(Protocol):
    async def start(self) -> None: ...

    async def stop(self, *, stop_engines: bool | None = None) -> None: ...


class LeaderRunner:
    def __init__(self, lease: Lease, factory: Callable[[], Service], ttl_s: float) -> None:
        self.lease = lease
        self.factory = factory
        self.period_s = max(ttl_s / 3, 0.05)
        self.active = asyncio.Event()
        self.lost = asyncio.Event()
        self.service: Service | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop`` is set: stand by, lead, and stand by again if the lease is lost."""
        while not stop.is_set():
            if not await asyncio.to_thread(self.lease.try_acquire):
                await _wait(stop, self.period_s)
                continue
            await self._lead(stop)

    async def _lead(self, stop: asyncio.Event) -> None:
        self.lost.clear()
        renewer = asyncio.create_task(self._renew(), name="lease-renew")
        service = self.factory()
        self.service = service
        starting = asyncio.create_task(service.start(), name="controller-start")
        stopped = asyncio.create_task(stop.wait())
        lost = asyncio.create_task(self.lost.wait())
        try:
            await asyncio.wait({starting, stopped, lost}, return_when=asyncio.FIRST_COMPLETED)
            if starting.done() and starting.exception() is None:
                self.active.set()
                log.info("controller active (lease %s)", self.lease.owner)
                await asyncio.wait({stopped, lost}, return_when=asyncio.FIRST_COMPLETED)
            elif starting.done():
                log.error("controller failed to start", exc_info=starting.exception())
        finally:
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            self.active.clear()
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)
            stopped.cancel()
            lost.cancel()
            if self.lost.is_set():
                log.error("lease lost: stepping down, leaving the engines to the next controller")
                await service.stop(stop_engines=False)
            else:
                await service.stop()
                await asyncio.to_thread(self.lease.release)
            self.service = None
        if not stop.is_set() and not self.lost.is_set():
            await _wait(stop, self.period_s)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                held = await asyncio.to_thread(self.lease.renew)
            except Exception:
                log.exception("lease renewal failed; retrying")
                continue
            if not held:
                self.lost.set()
                return


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)
