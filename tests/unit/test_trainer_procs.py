"""The liveness check the run's process set (and the controller and executors) relies on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
