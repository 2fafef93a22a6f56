"""Cells and colocation, the parts that need no engine: the scale count's grammar, pool bounds, the draining
state, and the checks that refuse ``--colocate`` where engines cannot release memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_bus.controller.backends import LaunchSpec, make_backend
from rollout_bus.controller.config import ConfigError, ControllerConfig
from rollout_bus.controller.state import IllegalTransition, check_transition
from rollout_bus.events.errors import InvalidRequest
from rollout_bus.events.registry import EngineState
from rollout_bus.events.schema import EnginesScaled, Producer, ScaleEngines, decode, encode, scale_target
from rollout_bus.launch.cli import build_parser, config_from_args
from rollout_bus.trainer.config import ConfigError as TrainerConfigError
from rollout_bus.trainer.config import ScheduleConfig, TrainerConfig

S = EngineState


@pytest.mark.parametrize(("count", "current", "target"), [("3", 1, 3), ("+2", 1, 3), ("-1", 2, 1), ("-3", 2, -1),
                                                          (" 0 ", 4, 0)])
def test_a_count_is_a_size_or_a_signed_change(count: str, current: int, target: int) -> None:
    assert scale_target(count, current) == target


@pytest.mark.parametrize("count", ["", "two", "+", "1.5", "--1", "+-1", "1e3", "١", "9999999"])
def test_a_malformed_count_says_what_to_give(count: str) -> None:
    with pytest.raises(InvalidRequest, match=r"malformed: give N \(the pool's new size\), \+K or -K"):
        scale_target(count, 1)


def test_scale_commands_and_answers_round_trip_and_a_bad_policy_name_is_refused_at_decode() -> None:
    producer = Producer("scale", "host-1")
    command = ScaleEngines(producer=producer, policy="p0", count="+1", request_id="r1")
    assert decode(encode(command)) == command
    answer = EnginesScaled(producer=producer, policy="p0", requested_by="scale/host-1", from_count=1, to_count=2,
                           outcome="done", engine_ids=["engine-1"], request_id="r1")
    assert decode(encode(answer)) == answer
    with pytest.raises(Exception, match="policy"):
        decode(encode(ScaleEngines(producer=producer, policy="../etc", count="1")))


def test_only_a_serving_engine_drains_and_a_draining_one_only_stops() -> None:
    check_transition(S.SERVING, S.DRAINING)
    check_transition(S.DRAINING, S.STOPPED)
    for state in (S.SERVING, S.PENDING_WEIGHTS, S.OFFLOADED):
        with pytest.raises(IllegalTransition):
            check_transition(S.DRAINING, state)
    with pytest.raises(IllegalTransition):
        check_transition(S.LAUNCHING, S.DRAINING)


def valid(tmp_path: Path, **kw: object) -> ControllerConfig:
    return ControllerConfig(**{"model_path": str(tmp_path), "weights_root": str(tmp_path), **kw})  # type: ignore[arg-type]


def test_pools_have_bounds_and_scaled_ids_follow_the_pool_naming(tmp_path: Path) -> None:
    cfg = valid(tmp_path, num_engines=2, pools=["p1=1"], max_engines=4, max_pools=["p1=2"]).validate()
    assert cfg.max_sizes() == {"default": 4, "p1": 2}
    assert cfg.expected_engines({"default": 3}) == {"engine-0": "default", "engine-1": "default",
                                                    "engine-2": "default", "engine-p1-0": "p1"}
    with pytest.raises(ConfigError) as info:
        valid(tmp_path, num_engines=3, max_engines=2, max_pools=["nope=1"]).validate()
    assert "starts with 3 engines, above its bound of 2" in str(info.value)
    assert "max_pools names ['nope'], which have no pool" in str(info.value)


def test_colocate_refuses_engines_that_cannot_release_memory(tmp_path: Path) -> None:
    valid(tmp_path, colocate=True).validate()  # the CPU engine frees its weights
    valid(tmp_path, colocate=True, backend="sglang", model_path="Qwen/Qwen3-0.6B").validate()  # memory saver on
    with pytest.raises(ConfigError, match="SGLang does that only with --enable-memory-saver"):
        valid(tmp_path, colocate=True, backend="sglang", model_path="Qwen/Qwen3-0.6B", memory_saver=False).validate()
    with pytest.raises(ConfigError, match="cannot vouch for adopted engines"):
        valid(tmp_path, colocate=True, num_engines=0, adopt_urls=["http://10.0.0.2:30000"]).validate()
    spec = LaunchSpec(engine_id="e", host="127.0.0.1", port=1, model_path="m", weight_version=0, python="python")
    assert "--enable-memory-saver" not in make_backend("sglang", memory_saver=False).command(spec)  # type: ignore[attr-defined]
    assert "--enable-memory-saver" in make_backend("sglang").command(spec)


def test_run_colocate_is_sync_by_default_and_fails_fast_on_what_it_cannot_do() -> None:
    assert config_from_args(build_parser().parse_args(["--colocate"])).mode == "sync"
    assert config_from_args(build_parser().parse_args([])).mode == "async"
    for args, needle in ((["--colocate", "--mode", "async"], "--colocate needs --mode sync"),
                         (["--colocate", "--controller-arg=--backend=sglang", "--controller-arg=--no-memory-saver"],
                          "--enable-memory-saver"),
                         (["--colocate", "--trainers", "2", "--model", "/nowhere"], "needs --full")):
        with pytest.raises(SystemExit, match=needle):
            config_from_args(build_parser().parse_args(args))


def test_a_colocated_trainer_needs_sync_mode() -> None:
    with pytest.raises(TrainerConfigError, match="colocate needs mode 'sync'"):
        TrainerConfig(policy="p0", schedule=ScheduleConfig(mode="async", colocate=True)).validate()
