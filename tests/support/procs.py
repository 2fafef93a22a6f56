"""Starting and stopping the helper processes of the fault tests, always by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parent


def spawn(script: str, *args: str, log_path: Path | None = None) -> subprocess.Popen[bytes]:
    """Run ``tests/support/<script>`` with this interpreter; its output goes to ``log_path``."""
    cmd = [sys.executable, str(SUPPORT / script), *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if log_path is None:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(log_path, "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int:
    """Signal ``proc`` (by its pid) and wait for it; SIGKILL if it does not exit in time."""
    if proc.poll() is None:
        os.kill(proc.pid, sig)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
    return proc.wait(timeout_s)


def wait_for(what: str, cond: Callable[[], bool], timeout_s: float = 20.0, every_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)
