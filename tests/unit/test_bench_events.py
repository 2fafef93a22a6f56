"""The pure parts of bench/bench_events.py: batching a schedule, per-repetition ratios and the verdict rows of
publish_many against its batching twin."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_events import PATHS, Result, batches, consume_twin, many_rows, per_rep  # noqa: E402
from verdict import Load  # noqa: E402


def result(path: str, rate: float, p50: float = 1.0, p99: float = 2.0) -> Result:
    return Result(path, rate, p50, p99, 3.0, 1.0, 1.0, 1.0)


def test_batches_keeps_order_and_a_short_last_batch() -> None:
    assert list(batches(range(7), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(batches(range(6), 3)) == [[0, 1, 2], [3, 4, 5]]
    assert list(batches(range(2), 16)) == [[0, 1]]
    assert list(batches([], 4)) == []
    assert list(batches(range(3), 1)) == [[0], [1], [2]]


def test_batches_yields_a_batch_only_once_its_last_send_time_was_drawn() -> None:
    drawn: list[int] = []

    def sends() -> Iterator[int]:
        for i in range(5):
            drawn.append(i)
            yield i

    it = batches(sends(), 2)
    assert next(it) == [0, 1] and drawn == [0, 1]  # the schedule's third slot not waited for yet
    assert next(it) == [2, 3] and drawn == [0, 1, 2, 3]


def test_batches_refuses_an_empty_batch_size() -> None:
    with pytest.raises(ValueError):
        list(batches(range(3), 0))


def test_per_rep_pairs_the_runs_of_one_round() -> None:
    res = {"many": [result("many", 90), result("many", 50)], "twin-many": [result("twin-many", 100),
                                                                           result("twin-many", 100)]}
    assert per_rep(res, "many", "twin-many", "rate") == [0.9, 0.5]


def test_many_rows_judge_publish_many_against_the_batching_twin() -> None:
    sat = {"many": [result("many", r) for r in (96, 97, 98)],
           "twin-many": [result("twin-many", 100) for _ in range(3)]}
    half = {"many": [result("many", 1, p50=2.0, p99=1.0) for _ in range(3)],
            "twin-many": [result("twin-many", 1, p50=1.0, p99=2.0) for _ in range(3)]}
    quiet = Load(0.2, 0.01)
    rows = many_rows(sat, half, 16, quiet, quiet)
    assert [r.figure for r in rows] == ["many / batching twin (x16), msg/s at saturation",
                                        "many / batching twin (x16), p50 at 0.5 load",
                                        "many / batching twin (x16), p99 at 0.5 load"]
    assert rows[0].values == pytest.approx([0.96, 0.97, 0.98])
    assert [r.verdict.kind for r in rows] == ["met", "missed", "met"]
    assert all(len(r.figure) <= 52 for r in rows)  # the verdict table's column


def test_many_rows_without_half_load_runs_and_under_outside_load() -> None:
    sat = {"many": [result("many", 50) for _ in range(3)], "twin-many": [result("twin-many", 100) for _ in range(3)]}
    rows = many_rows(sat, None, 8, Load(3.0, 0.0), Load(0.1, 0.0))
    assert len(rows) == 1
    assert rows[0].verdict.kind == "no verdict"  # loaded before: no verdict, however far off


def test_the_batching_twin_is_consumed_like_the_other_twins() -> None:
    assert PATHS["twin-many"][1] is consume_twin
    assert PATHS["twin"][1] is consume_twin and PATHS["transport"][1] is consume_twin
