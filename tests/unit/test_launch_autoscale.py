"""The executor autoscaler's decision: samples in, a target out, with hysteresis and cooldowns."""

from __future__ import annotations

import pytest

from rollout_bus.launch.autoscale import (
    DEFAULT_RANGE,
    Decision,
    Sample,
    ScalePolicy,
    ScalerState,
    decide,
    parse_executors,
)
from rollout_bus.launch.cli import build_parser, config_from_args
from rollout_bus.launch.config import metrics_ports

POLICY = ScalePolicy(min=1, max=6, up_depth=1, up_age_s=5.0, up_samples=2, up_cooldown_s=3.0, down_samples=3,
                     down_cooldown_s=10.0)


def run(samples: list[tuple[float, int, float, int]], start: int, policy: ScalePolicy = POLICY) -> list[Decision]:
    """Feed ``(now_s, depth, oldest_age_s, busy)`` samples, applying each decision as the fleet would."""
    state, current, out = ScalerState(), start, []
    for now, depth, age, busy in samples:
        decision = decide(policy, state, Sample(now, depth, age, busy, current))
        state, current = decision.state, decision.target
        out.append(decision)
    return out


def test_a_backlog_seen_once_does_not_scale_but_seen_twice_scales_to_the_demand() -> None:
    one = run([(0, 4, 0.1, 1)], start=1)
    assert [d.target for d in one] == [1]
    two = run([(0, 4, 0.1, 1), (1, 4, 1.1, 1)], start=1)
    assert [(d.target, d.reason) for d in two] == [(1, "hold"), (5, "backlog")]  # 1 running + 4 waiting


def test_the_target_never_passes_max_however_deep_the_backlog() -> None:
    out = run([(0, 50, 0.0, 1), (1, 50, 1.0, 1)], start=1)
    assert out[-1].target == POLICY.max


def test_an_old_job_scales_up_even_when_the_backlog_is_below_the_depth_threshold() -> None:
    policy = ScalePolicy(min=1, max=4, up_depth=3, up_age_s=5.0, up_samples=2)
    young = run([(0, 1, 1.0, 1), (1, 1, 2.0, 1)], start=1, policy=policy)
    assert young[-1].target == 1
    old = run([(0, 1, 5.0, 1), (1, 1, 6.0, 1)], start=1, policy=policy)
    assert (old[-1].target, old[-1].reason) == (2, "age")


def test_pressure_must_be_consecutive() -> None:
    out = run([(0, 2, 0, 1), (1, 0, 0, 1), (2, 2, 0, 1), (3, 0, 0, 1)], start=1)
    assert all(d.target == 1 for d in out)


def test_no_second_step_up_within_the_up_cooldown() -> None:
    out = run([(0, 2, 0, 1), (1, 2, 0, 1),  # -> 3 at t=1
               (2, 5, 0, 3), (3, 5, 0, 3),  # pressure again, but only 2 s later
               (4, 5, 0, 3)], start=1)  # 3 s after the change: up again
    assert [d.target for d in out] == [1, 3, 3, 3, 6]


def test_scale_down_needs_sustained_idleness_and_goes_one_at_a_time() -> None:
    samples = [(float(t), 0, 0.0, 0) for t in range(100, 112)]
    out = run(samples, start=4)
    targets = [d.target for d in out]
    assert targets[:2] == [4, 4]  # two idle samples are not enough
    assert targets[2] == 3 and out[2].reason == "idle"  # the third: one fewer
    assert targets[3:5] == [3, 3]  # idle counting starts again, and the cooldown holds
    assert min(targets) >= POLICY.min


def test_scale_down_waits_for_the_down_cooldown_after_a_scale_up() -> None:
    out = run([(0, 2, 0, 1), (1, 2, 0, 1),  # up to 3 at t=1
               (2, 0, 0, 0), (3, 0, 0, 0), (4, 0, 0, 0), (5, 0, 0, 0),  # idle, but within 10 s of the change
               (11, 0, 0, 0)], start=1)
    assert [d.target for d in out] == [1, 3, 3, 3, 3, 3, 2]


