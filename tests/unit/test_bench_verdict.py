"""The verdict rule of the benches (bench/verdict.py): outside load from /proc, spreads against targets."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from verdict import (  # noqa: E402
    Load,
    OutsideLoad,
    ProcSample,
    Row,
    Target,
    judge,
    outside_share,
    outside_ticks,
    paired_ratios,
    parse_stat,
    spread,
    table,
    tree_of,
)

QUIET = Load(before=0.3, outside_share=0.05)


def stat_line(pid: int, comm: str, ppid: int, utime: int, stime: int, start: int) -> str:
    fields = ["S", str(ppid)] + ["0"] * 9 + [str(utime), str(stime)] + ["0"] * 6 + [str(start)] + ["0"] * 30
    return f"{pid} ({comm}) " + " ".join(fields)


def test_parse_stat_reads_ppid_cpu_and_start_even_with_parentheses_and_spaces_in_the_name() -> None:
    assert parse_stat(stat_line(42, "we ird) (name", 7, 100, 23, 9999)) == (42, 7, 123, 9999)
    assert parse_stat("garbage") is None
    assert parse_stat("12 (x) S") is None


def test_parse_stat_reads_this_process_from_proc() -> None:
    with open(f"/proc/{os.getpid()}/stat") as f:
        parsed = parse_stat(f.read())
    assert parsed is not None and parsed[0] == os.getpid() and parsed[1] == os.getppid()


def test_the_tree_holds_descendants_and_not_siblings() -> None:
    sample = {(10, 1): ProcSample(1, 0), (11, 2): ProcSample(10, 0), (12, 3): ProcSample(11, 0),
              (20, 4): ProcSample(1, 0), (21, 5): ProcSample(20, 0)}
    assert tree_of(10, sample) == {(10, 1), (11, 2), (12, 3)}


def test_outside_ticks_count_only_other_processes_and_only_during_the_window() -> None:
    before = {(10, 1): ProcSample(1, 500), (11, 2): ProcSample(10, 50), (20, 4): ProcSample(1, 1000)}
    # the bench's child 11 used 300 ticks, a new child 12 appeared; outside 20 used 40, outside 30 started
    # during the window and used 7; outside 40 was seen in the middle sample only (then exited) with 5
    middle = {(10, 1): ProcSample(1, 600), (11, 2): ProcSample(10, 200), (20, 4): ProcSample(1, 1020),
              (40, 9): ProcSample(1, 5)}
    after = {(10, 1): ProcSample(1, 700), (11, 2): ProcSample(10, 350), (12, 3): ProcSample(11, 90),
             (20, 4): ProcSample(1, 1040), (30, 8): ProcSample(20, 7)}
    assert outside_ticks([before, middle, after], root=10) == 40 + 7 + 5


def test_a_reused_pid_is_a_new_process() -> None:
    before = {(20, 4): ProcSample(1, 1000)}
    after = {(20, 99): ProcSample(1, 3)}  # pid 20 exited and was reused: not 3 - 1000
    assert outside_ticks([before, after], root=10) == 3


def test_outside_share_divides_by_wall_time_and_cores() -> None:
    assert outside_share(200, wall_s=2.0, cores=2, hz=100) == pytest.approx(0.5)
    assert outside_share(10, wall_s=0.0, cores=2, hz=100) == 0.0


def test_spread_reports_quartiles_and_range() -> None:
    s = spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.q1, s.q3, s.low, s.high, s.n) == (3.0, 2.0, 4.0, 1.0, 5.0, 5)
    assert spread([2.0]).q1 == spread([2.0]).q3 == 2.0
    with pytest.raises(ValueError):
        spread([])


def test_a_row_wholly_on_one_side_of_its_target_is_met_or_missed() -> None:
    assert judge([0.80, 0.82, 0.85, 0.81, 0.79], Target(">=", 0.75), QUIET).kind == "met"
    assert judge([0.60, 0.62, 0.65, 0.61, 0.70], Target(">=", 0.75), QUIET).kind == "missed"
    assert judge([1.5, 1.7, 1.6], Target("<=", 2.0), QUIET).kind == "met"
    assert judge([0.9, 0.95, 0.99], Target("<", 1.0), QUIET).kind == "met"


def test_a_row_whose_spread_crosses_its_target_says_so_instead_of_a_verdict() -> None:
    v = judge([0.70, 0.74, 0.76, 0.80, 0.72, 0.78], Target(">=", 0.75), QUIET)
    assert v.kind == "crosses" and str(v) == "spread crosses target"
    assert "crosses >= 0.75" in v.explain()


def test_one_outlier_does_not_decide_but_a_wide_middle_does() -> None:
    # one slow repetition of nine outside the IQR: the verdict stands
    assert judge([0.8] * 8 + [0.3], Target(">=", 0.75), QUIET).kind == "met"


def test_outside_load_before_or_during_the_bench_gives_no_verdict() -> None:
    values = [0.9, 0.91, 0.92]
    busy_before = judge(values, Target(">=", 0.75), Load(before=2.5, outside_share=0.0))
    assert busy_before.kind == "no verdict" and "before the bench" in busy_before.reason
    busy_during = judge(values, Target(">=", 0.75), Load(before=0.2, outside_share=0.6))
    assert busy_during.kind == "no verdict" and "other processes used 60%" in busy_during.reason
    assert judge(values, Target(">=", 0.75), Load(before=0.2, outside_share=None)).kind == "met"


def test_too_few_repetitions_give_no_verdict_and_no_target_gives_none() -> None:
    assert judge([0.9, 0.9], Target(">=", 0.75), QUIET).kind == "no verdict"
    assert judge([0.9, 0.9, 0.9], None, QUIET).kind == "-"


def test_paired_ratios_and_the_table() -> None:
    assert paired_ratios([2.0, 3.0, 1.0], [1.0, 2.0, 0.0]) == [2.0, 1.5]
    rows = [Row("codec", "encode + copy + decode / memcpy", [0.8, 0.81, 0.79], Target(">=", 0.75), QUIET),
            Row("handoff", "shm / ray", [], Target("<", 1.0), QUIET, note="ray not installed")]
    text = table(rows)
    assert "met" in text.splitlines()[1] and "no verdict" in text.splitlines()[2]
    assert rows[1].verdict.reason == "ray not installed"


def test_outside_load_counts_other_processes_and_not_its_own_children(tmp_path: Path) -> None:
    hz = os.sysconf("SC_CLK_TCK")
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
    with OutsideLoad(interval_s=0.2) as own:
        subprocess.run([sys.executable, "-c", burn], check=True)
    counted_all = outside_ticks(own.samples, root=-1)  # as if nothing were this process's own
    assert counted_all - outside_ticks(own.samples, own.root) >= 0.5 * hz  # the child's CPU is the bench's

    # a process outside this one's tree (its launcher exits, so it is reparented), burning on a signal
    go, marker = tmp_path / "go", tmp_path / "outside.pid"
    orphan = (f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.02)\n" + burn
              + "time.sleep(30)\n")
    launcher = ("import subprocess, sys\n"
                f"p = subprocess.Popen([sys.executable, '-c', {orphan!r}], start_new_session=True)\n"
                f"open({str(marker)!r}, 'w').write(str(p.pid))\n")
    subprocess.run([sys.executable, "-c", launcher], check=True)
    outside_pid = int(marker.read_text())
    try:
        with OutsideLoad(interval_s=0.2) as other:
            go.touch()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with open(f"/proc/{outside_pid}/stat") as f:
                    parsed = parse_stat(f.read())
                assert parsed is not None and parsed[1] != os.getpid()
                if parsed[2] >= 0.55 * hz:
                    break
                time.sleep(0.05)
        assert outside_ticks(other.samples, other.root) >= 0.5 * hz
        assert other.load.outside_share is not None and other.load.outside_share > 0
    finally:
        os.kill(outside_pid, 9)
