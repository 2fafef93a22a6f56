"""An interrupted main job leaves nothing behind, even when more signals arrive while it stops.

The run is a real ``rollout-bus run`` process: a private redis-server, the controller and its
engine, an executor and a trainer. Once its engine serves, the test sends SIGINT and then keeps
sending SIGINT and SIGTERM every few milliseconds while the run stops its processes (a user
pressing Ctrl-C again, a supervisor's SIGTERM). Every process the run started, engines and
redis-server included, must be gone once the run has exited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _parents() -> dict[int, int]:
    out: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":  # a zombie has exited already
            out[int(entry.name)] = int(fields[1])
    return out


def _descendants(root: int) -> set[int]:
    parents = _parents()
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def test_signals_during_the_stop_of_an_interrupted_run_leave_no_process_behind(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("REDIS_URL", None)
    run = subprocess.Popen([sys.executable, "-m", "rollout_bus", "run", "--steps", "500", "--warm-steps", "20",
                            "--token-delay-ms", "5", "--no-progress", "--no-plot", "--out", str(tmp_path / "out")],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        started: set[int] = set()
        while time.monotonic() < deadline:  # the whole system is up: redis, controller, engine, executor, trainer
            started = _descendants(run.pid)
            lines = " | ".join(_cmdline(pid) for pid in started)
            if all(part in lines for part in ("redis-server", "engine.server", " executor ", " trainer ")):
                break
            assert run.poll() is None, run.stdout.read().decode() if run.stdout else ""
            time.sleep(0.2)
        else:
            pytest.fail(f"the run never started all its processes: {[_cmdline(p) for p in started]}")
        started = _descendants(run.pid)  # engines included (the controller's children)

        os.kill(run.pid, signal.SIGINT)
        storm = 0
        while run.poll() is None and storm < 2000:  # more signals while it stops its processes
            os.kill(run.pid, signal.SIGTERM if storm % 2 else signal.SIGINT)
            storm += 1
            time.sleep(0.005)
        output = run.communicate(timeout=60)[0].decode(errors="replace")
    finally:
        if run.poll() is None:
            os.kill(run.pid, signal.SIGKILL)
            run.wait(10)
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {pid: _cmdline(pid) for pid in started if _alive(pid)}
    for pid in left:  # leave the machine clean even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} of the run's {len(started)} processes outlived it: {left}\n{output[-3000:]}"
    assert storm > 2, f"the run exited before more signals reached it ({storm}): nothing was tested\n{output}"
    # 130 or 143 from the run itself; -SIGTERM/-SIGINT when a signal lands as the interpreter exits
    assert run.returncode in (130, 128 + signal.SIGTERM, -signal.SIGTERM, -signal.SIGINT), output
    # the run's private redis-server kept an append-only file in the run directory
    aof = tmp_path / "out" / "redis" / "appendonlydir"
    assert aof.is_dir() and any(p.name.endswith(".incr.aof") and p.stat().st_size > 0 for p in aof.iterdir()), \
        list(aof.iterdir()) if aof.is_dir() else "no appendonlydir"