def test_scale_down_never_goes_below_the_jobs_running() -> None:
    policy = ScalePolicy(min=0, max=4, down_samples=1, down_cooldown_s=0)
    out = run([(0, 0, 0, 2), (1, 0, 0, 2), (2, 0, 0, 2)], start=3, policy=policy)
    assert [d.target for d in out] == [2, 2, 2]  # 3 -> 2; then every executor is busy: no idle sample


def test_an_idle_fleet_at_its_minimum_holds() -> None:
    out = run([(float(t), 0, 0.0, 0) for t in range(30)], start=1)
    assert {d.target for d in out} == {1} and {d.reason for d in out} == {"hold"}


def test_counts_outside_the_bounds_are_brought_back_at_once() -> None:
    assert decide(POLICY, ScalerState(), Sample(0, 0, 0, 0, 0)).target == POLICY.min
    assert decide(POLICY, ScalerState(), Sample(0, 0, 0, 0, 0)).reason == "min"
    above = decide(POLICY, ScalerState(), Sample(0, 0, 0, 0, 9))
    assert (above.target, above.reason) == (POLICY.max, "max")


def test_min_zero_scales_from_nothing_on_a_backlog() -> None:
    policy = ScalePolicy(min=0, max=3, up_samples=1)
    out = run([(0, 2, 0.0, 0)], start=0, policy=policy)
    assert (out[0].target, out[0].reason) == (2, "backlog")


def test_nonsense_inputs_count_as_nothing() -> None:
    out = decide(POLICY, ScalerState(), Sample(0, -5, -3.0, -1, 2))
    assert out.target == 2 and out.state.over == 0


@pytest.mark.parametrize(("spec", "expected"), [("3", 3), ("auto", DEFAULT_RANGE), ("auto:1-5", (1, 5)),
                                                 ("auto:2-2", (2, 2)), (" auto:1-8 ", (1, 8))])
def test_executors_specs_parse(spec: str, expected: int | tuple[int, int]) -> None:
    parsed = parse_executors(spec)
    got = parsed if isinstance(parsed, int) else (parsed.min, parsed.max)
    assert got == expected


@pytest.mark.parametrize(("spec", "says"), [
    ("auto:5-2", "MIN (5) must not exceed MAX (2)"),
    ("auto:-1-3", "MIN must be >= 0, got -1"),
    ("auto:0-0", "MAX must be >= 1, got 0"),
    ("auto:0-5", "MIN must be >= 1 in a run"),
    ("auto:1", "auto:MIN-MAX"),
    ("auto:a-b", "auto:MIN-MAX"),
    ("auto:", "auto:MIN-MAX"),
    ("automatic", "auto:MIN-MAX"),
    ("0", "a fixed count must be >= 1"),
    ("-2", "auto:MIN-MAX"),
    ("", "auto:MIN-MAX"),
])
def test_bad_executors_specs_say_what_to_write(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match="--executors") as info:
        parse_executors(spec)
    assert says in str(info.value)


def test_bad_policy_values_are_refused() -> None:
    with pytest.raises(ValueError, match="must not exceed"):
        ScalePolicy(min=3, max=2)
    with pytest.raises(ValueError, match="finite"):
        ScalePolicy(up_age_s=float("nan"))


def test_the_run_command_takes_auto_and_sizes_metrics_ports_for_max() -> None:
    config = config_from_args(build_parser().parse_args(["--executors", "auto:1-3", "--metrics-base-port", "9000"]))
    assert config.autoscale is not None and (config.autoscale.min, config.autoscale.max) == (1, 3)
    ports = metrics_ports(config)
    assert [n for n in ports if n.startswith("executor-")] == ["executor-0", "executor-1", "executor-2"]
    fixed = config_from_args(build_parser().parse_args(["--executors", "2"]))
    assert fixed.autoscale is None and fixed.executors == 2


@pytest.mark.parametrize("spec", ["auto:5-2", "auto:-1-3", "0"])
def test_the_run_command_exits_with_the_reason(spec: str) -> None:
    with pytest.raises(SystemExit) as info:
        config_from_args(build_parser().parse_args(["--executors", spec]))
    assert "--executors" in str(info.value.code)
