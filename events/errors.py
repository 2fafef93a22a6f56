"""The project's exception tree.

``BusError`` is the root. ``ControlFlow`` is the branch for expected outcomes that
steer a loop (nothing to read, not ready yet); everything else is a failure.
Driver errors from redis-py are translated into these at the ``events`` boundary.
"""

from __future__ import annotations

from typing import Any


class BusError(Exception):
    """Root of every error this project raises on purpose."""


class ControlFlow(BusError):
    """An expected outcome that steers a loop rather than a failure."""


class Idle(ControlFlow):
    """Nothing to read right now."""


class NotReady(ControlFlow):
    """The thing asked for exists but is not ready yet (an engine starting, a lease held)."""


class Failure(BusError):
    """Something went wrong."""


class BusUnavailable(Failure):
    """Redis could not be reached within the reconnect budget."""


class BusReset(Failure):
    """Redis lost the namespace's data (its bus epoch vanished): the run's streams, groups and registry are gone."""

    exit_code = 76
    """What a role's process exits with when it stops for this (``LeaseLost`` has its own)."""


class RedisCommandError(Failure):
    """Redis answered a command with an error."""


class ReplicationTimeout(Failure):
    """A write that must survive a failover was not acknowledged by enough replicas (``WAIT``) in time."""


class Fenced(Failure):
    """A write carried a fencing token older than the current one: another controller took over."""


class LeaseLost(Failure):
    """A lease-bound write was refused: the writer's lease lapsed (it was paused, or cut off from Redis) and
    it may have been taken by another. The writer is deposed: it must stop and write nothing more."""

    exit_code = 75
    """What a role's process exits with when it stops for this (launchers name it in their logs)."""


class DecodeError(Failure):
    """An entry or payload could not be decoded; carries the raw data and the reason."""

    def __init__(self, reason: str, raw: Any = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.raw = raw


class ChecksumMismatch(DecodeError):
    """A payload's bytes do not match the checksum written with them."""


class PayloadTooLarge(Failure):
    """A batch exceeds the configured size limit."""


class PayloadMissing(Failure):
    """A claim-checked payload is gone (expired, swept or never written)."""


class InvalidRequest(Failure):
    """A request or argument is malformed; the message says what to fix."""
