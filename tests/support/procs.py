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


def parents() -> dict[int, int]:
    """Every live process (no zombie) and its parent, from /proc."""
    out: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            out[int(entry.name)] = int(fields[1])
    return out


def descendants(root: int) -> set[int]:
    """The live processes started by ``root``, its children's children included (found by parent pid)."""
    table = parents()
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in table.items() if ppid in frontier} - found
        found |= frontier
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def running(pid: int) -> bool:
    """Whether ``pid`` runs and is no zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
