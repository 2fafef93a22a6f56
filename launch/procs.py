"""Child processes of a run: started with their log file, supervised, stopped by pid, in reverse order.

A child started with a ``RestartPolicy`` is supervised: ``ProcessSet.supervise``, called by the
run's follow loop, notices when it died (any exit of a service; a non-zero one of a child that
may finish, like a trainer), starts it again with the same arguments after a backoff that
doubles with each restart, and raises ``GaveUp`` (with the end of its log) once its restart
budget is spent. Every death is recorded (``Child.exits``), so the run's summary counts them.

No child outlives the run, however the run dies: each is started with ``processes.die_with_parent``
(SIGKILL when the launcher dies; children are started from the main thread, which lives as long as the
launcher) and with ``processes.RUN_ENV`` in its environment, which the engines a controller starts inherit
and watch (``processes.watch_run``).

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
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rollout_bus.events import processes
from rollout_bus.events.errors import BusReset, LeaseLost
from rollout_bus.launch.placement import Placement, child_setup

log = logging.getLogger(__name__)


def exit_text(status: int | None) -> str:
    """An exit status as the run reports it: named when it says why (a deposed role)."""
    if status == LeaseLost.exit_code:
        return f"{status} (deposed: its lease lapsed while it was paused or cut off; it wrote nothing after)"
    if status == BusReset.exit_code:
        return f"{status} (Redis lost the run's data: its bus epoch vanished)"
    return str(status)


@dataclass(frozen=True)
class RestartPolicy:
    """How a supervised child is brought back: ``budget`` restarts over the run, the first after
    ``backoff_s``, each later one after twice the one before (at most ``max_backoff_s``)."""

    budget: int = 5
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    may_finish: bool = False
    """A clean exit (status 0) means done, not dead (a trainer that trained all its steps)."""

    def delay(self, restarts: int) -> float:
        return min(self.backoff_s * 2 ** restarts, self.max_backoff_s)


class GaveUp(RuntimeError):
    """A supervised child kept dying: its restart budget is spent (the message has its last log lines)."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    policy: RestartPolicy | None = None
    exits: list[int] = field(default_factory=list)
    """Exit status of every death the supervisor noticed (negative: killed by that signal)."""
    restarts: int = 0
    restart_at: float | None = None
    """When a dead child is due to start again (``time.monotonic``); None while it runs."""
    retiring: bool = False
    """Told to stop for good (``ProcessSet.retire``): its exit is not a death, and it is not started again."""
    cpus: tuple[int, ...] | None = None
    """The CPUs it is pinned to from before its exec (``launch.placement``), restarts too; None: the run's own."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def finished(self) -> bool:
        """Exited cleanly and may do so (a trainer done with its steps)."""
        return self.policy is not None and self.policy.may_finish and self.proc.poll() == 0

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _child_setup(cpus: tuple[int, ...] | None) -> Callable[[], None]:
    """A child's ``preexec_fn``: it dies with the launcher (``PR_SET_PDEATHSIG``), and runs on ``cpus`` when
    its placement pins it."""
    die = processes.die_with_parent(signal.SIGKILL)
    pin = child_setup(cpus)

    def setup() -> None:
        die()
        if pin is not None:
            pin()

    return setup


@dataclass
class ProcessSet:
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    children: list[Child] = field(default_factory=list)
    extra_pids: dict[int, str] = field(default_factory=dict)
    """Processes our children started (engines), stopped last."""
    place: Callable[[str], list[str]] | None = None
    """A command prefix per child name, to run a role elsewhere (``ip netns exec``, ``ssh host``); the
    prefix must exec the command, so the pid stays the role's own."""
    placement: Placement | None = None
    """The CPUs (and environment: thread counts, GPUs) of each child by its name (``launch.placement``)."""

    def start(self, name: str, args: Sequence[str], env: dict[str, str] | None = None, *,
              restart: RestartPolicy | None = None) -> Child:
        """Run ``python <args...>`` (this interpreter); output goes to ``<log_dir>/<name>.log``.

        With ``restart`` the child is supervised (see ``supervise``). Under a ``placement`` that pins it, it
        runs on its CPUs alone from before its exec, and so does every thread and process it starts."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        placed = self.placement or Placement()
        full_env = dict(os.environ, **self.env, **placed.env(name), **(env or {}))
        full_env[processes.RUN_ENV] = processes.run_marker()  # what the engines its controller starts watch
        pinned = placed.cpus(name)
        child = Child(name, self._spawn(self._prefix(name), list(args), full_env, log_path, pinned), log_path,
                      list(args), full_env, restart, cpus=pinned)
        self.children.append(child)
        log.debug("started %s (pid %d): %s", name, child.pid, " ".join(args))
        return child

    def _prefix(self, name: str) -> list[str]:
        return self.place(name) if self.place is not None else []

    @staticmethod
    def _spawn(prefix: list[str], args: list[str], env: dict[str, str], log_path: Path,
               cpus: tuple[int, ...] | None = None) -> subprocess.Popen[bytes]:
        with log_path.open("ab") as out:
            return subprocess.Popen([*prefix, sys.executable, *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_child_setup(cpus))

    def supervise(self, now: float | None = None) -> list[Child]:
        """Restart supervised children that died, after their backoff; returns those started again now.

        ``GaveUp`` when a child died once more than its budget allows."""
        now = time.monotonic() if now is None else now
        restarted: list[Child] = []
        for child in self.children:
            policy = child.policy
            if policy is None or child.retiring or child.alive() or child.finished:
                continue
            if child.restart_at is None:  # a death not seen before
                status = child.proc.returncode
                child.exits.append(status)
                if child.restarts >= policy.budget:
                    raise GaveUp(f"{child.name} exited with {exit_text(status)} after {child.restarts} restart(s) "
                                 f"(budget {policy.budget}):\n{child.tail()}")
                delay = policy.delay(child.restarts)
                child.restart_at = now + delay
                log.warning("%s (pid %d) exited with %s: restarting it in %.1fs (restart %d of %d)", child.name,
                            child.pid, exit_text(status), delay, child.restarts + 1, policy.budget)
            if now >= child.restart_at:
                child.restarts += 1
                child.restart_at = None
                with child.log_path.open("ab") as out:
                    out.write(f"--- restarted by the run (restart {child.restarts}) after exit status "
                              f"{child.exits[-1]} ---\n".encode())
                child.proc = self._spawn(self._prefix(child.name), child.args, child.env, child.log_path, child.cpus)
                restarted.append(child)
        return restarted

    def restarts(self) -> dict[str, int]:
        """Restarts so far, by child name (supervised children only; a name started again after it was retired
        sums its children's)."""
        out: dict[str, int] = {}
        for c in self.children:
            if c.policy is not None:
                out[c.name] = out.get(c.name, 0) + c.restarts
        return out

    def retire(self, child: Child) -> None:
        """Ask ``child`` to stop for good with one SIGTERM, without waiting: an executor finishes the job it
        holds first (rq's warm shutdown). The supervisor leaves it alone from now on; ``stop_all`` still
        stops it if it is alive when the run ends."""
        child.retiring = True
        child.restart_at = None
        if child.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGTERM)

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



@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM are counted, not raised, inside the block: a second Ctrl-C or a SIGTERM
    that arrives while a run stops its processes must not cut that short and leave children
    behind. (The handler only counts: writing a log line from a signal handler can re-enter a
    write in progress.) Only the main thread can set handlers; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen: list[int] = []

    def note(signum: int, frame: object) -> None:
        seen.append(signum)

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if seen:
            log.warning("%d signal(s) arrived while the run stopped its processes: they waited", len(seen))
