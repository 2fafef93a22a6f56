"""How bench/bench_learning.py places a run's held-out evals in time and compares modes."""

from __future__ import annotations

import json
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
