"""The guard as the controller launches it: one process in its own group, the engine its child on a
loopback port. Real processes, real HTTP (a CPU engine stands behind it here; SGLang in production)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_bus.controller.backends import PROJECT_ROOT, ProcessHandle, pid_alive
from rollout_bus.events.embedded import free_port
from tests.engine_proc import call, make_weights_dir, wait_until

pytestmark = pytest.mark.integration


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def answers(url: str) -> bool:
    try:
        return call(url + "/health", timeout_s=1)[0] == 200
    except OSError:
        return False


@pytest.fixture()
def guarded(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    weights = make_weights_dir(tmp_path / "w", seed=0)
    port, inner = free_port(), free_port()
    cmd = [sys.executable, "-m", "rollout_bus.engine.guard", "--port", str(port), "--upstream-port", str(inner),
           "--", sys.executable, "-m", "rollout_bus.engine.server", "--model-path", str(weights), "--port",
           str(inner), "--weight-version", "0"]
    log = (tmp_path / "guard.log").open("wb")
    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until("the engine answers through the guard", lambda: answers(url), timeout_s=60)
        yield proc, url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def test_the_guard_fences_control_calls_and_stops_with_its_engine(
        guarded: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, url = guarded
    (engine,) = children(proc.pid)
    status, reply = call(url + "/generate", "POST", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and len(reply["output_ids"]) == 3
    assert call(url + "/continue_generation", "POST", {}, headers={"X-Rollout-Bus-Fence": "3"})[0] == 200
    status, reply = call(url + "/pause_generation", "POST", {"mode": "abort"}, headers={"X-Rollout-Bus-Fence": "2"})
    assert (status, reply["fenced"], reply["highest"]) == (409, True, 3)
    # stopping the group (what ProcessHandle.stop does) takes the engine down with the guard
    asyncio.run(ProcessHandle(pid=proc.pid).stop(grace_s=10.0))
    assert proc.wait(10) == 0 and not pid_alive(engine)


def test_the_guard_exits_when_its_engine_dies(guarded: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, _url = guarded
    (engine,) = children(proc.pid)
    os.kill(engine, signal.SIGKILL)
    assert proc.wait(20) == 128 + signal.SIGKILL  # the controller sees a dead engine process, as without a guard
