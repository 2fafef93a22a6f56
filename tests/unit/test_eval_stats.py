"""The eval's intervals: Wilson for a share, a paired bootstrap for a before/after change."""

from __future__ import annotations

import math
import random

import pytest

from rollout_bus.tasks.stats import counts_of, paired_difference, problems_for, wilson, wilson_half_width


def test_wilson_matches_the_published_figures() -> None:
    # Newcombe (1998), Statistics in Medicine 17, table I: 81/263 -> 0.2553-0.3662; 15/148 -> 0.0624-0.1605
    assert (round(wilson(81, 263).lo, 4), round(wilson(81, 263).hi, 4)) == (0.2553, 0.3662)
    assert (round(wilson(15, 148).lo, 4), round(wilson(15, 148).hi, 4)) == (0.0624, 0.1605)
    # 0 of 10 and 10 of 10: inside [0, 1], not of width 0 (the normal interval's failure)
    zero, all_ = wilson(0, 10), wilson(10, 10)
    assert zero.lo == 0.0 and zero.hi == pytest.approx(0.2775, abs=1e-4)
    assert all_.hi == 1.0 and all_.lo == pytest.approx(0.7225, abs=1e-4)


def test_wilson_refuses_impossible_counts_and_says_nothing_of_no_samples() -> None:
    with pytest.raises(ValueError, match="0 <= k <= n"):
        wilson(5, 4)
    assert math.isnan(wilson(0, 0).value)
    assert wilson(3, 10).to_dict("accuracy") == pytest.approx(
        {"accuracy": 0.3, "accuracy_lo": wilson(3, 10).lo, "accuracy_hi": wilson(3, 10).hi, "accuracy_n": 10.0})


def test_wilson_covers_the_true_share_about_95_percent_of_the_time() -> None:
    rng = random.Random(0)
    for p, n in ((0.1, 30), (0.5, 200), (0.9, 60)):
        covered = 0
        for _ in range(2000):
            k = sum(rng.random() < p for _ in range(n))
            iv = wilson(k, n)
            covered += iv.lo <= p <= iv.hi
        assert 0.92 <= covered / 2000 <= 0.98, (p, n, covered)


def test_the_paired_difference_pairs_problems_and_resolves_a_real_change() -> None:
    rng = random.Random(1)
    m = 200
    easy = [rng.random() < 0.4 for _ in range(m)]
    before = {i: (int(easy[i]), 1) for i in range(m)}
    # after: every problem right before stays right, and 20% of the others become right (about +12 points)
    after = {i: (int(easy[i] or rng.random() < 0.2), 1) for i in range(m)}
    diff = paired_difference(before, after)
    true = sum(a[0] - b[0] for a, b in zip(after.values(), before.values(), strict=True)) / m
    assert diff.value == pytest.approx(true) and diff.n == m
    assert 0 < diff.lo < diff.value < diff.hi
    same = paired_difference(before, before)
    assert same.value == 0.0 and same.lo == same.hi == 0.0  # no problem changed: no doubt about it
    assert paired_difference(before, after) == diff  # a fixed seed: the same evals, the same interval
    assert paired_difference({0: (1, 1)}, {1: (1, 1)}).n == 0  # nothing in common: nothing to pair


def test_counts_of_reads_event_rows_and_skips_malformed_ones() -> None:
    assert counts_of([[3, 1, 2], [4, 0, 1], [5, 3, 2], [6, 1], [7, 0, 0]]) == {3: (1, 2), 4: (0, 1)}


def test_how_many_problems_resolve_a_ten_point_change() -> None:
    assert problems_for(0.10, discordant=0.5) == 189 and problems_for(0.10, discordant=0.3) == 112
    assert wilson_half_width(0.5, 200) == pytest.approx(0.0686, abs=1e-4)
