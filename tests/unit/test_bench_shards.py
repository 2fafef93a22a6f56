"""The pure parts of bench/bench_shards.py: the interleaved schedule, the even split over shards, the capacity
projection, the 1 s bins, the recovery read from the submitters' events, and the per-repeat ratios."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_shards import (  # noqa: E402
    Window,
    bins,
    capacity,
    command_shift,
    parse_shards,
    phase,
    recovery,
    schedule,
    shard_ratios,
    split_evenly,
    stack_of,
    verdict_rows,
)
from verdict import Load  # noqa: E402


def test_shard_counts_are_distinct_positive_and_include_the_reference() -> None:
    assert parse_shards("1,2,3") == [1, 2, 3]
    assert parse_shards("3, 1") == [3, 1]
    for bad in ("", "0,1", "1,1,2", "2,3"):
        with pytest.raises(ValueError):
            parse_shards(bad)


def test_schedule_runs_every_k_once_per_repeat_and_rotates_which_goes_first() -> None:
    order = schedule([1, 2, 3], 3)
    assert order == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (1, 1), (2, 3), (2, 1), (2, 2)]
    assert [k for r, k in order if k == 2 and r == 1] == [2]
    assert schedule([1, 3], 0) == []


def test_split_evenly_gives_contiguous_equal_parts_or_refuses() -> None:
    assert split_evenly(range(6), 3) == [[0, 1], [2, 3], [4, 5]]
    assert split_evenly(["a", "b"], 1) == [["a", "b"]]
    with pytest.raises(ValueError, match="4 executors do not split evenly over 3 shards"):
        split_evenly(range(4), 3, "executors")


def test_capacity_is_k_cores_over_the_cost_per_sample() -> None:
    assert capacity(1, 80.0) == pytest.approx(12_500.0)
    assert capacity(3, 80.0) == pytest.approx(37_500.0)
    assert capacity(2, 0.0) == float("inf")


def test_bins_count_or_weigh_the_times_of_each_second_and_drop_those_outside() -> None:
    times = [9.5, 10.0, 10.2, 11.9, 12.5, 13.0]
    assert bins(times, 10.0, 13.0) == [2.0, 1.0, 1.0]
    assert bins(times, 10.0, 13.0, weights=[1, 16, 16, 16, 8, 1]) == [32.0, 16.0, 8.0]
    assert bins(times, 10.0, 12.5, width_s=1.0) == [2.0, 1.0]  # the last half second is no whole bin
    assert bins([], 0.0, 0.0) == []


def test_recovery_reads_loss_time_moved_and_held_requests_from_the_submitters_events() -> None:
    kill = 100.0
    events = [
        {"what": "batch", "t": 99.0, "shard": 2, "request": "r1"},  # before the loss: not a recovery
        {"what": "lost", "t": 105.2, "shard": 2, "in_flight": ["r1", "r2", "r3"], "held": ["r3"]},
        {"what": "lost", "t": 105.6, "shard": 2, "in_flight": ["q1"], "held": []},
        {"what": "lost", "t": 105.0, "shard": 1, "in_flight": ["x"], "held": []},  # another shard: ignored
        {"what": "batch", "t": 106.0, "shard": 0, "request": "r1"},
        {"what": "batch", "t": 106.5, "shard": 2, "request": "r3"},
        {"what": "batch", "t": 107.1, "shard": 1, "request": "q1"},
    ]
    rec = recovery(events, 2, kill)
    assert rec.lost_after_s == pytest.approx([5.2, 5.6])
    assert rec.held == ["r3"]
    assert rec.moved.keys() == {"r1", "r2", "q1"}
    assert rec.moved["r1"] == pytest.approx(6.0) and rec.moved["q1"] == pytest.approx(7.1)
    assert rec.moved["r2"] is None
    assert rec.all_served_s is None  # r2 was never served
    events.append({"what": "batch", "t": 108.0, "shard": 0, "request": "r2"})
    assert recovery(events, 2, kill).all_served_s == pytest.approx(8.0)


def test_recovery_with_nothing_in_flight_ends_when_the_shard_is_marked_lost() -> None:
    rec = recovery([{"what": "lost", "t": 3.0, "shard": 0, "in_flight": [], "held": []}], 0, 0.0)
    assert rec.moved == {} and rec.all_served_s == pytest.approx(3.0)
    assert recovery([], 0, 0.0).all_served_s is None  # not marked lost: not recovered


def test_phase_splits_the_timeline_at_the_kill_and_at_recovery() -> None:
    assert [phase(t, 6.0) for t in (-1, 0, 5, 6, 9)] == ["before", "during", "during", "after", "after"]
    assert phase(30, None) == "during"


def window(k: int, repeat: int, samples_per_s: float, redis_main: list[float], submitters: float) -> Window:
    return Window(k, repeat, 10.0, samples_per_s / 16, samples_per_s, redis_main, 0.0,
                  {"executors": 1.0, "submitters": submitters, "stub engines": 0.2}, 1.0, 0.0)


def test_ratios_pair_each_repeat_s_k_with_the_same_repeat_s_reference() -> None:
    windows = [window(1, 0, 2000, [0.16], 0.30), window(3, 0, 2000, [0.06, 0.06, 0.06], 0.36),
               window(1, 1, 1000, [0.08], 0.15), window(3, 1, 2000, [0.05, 0.05, 0.06], 0.30),
               window(3, 2, 1500, [0.05, 0.05, 0.05], 0.30)]  # no K=1 in repeat 2: left out
    assert windows[0].redis_us == pytest.approx(80.0) and windows[1].redis_us == pytest.approx(90.0)
    assert windows[1].capacity == pytest.approx(3e6 / 90.0)
    r = shard_ratios(windows, 3)
    assert r["redis_us_per_sample"] == pytest.approx([90 / 80, 80 / 80])
    assert r["capacity"] == pytest.approx([3 * 80 / 90, 3.0])
    assert r["samples_per_s"] == pytest.approx([1.0, 2.0])
    assert r["submitter_us_per_sample"] == pytest.approx([1.2, 1.0])


def test_verdict_rows_judge_flat_cost_and_linear_capacity_only() -> None:
    windows = [w for rep in range(3) for w in (window(1, rep, 2000, [0.16], 0.3),
                                               window(3, rep, 2000, [0.055, 0.055, 0.055], 0.3))]
    rows = verdict_rows(windows, [1, 3], Load(0.2, 0.01))
    assert [r.figure for r in rows] == ["Redis CPU/sample, K=3 / K=1", "projected capacity, K=3 / K=1",
                                        "samples/s measured, K=3 / K=1", "submitter CPU/sample, K=3 / K=1"]
    assert [r.verdict.kind for r in rows] == ["met", "met", "-", "-"]
    costly = [w for rep in range(3) for w in (window(1, rep, 2000, [0.16], 0.3),
                                              window(3, rep, 2000, [0.1, 0.1, 0.1], 0.3))]
    assert [r.verdict.kind for r in verdict_rows(costly, [1, 3], Load(0.2, 0.01))][:2] == ["missed", "missed"]
    assert verdict_rows(windows, [1, 3], Load(2.0, 0.01))[0].verdict.kind == "no verdict"


def test_command_shift_pools_each_k_s_windows_per_sample_and_puts_the_largest_change_first() -> None:
    a = window(1, 0, 100, [0.1], 0.1)
    a.per_shard_samples, a.commands = [100], {"evalsha": (80, 1600), "xreadgroup": (10, 100)}
    b = window(3, 0, 100, [0.1] * 3, 0.1)
    b.per_shard_samples, b.commands = [40, 30, 30], {"evalsha": (80, 1700), "xreadgroup": (40, 500)}
    c = window(3, 1, 100, [0.1] * 3, 0.1)
    c.per_shard_samples, c.commands = [30, 40, 30], {"evalsha": (80, 1700), "xreadgroup": (40, 500), "ping": (5, 5)}
    shifts = command_shift([a, b, c], 3)
    assert [x.command for x in shifts] == ["xreadgroup", "evalsha", "ping"]
    x = shifts[0]
    assert (x.calls_lo, x.calls_hi, x.usec_lo, x.usec_hi) == pytest.approx((0.1, 0.4, 1.0, 5.0))
    assert (shifts[2].calls_lo, shifts[2].calls_hi) == pytest.approx((0.0, 0.025))


DUMP = """Thread 0x00007f0000000002 (most recent call first):
  File "/x/trainer/redis_shards.py", line 231 in _monitor
  File "/usr/lib/python3.11/threading.py", line 975 in run

Current thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/time.py", line 1 in sleep
  File "/x/events/connection.py", line 455 in call
  File "/x/bench/bench_shards.py", line 300 in serve_submitter
  File "/x/bench/bench_shards.py", line 700 in <module>
"""


def test_stack_of_picks_the_thread_showing_the_marker_most_recent_call_first() -> None:
    assert stack_of("log line\n" + DUMP, "serve_submitter") == [
        "sleep (python3.11/time.py:1)", "call (events/connection.py:455)",
        "serve_submitter (bench/bench_shards.py:300)", "<module> (bench/bench_shards.py:700)"]
    assert stack_of(DUMP, "_monitor")[0] == "_monitor (trainer/redis_shards.py:231)"
    assert stack_of("no dump here", "serve_submitter") == []
