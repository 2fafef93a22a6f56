"""Rebuilding the controller's view from the engine event log and the registry."""

from __future__ import annotations

from rollout_bus.controller.recovery import fold_engine_log, merge_registry
from rollout_bus.events.registry import EngineRecord, EngineState
from rollout_bus.events.schema import (
    EngineLaunching,
    EngineOffloaded,
    EngineReady,
    EngineRestarting,
    EngineServing,
    EngineStopped,
    EngineUnhealthy,
    Producer,
)

P = Producer("controller", "test")
S = EngineState


def test_the_log_folds_into_the_live_engines_with_their_last_state_and_url() -> None:
    log = [
        EngineLaunching(producer=P, engine_id="engine-0", url="http://h:1", backend="cpu"),
        EngineLaunching(producer=P, engine_id="engine-1", url="http://h:2", backend="cpu"),
        EngineLaunching(producer=P, engine_id="x", url="http://h:9", backend="external", managed=False),
        EngineReady(producer=P, engine_id="engine-0", url="http://h:1"),
        EngineServing(producer=P, engine_id="engine-0", url="http://h:1", versions={"default": 3}),
        EngineReady(producer=P, engine_id="engine-1", url="http://h:2"),
        EngineServing(producer=P, engine_id="engine-1", url="http://h:2", versions={"default": 3}),
        EngineUnhealthy(producer=P, engine_id="engine-1", reason="boom", failures=3),
        EngineRestarting(producer=P, engine_id="engine-1", attempt=1),
        EngineLaunching(producer=P, engine_id="engine-1", url="http://h:3", backend="cpu"),
        EngineOffloaded(producer=P, engine_id="engine-0", tags=["weights"]),
        EngineStopped(producer=P, engine_id="x", reason="gone"),
        EngineServing(producer=P, engine_id="never-launched", url="http://h:4", versions={}),
    ]
    known = fold_engine_log(log)
    assert sorted(known) == ["engine-0", "engine-1"]
    assert (known["engine-0"].state, known["engine-0"].offloaded_tags) == (S.OFFLOADED, ["weights"])
    assert known["engine-0"].versions == {"default": 3}
    assert (known["engine-1"].state, known["engine-1"].url) == (S.LAUNCHING, "http://h:3")
    assert known["engine-1"].versions == {"default": 3}


def test_registry_records_add_pids_and_win_over_the_log_and_stopped_ones_drop_out() -> None:
    known = fold_engine_log([EngineLaunching(producer=P, engine_id="engine-0", url="http://h:1", backend="cpu")])
    records = {
        "engine-0": EngineRecord("engine-0", "http://h:1", S.SERVING, pid=42, versions={"default": 5}),
        "engine-1": EngineRecord("engine-1", "http://h:2", S.SERVING, pid=43),  # its events were trimmed
        "engine-2": EngineRecord("engine-2", "http://h:3", S.STOPPED, pid=44),
    }
    merged = merge_registry(known, records)
    assert sorted(merged) == ["engine-0", "engine-1"]
    assert (merged["engine-0"].pid, merged["engine-0"].state, merged["engine-0"].versions) == (
        42, S.SERVING, {"default": 5})


def test_an_sglang_engines_generate_url_survives_a_controller_restart() -> None:
    """Behind its fence guard an SGLang engine takes /generate on a port of its own: a new controller keeps it."""
    records = {"engine-0": EngineRecord("engine-0", "http://h:1", S.SERVING, backend="sglang", pid=42,
                                        generate_url="http://h:2")}
    assert merge_registry({}, records)["engine-0"].generate_url == "http://h:2"
