"""A main job killed outright (SIGKILL, as the OOM killer does) leaves no process behind.

A real ``rollout-bus run`` (the tiny LM, a private redis-server with its append-only file in the run
directory, the controller and its engine, an executor, a trainer). Once every role and the engine are up,
the pids of every process the run started are collected from /proc, the launcher is SIGKILLed (and seen
dead), and within 10 s none of those processes may be alive. The private redis-server went down through its
SIGTERM shutdown, which writes the append-only file out.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.procs import cmdline, descendants, running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_a_run_killed_with_sigkill_takes_every_process_it_started_with_it(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("REDIS_URL", None)
    out = tmp_path / "out"
    run = subprocess.Popen([sys.executable, "-m", "rollout_bus", "run", "--steps", "500", "--warm-steps", "20",
                            "--token-delay-ms", "5", "--no-progress", "--no-plot", "--out", str(out)],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # redis, controller, engine, executor, trainer: all up
            started = descendants(run.pid)
            lines = " | ".join(cmdline(pid) for pid in started)
            if all(part in lines for part in ("redis-server", "engine.server", " executor ", " trainer ",
                                              " controller ")):
                break
            assert run.poll() is None, "the run ended before it was up"
            time.sleep(0.2)
        else:
            pytest.fail(f"the run never started all its processes: {[cmdline(p) for p in started]}")
        started = descendants(run.pid)  # the engine included (the controller's child)
        roles = {pid: cmdline(pid) for pid in started}

        os.kill(run.pid, signal.SIGKILL)
        assert run.wait(10) == -signal.SIGKILL  # the kill landed: the launcher is gone, it cleaned up nothing
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = {pid: roles.get(pid, cmdline(pid)) for pid in started if running(pid)}
    finally:
        if run.poll() is None:
            os.kill(run.pid, signal.SIGKILL)
            run.wait(10)
        for pid in started:  # leave the machine clean even when the test fails
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} of the run's {len(started)} processes outlived it by 10 s: {left}"
    redis_log = (out / "redis" / "redis.log").read_text(errors="replace")
    assert "Received SIGTERM" in redis_log and "ready to exit" in redis_log, redis_log[-2000:]
