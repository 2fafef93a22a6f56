"""The engine state machine and the controller's in-memory view of one engine.

::

    launching ──► pending_weights ──► serving ──► offloaded ──► serving
        │               │                │   ▲         │
        └──────► unhealthy ◄─────────────┘   └─ pending_weights (onload, weights behind)
                                         │
                                         └──► draining ──► stopped   (scaled down: requests in flight end first)
                    │  ▲
                    ▼  │ (relaunch failed)
               restarting ──► launching        any state ──► stopped

An engine joins ``serving`` only from ``pending_weights`` (it got the latest weights of
every policy) or from ``offloaded`` (its memory is back and its weights are current).
Adopted engines go ``unhealthy ──► pending_weights`` when they answer again, since
whoever launched them restarts them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from rollout_bus.controller.backends import ProcessHandle
from rollout_bus.engine.http_client import EngineClient
from rollout_bus.events.errors import Failure
from rollout_bus.events.registry import EngineRecord, EngineState

S = EngineState

TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    S.LAUNCHING: frozenset({S.PENDING_WEIGHTS, S.UNHEALTHY, S.STOPPED}),
    S.PENDING_WEIGHTS: frozenset({S.SERVING, S.UNHEALTHY, S.STOPPED}),
    S.SERVING: frozenset({S.UNHEALTHY, S.OFFLOADED, S.PENDING_WEIGHTS, S.DRAINING, S.STOPPED}),
    S.UNHEALTHY: frozenset({S.RESTARTING, S.PENDING_WEIGHTS, S.STOPPED}),
    S.RESTARTING: frozenset({S.LAUNCHING, S.UNHEALTHY, S.STOPPED}),
    S.OFFLOADED: frozenset({S.SERVING, S.PENDING_WEIGHTS, S.UNHEALTHY, S.STOPPED}),
    S.DRAINING: frozenset({S.UNHEALTHY, S.STOPPED}),
    S.STOPPED: frozenset(),
}


class IllegalTransition(Failure):
    """A transition the state machine does not allow: a controller bug, never an engine fault."""


def check_transition(current: EngineState, target: EngineState) -> None:
    if target not in TRANSITIONS[current]:
        allowed = sorted(s.value for s in TRANSITIONS[current])
        raise IllegalTransition(f"engine cannot go {current.value} -> {target.value} (allowed: {allowed})")


@dataclass
class EngineHandle:
    """One engine as the controller sees it: its published record plus runtime state.

    ``lock`` serialises the operations that change an engine (weight updates, offload,
    onload, restart), so two of them never interleave their pause/continue calls.
    """

    record: EngineRecord
    client: EngineClient
    process: ProcessHandle | None = None
    failures: int = 0
    restart_attempts: int = 0
    """Restarts since the engine last served (``controller.lifecycle``)."""
    last_failure: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def engine_id(self) -> str:
        return self.record.engine_id

    @property
    def state(self) -> EngineState:
        return self.record.state

    @property
    def managed(self) -> bool:
        return self.record.managed

    @property
    def busy(self) -> bool:
        return self.lock.locked()

    def process_dead(self) -> bool:
        """True only when we know the process is gone (a managed engine whose pid died)."""
        return self.process is not None and not self.process.alive()

    def move(self, target: EngineState) -> EngineState:
        """Change state after checking the transition; returns the previous state."""
        previous = self.record.state
        check_transition(previous, target)
        self.record.state = target
        return previous
