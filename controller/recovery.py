"""Rebuilding the controller's view after a restart: a fold over the engine event log.

The log says which engines exist (``EngineLaunching`` carries url, backend and whether
the controller launched it; ``EngineStopped`` retires one); the registry adds what the
log does not carry (pid, versions, last state). Each engine still in the view is then
probed over HTTP by the service, which adopts the live ones and replaces the dead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from rollout_bus.events.registry import EngineRecord, EngineState
from rollout_bus.events.schema import (
    EngineDraining,
    EngineLaunching,
    EngineOffloaded,
    EngineOnloaded,
    EngineReady,
    EngineRestarting,
    EngineServing,
    EngineStopped,
    EngineUnhealthy,
    Event,
)


@dataclass
class KnownEngine:
    engine_id: str
    url: str
    backend: str
    managed: bool
    state: EngineState
    pid: int | None = None
    versions: dict[str, int] = field(default_factory=dict)
    offloaded_tags: list[str] = field(default_factory=list)
    generate_url: str = ""


def fold_engine_log(events: Iterable[Event]) -> dict[str, KnownEngine]:
    """Engines the log says exist, with their last state; stopped ones are dropped."""
    known: dict[str, KnownEngine] = {}
    for event in events:
        if isinstance(event, EngineLaunching):
            previous = known.get(event.engine_id)
            known[event.engine_id] = KnownEngine(
                event.engine_id, event.url, event.backend, event.managed, EngineState.LAUNCHING,
                versions=previous.versions if previous else {})
            continue
        engine_id = getattr(event, "engine_id", None)
        if not isinstance(engine_id, str) or engine_id not in known:
            continue
        engine = known[engine_id]
        if isinstance(event, EngineStopped):
            del known[engine_id]
        elif isinstance(event, EngineReady):
            engine.state = EngineState.PENDING_WEIGHTS
        elif isinstance(event, EngineServing):
            engine.state = EngineState.SERVING
            engine.versions = dict(event.versions)
            engine.offloaded_tags = []
        elif isinstance(event, EngineUnhealthy):
            engine.state = EngineState.UNHEALTHY
        elif isinstance(event, EngineRestarting):
            engine.state = EngineState.RESTARTING
        elif isinstance(event, EngineDraining):
            engine.state = EngineState.DRAINING
        elif isinstance(event, EngineOffloaded):
            engine.offloaded_tags = sorted(set(engine.offloaded_tags) | set(event.tags))
            engine.state = EngineState.OFFLOADED
        elif isinstance(event, EngineOnloaded):
            engine.offloaded_tags = sorted(set(engine.offloaded_tags) - set(event.tags))
    return known


def merge_registry(known: dict[str, KnownEngine], records: Mapping[str, EngineRecord]) -> dict[str, KnownEngine]:
    """Overlay registry records (newer than the log for pid, url, versions, state).

    An engine only in the registry (its events trimmed away by retention) is kept; one
    the log retired is kept out unless the registry still lists it as running.
    """
    out = dict(known)
    for engine_id, rec in records.items():
        if rec.state == EngineState.STOPPED:
            out.pop(engine_id, None)
            continue
        out[engine_id] = KnownEngine(engine_id, rec.url, rec.backend, rec.managed, rec.state, rec.pid,
                                     dict(rec.versions), list(rec.offloaded_tags), rec.generate_url)
    return out
