"""Liveness of processes this project starts, by pid.

One check for the controller (engines it launched or adopts), the executor worker (a
dead process still holding its rq worker name) and the run orchestration (engines left
behind by a controller). Linux: zombies and command lines are read from ``/proc``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

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
