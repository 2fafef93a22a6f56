"""The engine state machine: the roads into serving, and the moves it refuses."""

from __future__ import annotations

import pytest

from rollout_bus.controller.state import TRANSITIONS, EngineHandle, IllegalTransition, check_transition
from rollout_bus.engine.http_client import EngineClient
from rollout_bus.events.registry import EngineRecord, EngineState

S = EngineState


def walk(*states: EngineState) -> None:
    for current, target in zip(states, states[1:], strict=False):
        check_transition(current, target)


def test_every_state_has_a_rule_and_stopped_is_final() -> None:
    assert set(TRANSITIONS) == set(EngineState)
    assert TRANSITIONS[S.STOPPED] == frozenset()


def test_launch_restart_offload_and_recovery_paths_are_allowed() -> None:
    walk(S.LAUNCHING, S.PENDING_WEIGHTS, S.SERVING)
    walk(S.SERVING, S.UNHEALTHY, S.RESTARTING, S.LAUNCHING, S.PENDING_WEIGHTS, S.SERVING)
    walk(S.RESTARTING, S.UNHEALTHY, S.RESTARTING)
    walk(S.SERVING, S.OFFLOADED, S.SERVING)
    walk(S.SERVING, S.UNHEALTHY, S.PENDING_WEIGHTS, S.SERVING)  # an adopted engine answering again
    for state in EngineState:
        if state != S.STOPPED:
            check_transition(state, S.STOPPED)


@pytest.mark.parametrize(("current", "target"), [
    (S.LAUNCHING, S.SERVING),            # never serve before the latest weights are in
    (S.RESTARTING, S.SERVING),
    (S.UNHEALTHY, S.SERVING),
    (S.PENDING_WEIGHTS, S.OFFLOADED),
    (S.STOPPED, S.LAUNCHING),
    (S.SERVING, S.RESTARTING),           # restarting goes through unhealthy, which is announced
])
def test_moves_that_skip_a_step_are_refused(current: EngineState, target: EngineState) -> None:
    with pytest.raises(IllegalTransition, match=f"{current.value} -> {target.value}"):
        check_transition(current, target)


def test_handle_move_changes_state_only_when_allowed() -> None:
    h = EngineHandle(EngineRecord("e", "http://127.0.0.1:1", S.LAUNCHING), EngineClient("http://127.0.0.1:1"))
    assert h.move(S.PENDING_WEIGHTS) == S.LAUNCHING
    with pytest.raises(IllegalTransition):
        h.move(S.LAUNCHING)
    assert h.state == S.PENDING_WEIGHTS
    assert not h.process_dead()
