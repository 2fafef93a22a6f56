"""Liveness of processes this project starts, by pid, and processes that die with the run that started them.

One check for the controller (engines it launched or adopts), the executor worker (a
dead process still holding its rq worker name) and the run orchestration (engines left
behind by a controller). Linux: zombies and command lines are read from ``/proc``.

No orphans: a process ``rollout-bus run`` starts must not outlive it, however it dies (SIGKILL, the
OOM killer). Its children are started with ``die_with_parent``: the kernel sends them a signal when
the launcher dies (``PR_SET_PDEATHSIG``, set in the child before it execs; SIGKILL for the roles,
SIGTERM for the private redis-server, which then writes its append-only file out). Processes further
down (the engines a controller launches, which must outlive a controller so that the next one adopts
them) carry the run in their environment (``RUN_ENV``: the launcher's pid and start time) and watch it
(``watch_run``, a thread): when the run is gone they kill their process group. Outside a run (a
controller deployed on its own) nothing is set and nothing is watched.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

RUN_ENV = "ROLLOUT_BUS_RUN"
"""``<pid>:<start time>`` of the ``rollout-bus run`` process a process belongs to (set by the launcher)."""
_PR_SET_PDEATHSIG = 1

_WORD_SEPARATORS = re.compile(rb"[\0./=:]")


def alive(pid: int, *, cmdline_has: str | None = None) -> bool:
    """Whether ``pid`` runs and is no zombie; with ``cmdline_has``, also whether its command line names it.

    A zombie that is our child is reaped (``waitpid`` with ``WNOHANG``); any other zombie is
    recognised by its ``/proc/<pid>/stat`` state. A process of another user (``kill``
    answers ``PermissionError``) is not one of ours (the project runs its processes as one
    user): the pid was reused, and it counts as gone. ``cmdline_has`` (a port, a
    module name) guards against a pid reused by an unrelated process: it must be one of
    the command line's words, its arguments split at ``.``, ``/``, ``=`` and ``:``
    (``engine`` in ``-m engine.server``, ``8000`` in ``--port 8000`` but not in ``18000``).
    If ``/proc`` cannot be read, the process counts as alive only when no such check is asked for.
    """
    if pid <= 0:
        return False  # kill(0 or -n, 0) would ask about a whole process group
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    proc = Path(f"/proc/{pid}")
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False  # our child, a zombie until now
    except ChildProcessError:  # not our child
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z":
                return False
        except (OSError, IndexError):
            return cmdline_has is None
    if cmdline_has is None:
        return True
    try:
        words = _WORD_SEPARATORS.split((proc / "cmdline").read_bytes())
    except OSError:
        return False
    return cmdline_has.encode() in words


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22), None if it does not run: with
    the pid it names one process, never another that reused the pid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 20 or fields[0] == "Z":
        return None
    return int(fields[19])


def run_marker(pid: int | None = None) -> str:
    """``RUN_ENV``'s value for the run process ``pid`` (this one by default)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{start_time(pid) or 0}"


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when the thread that started it ends
    (its process dies; start children from a thread that lives as long as the process, the main one), and ``sig``
    at once if the parent is already gone. The C function is found here, in the parent, before the fork."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), sig)

    return set_death_signal


def watch_run(interval_s: float = 0.5) -> threading.Thread | None:
    """If this process belongs to a run (``RUN_ENV``), watch it from a daemon thread: once the run process is gone,
    kill this process's group (an engine leads its own: an SGLang engine behind its guard goes with it), or this
    process alone when it leads none. Returns the thread, None outside a run."""
    marker = os.environ.get(RUN_ENV)
    if not marker:
        return None
    pid_text, _, started_text = marker.partition(":")
    if not (pid_text.isdigit() and started_text.isdigit()):
        log.warning("%s=%r is not <pid>:<start time>: not watching the run", RUN_ENV, marker)
        return None
    pid, started = int(pid_text), int(started_text)

    def gone() -> bool:
        now = start_time(pid)
        return now is None or (started != 0 and now != started)

    def watch() -> None:
        while not threading.Event().wait(interval_s):
            if gone():
                log.error("the run (pid %d) is gone: stopping with it", pid)
                own = os.getpid()
                if os.getpgid(0) == own:
                    os.killpg(own, signal.SIGKILL)
                os.kill(own, signal.SIGKILL)

    thread = threading.Thread(target=watch, name="run-watch", daemon=True)
    thread.start()
    return thread
