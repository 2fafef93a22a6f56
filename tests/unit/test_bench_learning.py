"""How bench/bench_learning.py places a run's held-out evals in time and compares modes."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_learning import read_curve  # noqa: E402


def write_run(out: Path, evals: list[dict[str, object]], steps: list[dict[str, object]]) -> None:
    metrics = out / "metrics"
    metrics.mkdir(parents=True)
    (metrics / "run-x-p0-eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    (metrics / "run-x-p0.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))


def acc(value: float) -> dict[str, float]:
    return {"accuracy": value, "accuracy_lo": value - 0.1, "accuracy_hi": value + 0.1}


def test_an_eval_is_placed_when_its_step_finished_not_when_it_finished(tmp_path: Path) -> None:
    evals = [  # written in completion order: the step-2 eval finished after step 4 did
        {"phase": "before", "step": 0, "time": 100.0, "metrics": acc(0.2)},
        {"phase": "during", "step": 2, "time": 140.0, "metrics": acc(0.5)},
        {"phase": "after", "step": 4, "time": 150.0, "metrics": acc(0.4)},
        {"phase": "during", "step": 4, "time": 151.0, "error": "failed"},
    ]
    steps = [{"step": s, "time": 100.0 + 10 * s, "metrics": {"batch/samples": 16}} for s in range(1, 5)]
    write_run(tmp_path, evals, steps)
    curve = read_curve(tmp_path, "sync", 0, wall_s=99.0)
    assert [(p.step, p.t_s, p.accuracy) for p in curve.points] == [(0, 0.0, 0.2), (2, 20.0, 0.5), (4, 40.0, 0.4)]
    assert curve.train_s == 40.0 and curve.samples == 64
    assert curve.final == 0.4  # the after eval, not the best one
    assert curve.time_to(0.4) == 20.0 and curve.time_to(0.5) == 20.0 and curve.time_to(0.6) is None


def test_a_run_without_its_eval_before_training_is_an_error(tmp_path: Path) -> None:
    write_run(tmp_path, [{"phase": "after", "step": 2, "time": 5.0, "metrics": acc(0.4)}],
              [{"step": 1, "time": 1.0, "metrics": {}}])
    with pytest.raises(RuntimeError, match="no eval before training"):
        read_curve(tmp_path, "async", 1, wall_s=1.0)


def test_curves_written_by_json_come_back_whole_and_a_seed_is_not_given_twice(tmp_path: Path) -> None:
    from bench_learning import Curve, Point, load_curves, main, save_curves

    curves = [Curve("sync", 3, 10.0, 8.0, [Point(0, 0.0, 0.2, 0.1, 0.3), Point(4, 8.0, 0.5, 0.4, 0.6)], 64),
              Curve("async", 3, 9.0, 7.0, [Point(0, 0.0, 0.2, 0.1, 0.3)], 60)]
    path = tmp_path / "curves.json"
    save_curves(curves, path)
    back = load_curves(path)
    assert [(c.mode, c.seed, c.wall_s, c.train_s, c.samples, c.points) for c in back] == \
        [(c.mode, c.seed, c.wall_s, c.train_s, c.samples, c.points) for c in curves]
    assert back[0].time_to(0.5) == 8.0
    with pytest.raises(SystemExit, match="seed 3 is also run now"):
        main(["--seeds", "3", "--with", str(path)])


def test_earlier_curves_combine_into_one_file_and_a_seed_without_sync_is_left_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench_learning import Curve, Point, load_curves, main, save_curves

    def curve(mode: str, seed: int, final: float) -> Curve:
        return Curve(mode, seed, 10.0, 8.0, [Point(0, 0.0, 0.2, 0.1, 0.3), Point(4, 8.0, final, 0.1, 0.9)], 64)

    first, second, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "all.json"
    save_curves([curve("sync", 0, 0.5), curve("async", 0, 0.6)], first)
    save_curves([curve("async", 1, 0.4)], second)  # a stopped bench: seed 1 never ran sync
    summary = main(["--seeds", "", "--modes", "sync,async", "--with", str(first), "--with", str(second),
                    "--json", str(out)])
    assert "seeds without a sync run, left out of the comparison: [1]" in capsys.readouterr().out
    assert summary["async"]["reach_s"] == [8.0] and summary["async"]["final"] == [0.6]
    assert sorted((c.mode, c.seed) for c in load_curves(out)) == [("async", 0), ("async", 1), ("sync", 0)]
    with pytest.raises(SystemExit, match="sync seed 0 is in an earlier --with file too"):
        main(["--seeds", "", "--with", str(first), "--with", str(first)])


def test_each_curve_keeps_its_placement_correction_and_cpus_and_kinds_do_not_mix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench_learning import Curve, Point, load_curves, main, save_curves

    def curve(mode: str, placement: str, off_policy: str) -> Curve:
        return Curve(mode, 0, 10.0, 8.0, [Point(0, 0.0, 0.2, 0.1, 0.3)], 64, placement, off_policy,
                     {"engines": [0], "trainer": [1]})

    path = tmp_path / "dis.json"
    save_curves([curve("sync", "disaggregated", "mis"), curve("async", "disaggregated", "mis")], path)
    back = load_curves(path)
    assert [(c.placement, c.off_policy, c.cpus) for c in back] == [("disaggregated", "mis",
                                                                    {"engines": [0], "trainer": [1]})] * 2
    summary = main(["--seeds", "", "--modes", "sync,async", "--with", str(path)])
    assert (summary["placement"], summary["off_policy"]) == ("disaggregated", "mis")
    old = tmp_path / "old.json"  # a file from before the flags: shared, tis
    old.write_text(json.dumps([{k: v for k, v in d.items() if k not in ("placement", "off_policy", "cpus")}
                               for d in json.loads(path.read_text())]))
    assert {(c.placement, c.off_policy) for c in load_curves(old)} == {("shared", "tis")}
    save_curves([Curve("async", 1, 1.0, 1.0, [], 0, "shared", "tis")], tmp_path / "other.json")
    with pytest.raises(SystemExit, match="mix placements or corrections"):
        main(["--seeds", "", "--modes", "sync,async", "--with", str(path),
              "--with", str(tmp_path / "other.json")])


def test_final_accuracy_is_paired_with_syncs_by_problem_per_seed_and_pooled() -> None:
    from bench_learning import Curve, paired_against_sync

    def curve(mode: str, seed: int, rows: list[list[int]]) -> Curve:
        return Curve(mode, seed, 1.0, 1.0, final_problems=rows)

    # seed 0: async right on problems 1 and 2 where sync was right on 1 only; problem 9 only sync scored
    sync0 = curve("sync", 0, [[1, 1, 1], [2, 0, 1], [3, 0, 1], [9, 1, 1]])
    async0 = curve("async", 0, [[1, 1, 1], [2, 1, 1], [3, 0, 1]])
    # seed 1: two samples a problem; async half right where sync was always right
    sync1 = curve("sync", 1, [[1, 2, 2], [2, 2, 2]])
    async1 = curve("async", 1, [[1, 1, 2], [2, 2, 2]])
    per_seed, pooled = paired_against_sync([sync0, async0, sync1, async1, curve("async", 5, [[1, 1, 1]])], "async")
    assert sorted(per_seed) == [0, 1]  # seed 5 has no sync run to pair with
    assert per_seed[0].n == 3 and per_seed[0].value == pytest.approx(1 / 3)
    assert per_seed[1].n == 2 and per_seed[1].value == pytest.approx(-0.25)
    assert pooled.n == 5 and pooled.value == pytest.approx((1 + 0 + 0 - 0.5 + 0) / 5)
    assert pooled.lo <= pooled.value <= pooled.hi


def test_the_trainers_time_is_summed_per_part_from_its_step_log(tmp_path: Path) -> None:
    evals = [{"phase": "before", "step": 0, "time": 100.0, "metrics": acc(0.2)},
             {"phase": "after", "step": 2, "time": 130.0, "metrics": acc(0.4), "problems": [[0, 1, 1], [1, 0, 1]]}]
    steps = [{"step": s, "time": 100.0 + 10 * s,
              "metrics": {"time/update_s": 1.5, "time/batch_wait_s": 7.0, "time/weight_publish_s": 0.5}}
             for s in (1, 2)]
    write_run(tmp_path, evals, steps)
    curve = read_curve(tmp_path, "async", 0, wall_s=40.0)
    assert curve.trainer_s == {"update": 3.0, "batch wait": 14.0, "publish": 1.0, "serving wait": 0.0, "checkpoint": 0.0}
    assert curve.final_problems == [[0, 1, 1], [1, 0, 1]]


def test_exact_finals_differ_exactly_per_seed_and_their_mean_gets_a_t_interval() -> None:
    from bench_learning import Curve, exact_against_sync

    def curve(mode: str, seed: int, values: list[float]) -> Curve:
        return Curve(mode, seed, 1.0, 1.0, final_exact=values)

    curves = [curve("sync", 0, [0.5, 0.7]), curve("async", 0, [0.6, 0.8]),   # +0.10
              curve("sync", 1, [0.4, 0.4]), curve("async", 1, [0.4, 0.4]),   # +0.00
              curve("sync", 2, [0.9, 0.9]), curve("async", 2, [0.85, 0.85]),  # -0.05
              curve("async", 3, [1.0, 1.0])]                                  # no sync: left out
    per_seed, mean = exact_against_sync(curves, "async")
    assert {s: round(d.value, 9) for s, d in per_seed.items()} == {0: 0.1, 1: 0.0, 2: -0.05}
    assert all(d.lo == d.hi == d.value for d in per_seed.values())  # exact: nothing to resample
    diffs = [0.1, 0.0, -0.05]
    half = 4.303 * statistics.stdev(diffs) / math.sqrt(3)  # Student's t with 2 degrees of freedom
    assert mean.n == 3 and mean.value == pytest.approx(sum(diffs) / 3)
    assert (mean.lo, mean.hi) == pytest.approx((mean.value - half, mean.value + half))
    _, alone = exact_against_sync(curves[:2], "async")
    assert alone.value == pytest.approx(0.1) and math.isnan(alone.lo)  # one seed: no interval


def test_exact_points_score_the_version_each_step_left_placed_when_the_step_finished(tmp_path: Path) -> None:
    from bench_learning import Curve, exact_points

    from rollout_bus.lm.files import version_dir
    from rollout_bus.lm.model import build_model, load_model, save_weights
    from rollout_bus.tasks.exact import exact_accuracy

    save_weights(build_model(seed=0), tmp_path / "init" / "warm-abc")
    for version in (1, 2):
        save_weights(build_model(seed=version), version_dir(tmp_path / "weights", "p0", version))
    evals = [{"phase": "before", "step": 0, "time": 100.0, "metrics": acc(0.2)},
             {"phase": "after", "step": 3, "time": 140.0, "metrics": acc(0.4)}]
    steps = [{"step": 1, "weight_version": 1, "time": 110.0, "metrics": {}},
             {"step": 2, "weight_version": 1, "time": 120.0, "metrics": {}},  # no signal: no new version
             {"step": 3, "weight_version": 2, "time": 130.0, "metrics": {}}]
    write_run(tmp_path, evals, steps)
    curve = Curve("async", 0, 50.0)
    exact_points(tmp_path, curve, [2, 3], digits=1, temperature=1.0)
    want = {v: exact_accuracy(load_model(d)) for v, d in
            [(0, tmp_path / "init" / "warm-abc"), (1, version_dir(tmp_path / "weights", "p0", 1)),
             (2, version_dir(tmp_path / "weights", "p0", 2))]}
    assert [(p.step, p.t_s) for p in curve.points] == [(0, 0.0), (2, 20.0), (3, 30.0)]
    assert [p.accuracy for p in curve.points] == pytest.approx([sum(want[v]) / 100 for v in (0, 1, 2)])
    assert all(p.lo == p.hi == p.accuracy for p in curve.points)
    assert curve.final_exact == pytest.approx(want[2])
