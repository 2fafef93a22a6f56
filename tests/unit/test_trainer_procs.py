"""The liveness check the run's process set (and the controller and executors) relies on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_bus.events.processes import alive
from rollout_bus.launch.procs import ProcessSet


def sleeper(*extra: str) -> subprocess.Popen[bytes]:
    """A child that sleeps, returned once its command line is readable (it is empty until exec is done)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *extra])
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 10
    while not cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.005)
    return proc


def test_no_pid_is_alive_below_one() -> None:
    assert not alive(0) and not alive(-1)


def test_a_dead_child_is_reaped_and_counts_as_gone() -> None:
    proc = sleeper()
    try:
        assert alive(proc.pid)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive(proc.pid)


def test_the_command_line_check_matches_whole_words_only() -> None:
    proc = sleeper("--port", "18000", "-m", "rollout_bus.engine.server")
    try:
        assert alive(proc.pid, cmdline_has="18000")
        assert alive(proc.pid, cmdline_has="engine")
        assert not alive(proc.pid, cmdline_has="8000")
        assert not alive(proc.pid, cmdline_has="engines")
    finally:
        proc.kill()
        proc.wait()


def test_stop_all_kills_an_adopted_engine_that_outlives_the_grace(tmp_path: Path) -> None:
    procs = ProcessSet(tmp_path)
    engine = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                               "signal.SIG_IGN); time.sleep(60)", "-m", "rollout_bus.engine.server"])
    procs.adopt(engine.pid, "engine-0")
    procs.stop_all(timeout_s=0.2)
    assert engine.wait(5) == -signal.SIGKILL


def test_a_pid_that_belongs_to_another_user_is_not_a_process_of_ours() -> None:
    """kill(pid, 0) answers EPERM for another user's process: a pid we started, reused by someone else."""
    if os.geteuid() != 0:
        assert not alive(1)  # init belongs to root
        return
    target = os.getpid()  # ours, root's: a child that drops to "nobody" may not signal it
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked child
        try:
            os.setgid(65534)
            os.setuid(65534)
            try:
                os.kill(target, 0)
                eperm = False
            except PermissionError:
                eperm = True
            os.write(write_end, f"{eperm} {alive(target)}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(child, 0)
    answer = os.read(read_end, 64).decode()
    os.close(read_end)
    assert answer == "True False"  # the kernel said EPERM, and that is not "alive"


def test_a_supervised_child_is_restarted_with_backoff_until_its_budget_is_spent(tmp_path: Path) -> None:
    from rollout_bus.launch.procs import GaveUp, RestartPolicy

    procs = ProcessSet(tmp_path)
    crashing = procs.start("flaky", ["-c", "print('about to fail', flush=True); raise SystemExit(3)"],
                           restart=RestartPolicy(budget=2, backoff_s=0.05))
    done = procs.start("finisher", ["-c", "pass"], restart=RestartPolicy(budget=2, may_finish=True))
    restart_times: list[float] = []
    deadline = time.monotonic() + 20
    with pytest.raises(GaveUp, match=r"flaky exited with 3 after 2 restart\(s\) \(budget 2\):\n.*about to fail"):
        while time.monotonic() < deadline:
            restart_times += [time.monotonic() for _ in procs.supervise()]
            time.sleep(0.01)
    assert crashing.exits == [3, 3, 3] and crashing.restarts == 2
    assert restart_times[1] - restart_times[0] >= 0.1  # the second restart waited twice as long
    assert done.finished and done.exits == [] and procs.restarts() == {"flaky": 2, "finisher": 0}
    assert crashing.log_path.read_text().count("--- restarted by the run") == 2
    procs.stop_all()
