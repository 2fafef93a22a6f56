"""When a bench may give a verdict: outside load, and the spread of a row against its target.

A bench's own processes (a Redis, a producer, a consumer on 2 cores) always lift the load
average above 1, so the load average while a bench runs says nothing about other work on
the machine. The load is judged from outside the bench instead:

* the 1-minute load average *before* the bench starts (``os.getloadavg``), and
* the CPU time that processes *other than the bench's own* (its process tree) used while
  it ran: ``utime + stime`` from ``/proc/<pid>/stat``, sampled at the start, every
  ``interval_s`` and at the end, per process (pid and start time, so a reused pid is a new
  process), divided by the wall time and the number of cores. A process counts as the
  bench's own when, in any sample, its parent chain reaches the bench's pid. A process that
  exits between two samples loses the CPU it used since the last one (short-lived outside
  work is undercounted by at most ``interval_s`` of it).

A row's verdict also needs its spread: each row is a list of per-repetition values (a ratio
of the project to its baseline in the same round), and the verdict reads their
interquartile range. Met when the whole range meets the target, missed when none of it
does, and "spread crosses the target" otherwise. ``judge`` and the functions it uses are pure
(inputs in, verdict out); ``OutsideLoad`` does the sampling.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

MAX_LOAD_BEFORE = 1.0
"""No verdict when the 1-minute load average before the bench was above this."""
MAX_OUTSIDE_SHARE = 0.25
"""No verdict when other processes used more than this share of all cores while the bench ran."""

Op = Literal["<", "<=", ">", ">="]
ProcKey = tuple[int, int]  # (pid, start time in clock ticks since boot)


@dataclass(frozen=True)
class ProcSample:
    """One process seen in one sample: its parent and its CPU time so far, in clock ticks."""

    ppid: int
    ticks: int


def parse_stat(text: str) -> tuple[int, int, int, int] | None:
    """(pid, ppid, utime + stime, start time) from the text of ``/proc/<pid>/stat``; None if malformed.

    The command name (field 2) is in parentheses and may hold spaces or parentheses itself, so
    the fields are read after its last ``)``."""
    head, sep, rest = text.rpartition(")")
    if not sep:
        return None
    fields = rest.split()
    try:
        pid = int(head.split("(", 1)[0])
        # fields[0] is the state (field 3); ppid is field 4, utime 14, stime 15, starttime 22
        return pid, int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19])
    except (ValueError, IndexError):
        return None


def read_procs(proc: str = "/proc") -> dict[ProcKey, ProcSample]:
    """Every process visible in ``proc`` now, keyed by (pid, start time)."""
    out: dict[ProcKey, ProcSample] = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat") as f:
                parsed = parse_stat(f.read())
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if parsed is not None:
            pid, ppid, ticks, start = parsed
            out[(pid, start)] = ProcSample(ppid, ticks)
    return out


def tree_of(root: int, sample: Mapping[ProcKey, ProcSample]) -> set[ProcKey]:
    """The processes of ``sample`` whose parent chain reaches pid ``root`` (``root`` included)."""
    parent = {key[0]: s.ppid for key, s in sample.items()}
    mine: set[ProcKey] = set()
    for key in sample:
        pid, seen = key[0], 0
        while pid > 1 and seen < 4096:
            if pid == root:
                mine.add(key)
                break
            pid, seen = parent.get(pid, 0), seen + 1
    return mine


def outside_ticks(samples: Sequence[Mapping[ProcKey, ProcSample]], root: int) -> int:
    """Clock ticks of CPU used between the first and the last sample by processes outside ``root``'s tree.

    A process in the first sample counts from its ticks there; one that appears later started
    during the window and counts from 0; each counts up to the last sample it was seen in."""
    if not samples:
        return 0
    own: set[ProcKey] = set()
    first: dict[ProcKey, int] = {}
    last: dict[ProcKey, int] = {}
    for i, sample in enumerate(samples):
        own |= tree_of(root, sample)
        for key, s in sample.items():
            if key not in first:
                first[key] = s.ticks if i == 0 else 0
            last[key] = s.ticks
    return sum(max(0, last[k] - first[k]) for k in last if k not in own)


@dataclass(frozen=True)
class Load:
    """Outside load around one bench: the load average before it, and the share of all cores that
    other processes used while it ran (None when it was not measured)."""

    before: float
    outside_share: float | None = None
    wall_s: float = 0.0

    def problem(self, max_before: float = MAX_LOAD_BEFORE, max_share: float = MAX_OUTSIDE_SHARE) -> str | None:
        """Why this load allows no verdict, or None when it does."""
        if self.before > max_before:
            return f"load average {self.before:.2f} before the bench > {max_before:g}"
        if self.outside_share is not None and self.outside_share > max_share:
            return f"other processes used {self.outside_share:.0%} of the cores > {max_share:.0%}"
        return None

    def describe(self) -> str:
        share = "-" if self.outside_share is None else f"{self.outside_share:.0%}"
        return f"load before {self.before:.2f}, outside CPU {share} of the cores"


def outside_share(ticks: int, wall_s: float, cores: int, hz: int) -> float:
    """CPU ticks used by other processes as a share of all cores over ``wall_s``."""
    if wall_s <= 0 or cores <= 0 or hz <= 0:
        return 0.0
    return ticks / hz / wall_s / cores


class OutsideLoad:
    """Measures ``Load`` around a block: ``with OutsideLoad() as m: ...`` then ``m.load``."""

    def __init__(self, root: int | None = None, interval_s: float = 2.0, proc: str = "/proc") -> None:
        self.root = os.getpid() if root is None else root
        self.interval_s = interval_s
        self.proc = proc
        self.samples: list[dict[ProcKey, ProcSample]] = []
        self.load: Load = Load(os.getloadavg()[0])
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def __enter__(self) -> OutsideLoad:
        self.load = Load(os.getloadavg()[0])
        self.samples = [read_procs(self.proc)]
        self._t0 = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="outside-load", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(read_procs(self.proc))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.samples.append(read_procs(self.proc))
        wall = time.monotonic() - self._t0
        share = outside_share(outside_ticks(self.samples, self.root), wall, os.cpu_count() or 1,
                              os.sysconf("SC_CLK_TCK"))
        self.load = Load(self.load.before, share, wall)



# --- spread and verdict ------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    op: Op
    value: float

    def holds(self, x: float) -> bool:
        return {"<": x < self.value, "<=": x <= self.value, ">": x > self.value, ">=": x >= self.value}[self.op]

    def __str__(self) -> str:
        return f"{self.op} {self.value:g}"


@dataclass(frozen=True)
class Spread:
    median: float
    q1: float
    q3: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        return f"{self.median:.2f} [IQR {self.q1:.2f}-{self.q3:.2f}, range {self.low:.2f}-{self.high:.2f}, n={self.n}]"


def spread(values: Iterable[float]) -> Spread:
    """Median, quartiles (inclusive method) and range of per-repetition values."""
    xs = sorted(values)
    if not xs:
        raise ValueError("a spread needs at least one value")
    if len(xs) == 1:
        q1 = q3 = xs[0]
    else:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return Spread(statistics.median(xs), q1, q3, xs[0], xs[-1], len(xs))


@dataclass(frozen=True)
class Verdict:
    kind: Literal["met", "missed", "crosses", "no verdict", "-"]
    reason: str = ""

    def __str__(self) -> str:
        return {"met": "met", "missed": "MISSED", "crosses": "spread crosses target",
                "no verdict": "no verdict", "-": "-"}[self.kind]

    def explain(self) -> str:
        return f"{self}" + (f" ({self.reason})" if self.reason else "")


MIN_REPS = 3


def judge(values: Sequence[float], target: Target | None, load: Load, *, min_reps: int = MIN_REPS,
          max_before: float = MAX_LOAD_BEFORE, max_share: float = MAX_OUTSIDE_SHARE) -> Verdict:
    """The verdict on a row of per-repetition values against ``target`` under ``load``.

    In order: no target -> "-"; too much outside load or fewer than ``min_reps`` values -> no
    verdict; the interquartile range wholly meeting the target -> met, wholly missing it ->
    missed; otherwise the spread crosses the target."""
    if target is None:
        return Verdict("-")
    problem = load.problem(max_before, max_share)
    if problem is not None:
        return Verdict("no verdict", problem)
    if len(values) < min_reps:
        return Verdict("no verdict", f"{len(values)} repetitions, a spread needs {min_reps}")
    s = spread(values)
    lo_ok, hi_ok = target.holds(s.q1), target.holds(s.q3)
    if lo_ok and hi_ok:
        return Verdict("met", f"IQR {s.q1:.2f}-{s.q3:.2f} {target}")
    if not lo_ok and not hi_ok:
        return Verdict("missed", f"IQR {s.q1:.2f}-{s.q3:.2f}, target {target}")
    return Verdict("crosses", f"IQR {s.q1:.2f}-{s.q3:.2f} crosses {target}")


@dataclass
class Row:
    """One row of a bench's verdict table: per-repetition values of a ratio, a target and the load."""

    bench: str
    figure: str
    values: list[float]
    target: Target | None
    load: Load
    seconds: float = 0.0
    note: str = field(default="")

    @property
    def verdict(self) -> Verdict:
        return judge(self.values, self.target, self.load) if self.values else Verdict("no verdict", self.note)


