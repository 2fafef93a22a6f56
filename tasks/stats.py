"""How sure an eval is: 95% Wilson intervals for a share, and a paired interval for a change.

``wilson(k, n)`` is the Wilson score interval of a binomial share ``k / n`` (Wilson 1927): unlike the
normal ("Wald") interval it stays inside [0, 1] and keeps its coverage near 0 and 1 and for small
``n``. Samples of one problem are not independent (a problem is easy or hard for every sample of
it), so an interval over samples is somewhat too narrow when each problem has several; the interval
over problems (``pass_at_n``) and the paired one below treat a problem as the unit.

``paired_difference(before, after)`` compares two evals of the same problems: each problem's share
of right answers after minus before, averaged, with a 95% percentile interval from a paired
bootstrap over problems (problems resampled with replacement, each keeping its before and after
together), with a fixed seed so the same evals always give the same interval. Pairing removes the
spread between problems from the comparison, which is what makes a before/after change resolvable
on a few hundred problems (``problems_for``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Z95 = 1.959963984540054
"""The two-sided 95% quantile of the standard normal."""


@dataclass(frozen=True)
class Interval:
    value: float
    lo: float
    hi: float
    n: int

    def to_dict(self, name: str) -> dict[str, float]:
        return {name: self.value, f"{name}_lo": self.lo, f"{name}_hi": self.hi, f"{name}_n": float(self.n)}


def wilson(k: float, n: int, z: float = Z95) -> Interval:
    """The share ``k / n`` with its Wilson score interval (``z`` 1.96: 95%); NaN for ``n`` 0."""
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"need 0 <= k <= n, got k={k!r}, n={n!r}")
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    p = k / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    lo = 0.0 if k == 0 else max(0.0, centre - half)  # exact at the ends (rounding leaves 1 - 1e-16)
    hi = 1.0 if k == n else min(1.0, centre + half)
    return Interval(p, lo, hi, n)


Counts = Mapping[int, tuple[int, int]]
"""Problem index -> (right answers, samples)."""


def counts_of(problems: Sequence[Sequence[int]]) -> dict[int, tuple[int, int]]:
    """``EvalCompleted.problems`` (``[index, correct, samples]`` rows) as ``Counts``; malformed rows are skipped."""
    out: dict[int, tuple[int, int]] = {}
    for row in problems:
        if len(row) == 3 and all(isinstance(v, int) for v in row) and 0 <= row[1] <= row[2] and row[2] > 0:
            out[int(row[0])] = (int(row[1]), int(row[2]))
    return out


def paired_difference(before: Counts, after: Counts, *, resamples: int = 4000, seed: int = 0) -> Interval:
    """Mean over the problems both evals scored of (share right after - share right before), with a 95%
    paired-bootstrap percentile interval; NaN when they share no problem."""
    common = sorted(set(before) & set(after))
    if not common:
        return Interval(math.nan, math.nan, math.nan, 0)
    diffs = [after[i][0] / after[i][1] - before[i][0] / before[i][1] for i in common]
    m = len(diffs)
    mean = sum(diffs) / m
    if m == 1:
        return Interval(mean, math.nan, math.nan, 1)
    rng = random.Random(seed)
    means = sorted(sum(diffs[rng.randrange(m)] for _ in range(m)) / m for _ in range(resamples))
    lo = means[int(math.floor(0.025 * (resamples - 1)))]
    hi = means[int(math.ceil(0.975 * (resamples - 1)))]
    return Interval(mean, lo, hi, m)


def wilson_half_width(p: float, n: int, z: float = Z95) -> float:
    """Half the width of the Wilson interval of share ``p`` on ``n`` samples."""
    z2 = z * z
    return z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)


def problems_for(change: float = 0.10, *, discordant: float = 0.3, z: float = Z95) -> int:
    """Problems a paired before/after eval needs for its 95% interval to exclude 0 at a true ``change``:
    ``z * sd / sqrt(m) < change`` with the per-problem difference's variance bounded by ``discordant``
    (the share of problems whose answer flips between the two evals, one sample each)."""
    variance = discordant - change * change
    return math.ceil(z * z * variance / (change * change))
