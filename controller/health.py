"""Health checks: every engine at once, each bounded by one timeout.

A health round runs ``/health_generate`` on all engines concurrently (``asyncio.gather``), so
its duration is that of the slowest check, at most ``timeout_s``: 32 engines with one
hung take about one timeout, not 32. A healthy engine's load (running + waiting requests
over every data-parallel rank, from SGLang's ``GET /v1/loads``; ``/server_info`` carries no
request counts) is read in the same task, best effort.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollout_bus.engine.http_client import EngineClient, EngineHTTPError


@dataclass(frozen=True)
class HealthResult:
    engine_id: str
    ok: bool
    latency_s: float
    reason: str = ""
    load: int | None = None
    fenced: bool = False
    """The engine refused our fencing token: no failure of the engine's (``controller.core``)."""


def load_of(loads: Mapping[str, Any]) -> int | None:
    """Running + waiting requests over every rank of a ``/v1/loads`` reply; None when it has no figures."""
    ranks = loads.get("loads")
    if not isinstance(ranks, list):
        return None
    total, seen = 0, False
    for rank in ranks:
        if not isinstance(rank, dict):
            continue
        for key in ("num_running_reqs", "num_waiting_reqs"):
            value = rank.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                total += value
                seen = True
    return total if seen else None


async def check_engine(engine_id: str, client: EngineClient, timeout_s: float, *,
                       with_load: bool = False) -> HealthResult:
    started = time.perf_counter()
    try:
        await client.health_generate(timeout_s=timeout_s)
    except EngineHTTPError as exc:
        return HealthResult(engine_id, False, time.perf_counter() - started, exc.message if exc.status == 0
                            else f"HTTP {exc.status}: {exc.message}", fenced=exc.fenced)
    latency = time.perf_counter() - started
    load = None
    if with_load:
        try:
            load = load_of(await client.loads(timeout_s=timeout_s))
        except EngineHTTPError:
            load = None
    return HealthResult(engine_id, True, latency, load=load)


async def check_all(clients: Mapping[str, EngineClient], timeout_s: float, *,
                with_load: bool = False) -> list[HealthResult]:
    """Check every engine concurrently; results in the order of ``clients``."""
    return list(await asyncio.gather(*(
        check_engine(engine_id, client, timeout_s, with_load=with_load)
        for engine_id, client in clients.items())))