def table(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width table with the spread, the target, the verdict and the outside load."""
    lines = [f"{'bench':15} {'ratio (project vs fair baseline)':52} {'median':>6} {'IQR':>11} {'range':>11} "
             f"{'n':>3} {'target':>7} {'verdict':>21} {'before':>6} {'outside':>7}"]
    for r in rows:
        if r.values:
            s = spread(r.values)
            nums = f"{s.median:6.2f} {s.q1:5.2f}-{s.q3:<5.2f} {s.low:5.2f}-{s.high:<5.2f} {s.n:3d}"
        else:
            nums = f"{'-':>6} {'-':>11} {'-':>11} {0:3d}"
        share = "-" if r.load.outside_share is None else f"{r.load.outside_share:.0%}"
        lines.append(f"{r.bench:15} {r.figure:52} {nums} {str(r.target or '-'):>7} {str(r.verdict):>21} "
                     f"{r.load.before:6.2f} {share:>7}")
    return "\n".join(lines)


def reasons(rows: Sequence[Row]) -> list[str]:
    """One line per row whose verdict has a reason worth reading (no verdict, crossing spread)."""
    return [f"{r.bench} / {r.figure}: {r.verdict.explain()}" for r in rows
            if r.verdict.kind in ("no verdict", "crosses")]


def paired_ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Per-repetition ratios of two series measured in the same rounds (zeros in ``den`` skipped)."""
    return [a / b for a, b in zip(num, den, strict=True) if b]


def wait_for_quiet(max_wait_s: float, threshold: float = MAX_LOAD_BEFORE, poll_s: float = 5.0) -> float:
    """Wait up to ``max_wait_s`` for the 1-minute load average to fall to ``threshold`` (the previous
    bench's own processes lift it; it decays with a one-minute time constant). Returns the load then."""
    deadline = time.monotonic() + max_wait_s
    load = os.getloadavg()[0]
    while load > threshold and time.monotonic() < deadline:
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        load = os.getloadavg()[0]
    return load
