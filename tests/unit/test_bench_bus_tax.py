"""The arithmetic of bench/bench_bus_tax.py: steady state, ABAB order, per-repeat ratios, verdict rows,
the check that the direct loop's engine is started as the controller starts it, the bus side's figures from
the batches it delivered, the run flags that keep the executors supplied, the placement of the direct loop and
the per-role CPU profile."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_bus_tax import (  # noqa: E402
    FROZEN_LR,
    SUPPLY_TIMEOUT_S,
    TARGET,
    CpuWatch,
    Point,
    RunFigures,
    Steady,
    Work,
    bus_flags,
    cpu_between,
    default_placement,
    delivered_points,
    engine_command,
    environ,
    launched_commands,
    median_profiles,
    ms_per_sample,
    per_repeat_ratios,
    pinned,
    ratio_rows,
    role_of,
    same_command,
    schedule,
    steady,
    step_points,
)
from verdict import Load  # noqa: E402


def test_steady_state_leaves_the_first_point_out_and_counts_from_it() -> None:
    points = [Point(10.0, 128, 300), Point(12.0, 128, 310), Point(14.0, 64, 150)]
    s = steady(points)
    assert (s.samples, s.tokens, s.window_s) == (192, 460, 4.0)
    assert s.samples_per_s == 48.0
    assert s.tokens_per_s == 115.0
    assert s.tokens_per_sample == pytest.approx(460 / 192)


def test_steady_state_orders_points_by_time() -> None:
    shuffled = [Point(14.0, 64, 150), Point(10.0, 1000, 1000), Point(12.0, 128, 310)]
    assert steady(shuffled).samples == 192  # the earliest point is the one left out, wherever it was listed


def test_steady_state_matches_the_run_summary_definition() -> None:
    # launch.report.PolicySummary.samples_per_s: sum(samples[1:]) / (ts[-1] - ts[0])
    from rollout_bus.launch.report import PolicySummary

    summary = PolicySummary("p0", step_ts_ms=[1000, 3000, 4500, 9000], samples=[16.0, 16.0, 12.0, 16.0])
    points = [Point(ts / 1000, n, 0) for ts, n in zip(summary.step_ts_ms, summary.samples, strict=True)]
    assert steady(points).samples_per_s == pytest.approx(summary.samples_per_s())


def test_steady_state_needs_two_points_and_a_window() -> None:
    with pytest.raises(ValueError):
        steady([Point(1.0, 1, 1)])
    assert math.isnan(steady([Point(1.0, 1, 1), Point(1.0, 1, 1)]).samples_per_s)


def test_runs_alternate_bus_and_direct_within_each_repeat() -> None:
    assert schedule(3) == [(0, "bus"), (0, "direct"), (1, "bus"), (1, "direct"), (2, "bus"), (2, "direct")]
    assert schedule(0) == []


def test_ratios_pair_each_repeat_and_skip_a_missing_baseline() -> None:
    assert per_repeat_ratios([90.0, 100.0, 50.0], [100.0, 100.0, 0.0]) == [0.9, 1.0]
    assert per_repeat_ratios([float("nan"), 1.0], [1.0, float("nan")]) == []
    with pytest.raises(ValueError):
        per_repeat_ratios([1.0], [1.0, 2.0])


def test_rows_judge_both_ratios_against_the_target() -> None:
    quiet = Load(0.3, 0.05)
    figures = {"bus": {"samples_per_s": [98.0, 99.0, 100.0], "tokens_per_s": [80.0, 85.0, 90.0]},
               "direct": {"samples_per_s": [100.0, 100.0, 100.0], "tokens_per_s": [100.0, 100.0, 100.0]}}
    samples, tokens = ratio_rows(figures, quiet)
    assert samples.values == pytest.approx([0.98, 0.99, 1.0])
    assert samples.target == TARGET and str(TARGET) == ">= 0.97"
    assert samples.verdict.kind == "met"
    assert tokens.verdict.kind == "missed"


def test_rows_give_no_verdict_under_outside_load_or_with_too_few_repeats() -> None:
    figures = {"bus": {"samples_per_s": [99.0], "tokens_per_s": [99.0]},
               "direct": {"samples_per_s": [100.0], "tokens_per_s": [100.0]}}
    assert ratio_rows(figures, Load(0.2, 0.0))[0].verdict.kind == "no verdict"  # one repeat
    busy = {side: {m: v * 3 for m, v in f.items()} for side, f in figures.items()}
    assert ratio_rows(busy, Load(2.5, 0.0))[0].verdict.kind == "no verdict"
    assert ratio_rows(busy, Load(0.2, 0.0))[0].verdict.kind == "met"


def test_a_row_without_values_says_why() -> None:
    empty: dict[str, list[float]] = {"samples_per_s": [], "tokens_per_s": []}
    row = ratio_rows({"bus": empty, "direct": empty}, Load(0.1, 0.0))[0]
    assert row.verdict.kind == "no verdict" and "no repeat" in row.verdict.reason


def test_engine_commands_compare_apart_from_port_and_weights_root() -> None:
    ours = ["/venv/python", "-m", "rollout_bus.engine.server", "--port", "4001", "--model-path", "/m",
            "--weights-root", "/tmp/a", "--max-batch-size", "128"]
    theirs = ["/usr/bin/python3", "-m", "rollout_bus.engine.server", "--port", "5123", "--model-path", "/m",
              "--weights-root", "/runs/w", "--max-batch-size", "128"]
    assert same_command(ours, theirs) == []  # the interpreter is not compared either
    other = [*theirs[:-1], "64"]
    assert same_command(ours, other) == ["'128' != '64'"]
    assert "10 != 12 arguments" in same_command(ours, [*theirs, "--enable-lora", "x"])


def test_launch_lines_are_read_from_a_controller_log() -> None:
    log = ("2026-01-01 00:00:00,000 INFO rollout_bus.controller.backends: launching engine-0: /py -m "
           "rollout_bus.engine.server --port 4000 --model-path '/a b'\n"
           "2026-01-01 00:00:01,000 INFO something else: launching nothing\n")
    assert launched_commands(log) == [["/py", "-m", "rollout_bus.engine.server", "--port", "4000",
                                       "--model-path", "/a b"]]


def test_trainer_steps_come_from_the_metric_log_first_record_per_step(tmp_path: Path) -> None:
    rows = [{"step": 1, "time": 100.0, "metrics": {"batch/samples": 16, "batch/tokens": 40}},
            {"step": 2, "time": 102.0, "metrics": {"batch/samples": 16, "batch/tokens": 44}},
            {"step": 2, "time": 109.0, "metrics": {"batch/samples": 99, "batch/tokens": 99}},  # a restart's repeat
            {"step": 3, "time": 104.0, "metrics": {"batch/samples": 12, "batch/tokens": 30}}]
    log = tmp_path / "run-p0.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    points, records = step_points(log)
    assert [p.t for p in points] == [100.0, 102.0, 104.0]
    assert [r["step"] for r in records] == [1, 2, 3]
    s = steady(points)
    assert (s.samples, s.tokens, s.window_s) == (28, 74, 4.0)


# --- placement and supply ----------------------------------------------------------------------------------

def test_placement_defaults_to_disaggregated_where_there_are_cpus_to_split() -> None:
    assert default_placement(2) == "disaggregated"
    assert default_placement(16) == "disaggregated"
    assert default_placement(1) == "shared"


def _config(flags: list[str]):  # type: ignore[no-untyped-def]
    from rollout_bus.launch.cli import build_parser, config_from_args

    return config_from_args(build_parser().parse_args(flags))


def test_bus_flags_keep_every_request_in_flight_with_a_frozen_policy() -> None:
    flags = bus_flags(steps=50, executors=2, engines=1, model=None, learn=False, placement="disaggregated")
    config = _config(flags)
    assert config.mode == "async" and config.steps == 50 and config.executors == 2
    assert config.placement == "disaggregated"
    assert config.in_flight == 50 >= config.executors  # the trainer never holds the executors back
    assert config.max_staleness == 50  # no batch too stale to train
    assert config.lr == float(FROZEN_LR)
    assert config.rollout_timeout_s == SUPPLY_TIMEOUT_S  # the last request queued does not expire
    assert config.model is None


def test_bus_flags_for_a_hf_model_and_learning_runs() -> None:
    hf = bus_flags(steps=6, executors=1, engines=1, model="smollm2", learn=False, placement="shared")
    assert hf[hf.index("--model") + 1] == "smollm2"
    assert {"--no-dynamic-sampling", "--eval-groups"} <= set(hf)
    assert hf[hf.index("--placement") + 1] == "shared"
    learn = bus_flags(steps=6, executors=1, engines=1, model=None, learn=True, placement="shared")
    assert not {"--lr", "--in-flight", "--max-staleness", "--rollout-timeout-s"} & set(learn)


def test_run_flags_given_after_the_bench_flags_win() -> None:
    base = bus_flags(steps=20, executors=1, engines=1, model=None, learn=False, placement="disaggregated")
    config = _config([*base, "--in-flight", "3", "--placement", "shared"])
    assert config.in_flight == 3 and config.placement == "shared"


def _work(config, placement, model: Path) -> Work:  # type: ignore[no-untyped-def]
    return Work(config, model, {}, lambda i: {}, lambda s: 0.0, {}, None, config.policies()[0], 1,
                placement)


def test_direct_engines_get_the_bus_engines_torch_threads_when_disaggregated(tmp_path: Path) -> None:
    from rollout_bus.launch.placement import plan

    config = _config(bus_flags(steps=4, executors=1, engines=1, model=None, learn=False, placement="disaggregated"))
    split = plan("disaggregated", engines=1, available=(0, 1, 2, 3), gpus=())
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):  # only looked for, not read
        (model / name).write_text("{}")
    cmd = engine_command(_work(config, split, model), tmp_path)
    assert cmd[cmd.index("--torch-threads") + 1] == str(split.engine_threads) == "2"
    shared = engine_command(_work(config, plan("shared"), model), tmp_path)
    assert "--torch-threads" not in shared
    assert split.env("controller")["OMP_NUM_THREADS"] == "2"  # what the bus run's engines inherit


def test_pinned_puts_this_process_on_the_set_and_back() -> None:
    home = sorted(os.sched_getaffinity(0))
    seen: list[set[int]] = []
    with pinned(home[:1], home):
        assert os.sched_getaffinity(0) == set(home[:1])
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
    assert seen == [set(home[:1])]  # threads started meanwhile inherit it
    assert os.sched_getaffinity(0) == set(home)
    with pinned(None, home[:1]):  # shared: left where it is
        assert os.sched_getaffinity(0) == set(home)


def test_environ_sets_and_restores() -> None:
    os.environ.pop("BENCH_BUS_TAX_X", None)
    os.environ["BENCH_BUS_TAX_Y"] = "old"
    try:
        with environ({"BENCH_BUS_TAX_X": "1", "BENCH_BUS_TAX_Y": "new"}):
            assert os.environ["BENCH_BUS_TAX_X"] == "1" and os.environ["BENCH_BUS_TAX_Y"] == "new"
        assert "BENCH_BUS_TAX_X" not in os.environ and os.environ["BENCH_BUS_TAX_Y"] == "old"
    finally:
        os.environ.pop("BENCH_BUS_TAX_Y", None)


# --- what the bus delivered --------------------------------------------------------------------------------

def test_delivered_batches_are_the_first_k_by_time_with_their_tokens() -> None:
    batches = [("b2", 3000, 16), ("b0", 1000, 16), ("b1", 2000, 12), ("b3", 4000, 16)]
    tokens = {"b0": 40.0, "b1": 30.0, "b2": 44.0, "b3": 50.0}
    points = delivered_points(batches, tokens, 3)
    assert points == [Point(1.0, 16, 40.0), Point(2.0, 12, 30.0), Point(3.0, 16, 44.0)]
    s = steady(points)  # batches 2..K over the time from the first delivery to the K-th
    assert (s.samples, s.tokens, s.window_s) == (28, 74, 2.0)


def test_a_batch_seen_twice_counts_once_and_missing_tokens_are_nan() -> None:
    points = delivered_points([("a", 1000, 8), ("a", 1500, 8), ("b", 1200, 8)], {"a": 10.0}, 5)
    assert [p.t for p in points] == [1.0, 1.2]
    assert math.isnan(points[1].tokens)


# --- the CPU profile ---------------------------------------------------------------------------------------

def test_roles_come_from_the_command_line() -> None:
    py = "/venv/bin/python"
    assert role_of([py, "-m", "rollout_bus", "controller", "--redis-url", "x"]) == "controller"
    assert role_of([py, "-m", "rollout_bus", "executor", "--index", "0"]) == "executors"
    assert role_of([py, "-m", "rollout_bus", "trainer", "--policy", "p0"]) == "trainer"
    assert role_of([py, "-m", "rollout_bus", "status", "--serve-metrics", "1"]) == "bus-metrics"
    assert role_of([py, "-m", "rollout_bus.engine.server", "--port", "1"]) == "engines"
    assert role_of(["/usr/bin/redis-server", "*:6379"]) == "redis"
    assert role_of([], "redis-server") == "redis"
    assert role_of([py, "-c", "pass"]) == "other"
    assert role_of([py, "-m", "rollout_bus"]) == "other"


def test_cpu_between_counts_each_role_over_the_samples_inside_the_window() -> None:
    a, b, c = (1, 10), (2, 20), (3, 30)
    samples = [(0.0, {a: 0, b: 0}), (1.0, {a: 100, b: 10}), (2.0, {a: 150, b: 20, c: 5}), (3.0, {a: 200, c: 25}),
               (9.0, {a: 900, c: 900})]
    roles = {a: "engines", b: "executors"}  # c has none: other
    ticks, span = cpu_between(samples, roles, 0.5, 3.5)
    assert span == 2.0  # from the sample at 1.0 to the one at 3.0
    assert ticks == {"engines": 100, "executors": 10, "other": 25}  # b up to its last sample; c from 0
    assert cpu_between(samples, roles, 3.5, 4.0) == ({}, 0.0)


def test_ms_per_sample() -> None:
    assert ms_per_sample(50, 100, 2.0, 250.0) == pytest.approx(1.0)  # 0.25 CPU-s/s at 250 samples/s: 1 ms each
    assert math.isnan(ms_per_sample(50, 100, 0.0, 250.0))
    assert math.isnan(ms_per_sample(50, 100, 2.0, float("nan")))


def test_median_profiles_take_a_missing_role_as_zero() -> None:
    def run(side: str, per: dict[str, float]) -> RunFigures:
        return RunFigures(side, 0, Steady(1, 1, 1), 1.0, {"profile": {"ms_per_sample": per}})

    runs = [run("bus", {"engines": 1.0, "redis": 0.1}), run("bus", {"engines": 3.0}), run("bus", {"engines": 2.0}),
            run("direct", {"engines": 0.5, "client": 0.2})]
    assert median_profiles(runs, "bus") == {"engines": 2.0, "redis": 0.0}
    assert list(median_profiles(runs, "direct")) == ["engines", "client"]


def test_cpu_watch_sees_this_process_and_its_children() -> None:
    code = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    with CpuWatch("client", interval_s=0.05) as watch:
        child = subprocess.Popen([sys.executable, "-c", code])
        t = time.process_time()
        while time.process_time() - t < 0.2:
            pass
        child.wait()
    roles = {info["pid"]: info["role"] for info in watch.seen.values()}
    assert roles[os.getpid()] == "client"
    assert roles.get(child.pid) == "other"
    t0, t1 = watch.samples[0][0], watch.samples[-1][0]
    profile = watch.profile(t0, t1, 1.0, wall=False)
    assert profile["cpu_share"]["client"] > 0 and profile["span_s"] > 0
    assert watch.cpus_by_role()["client"] == sorted(os.sched_getaffinity(0))
