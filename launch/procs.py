"""Child processes of a run: started with their log file, stopped by pid, in reverse order.

``ProcessSet.stop_all`` sends SIGTERM to each child it started (newest first), waits,
and SIGKILLs what is still alive; it also stops grandchildren it was told about (the
engines the controller launched, by the pids the controller recorded), so an
interrupted run leaves nothing behind. Nothing is ever stopped by name.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rollout_bus.events import processes

log = logging.getLogger(__name__)



@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class ProcessSet:
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    children: list[Child] = field(default_factory=list)
    extra_pids: dict[int, str] = field(default_factory=dict)
    """Processes our children started (engines), stopped last."""

    def start(self, name: str, args: Sequence[str], env: dict[str, str] | None = None) -> Child:
        """Run ``python <args...>`` (this interpreter); output goes to ``<log_dir>/<name>.log``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        env = dict(os.environ, **self.env, **(env or {}))
        with log_path.open("ab") as out:
            proc = subprocess.Popen([sys.executable, *args], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        child = Child(name, proc, log_path)
        self.children.append(child)
        log.debug("started %s (pid %d): %s", name, proc.pid, " ".join(args))
        return child

    def adopt(self, pid: int, name: str) -> None:
        self.extra_pids[pid] = name

    def stop(self, child: Child, timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
        if child.alive():
            try:
                os.kill(child.pid, sig)
                child.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) did not stop in %.0fs: SIGKILL", child.name, child.pid, timeout_s)
                os.kill(child.pid, signal.SIGKILL)
                child.proc.wait(5)
            except ProcessLookupError:
                pass
        return child.proc.returncode

    def stop_all(self, timeout_s: float = 10.0) -> None:
        for child in reversed(self.children):
            self.stop(child, timeout_s)
        deadline = time.monotonic() + timeout_s
        for pid, name in self.extra_pids.items():
            while processes.alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if processes.alive(pid, cmdline_has="engine"):
                log.warning("%s (pid %d) still alive: SIGKILL", name, pid)
                with contextlib.suppress(ProcessLookupError, PermissionError):  # gone, or the pid reused
                    os.kill(pid, signal.SIGKILL)

