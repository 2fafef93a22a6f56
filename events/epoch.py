"""The bus epoch: how every role notices, within seconds, that Redis came back without the run's data.

``keys.bus_epoch`` holds a random id written once, when the namespace is first used (``BusEpoch.join``:
``SET NX``, by the main job before it starts the roles, or by the controller of a deployment: only
a ``BusEpoch(create=True)`` writes it, the other roles read it and adopt the first one they see). A
Redis restarted without persistence, a ``FLUSHALL`` or a failover to an empty replica loses it with
everything else. ``BusEpoch.check`` compares it with the id seen at join and raises ``BusReset`` when
it vanished or changed; ``EpochWatch`` does that from a thread every ``interval_s``
(``ROLLOUT_BUS_EPOCH_CHECK_S``, default 2), beside whatever the role is busy with.

A role's entrypoint runs inside ``stop_on_bus_reset``: on a reset the role is asked to stop as a
signal would (SIGTERM to itself, so a controller stops its engines), then the block raises the
``BusReset`` with its reason, and the process exits non-zero. A role that does not stop within
``grace_s`` is ended with ``EXIT_BUS_RESET``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import uuid
from collections.abc import Callable
from types import TracebackType

import redis

from rollout_bus.events.connection import Guard, ReconnectPolicy, as_str
from rollout_bus.events.errors import BusError, BusReset
from rollout_bus.events.names import Keys
from rollout_bus.events.settings import env_seconds

log = logging.getLogger(__name__)
EXIT_BUS_RESET = BusReset.exit_code
"""Exit status of a role that had to be ended after a bus reset (it did not stop in time on its own)."""
DEFAULT_CHECK_S = 2.0


def check_interval_s() -> float:
    """``ROLLOUT_BUS_EPOCH_CHECK_S`` (seconds between a role's epoch checks, above 0), else ``DEFAULT_CHECK_S``."""
    return env_seconds("ROLLOUT_BUS_EPOCH_CHECK_S", DEFAULT_CHECK_S)


class BusEpoch:
    """The namespace's epoch as this process first saw it."""

    def __init__(self, client: redis.Redis, keys: Keys, *, guard: Guard | None = None, create: bool = False) -> None:
        self.client = client
        self.keys = keys
        self.create = create
        self.guard = guard or Guard(client, ReconnectPolicy(max_wait_s=5.0), name="bus epoch")
        self.value: str | None = None

    def join(self) -> str | None:
        """The namespace's epoch, created if it has none and ``create`` (None: it has none yet)."""
        key = self.keys.bus_epoch

        def read_or_create(c: redis.Redis) -> str | None:
            raw = c.get(key)
            if raw is None and self.create:
                try:
                    c.set(key, uuid.uuid4().hex, nx=True)
                except redis.exceptions.NoPermissionError:
                    return None
                raw = c.get(key)
            return None if raw is None else as_str(raw)
        self.value = self.guard.call(read_or_create)
        return self.value

    def check(self) -> None:
        """``BusReset`` if the epoch joined is gone or another one took its place."""
        raw = self.guard.call(lambda c: c.get(self.keys.bus_epoch))
        now = None if raw is None else as_str(raw)
        if self.value is None:  # joined before anyone created it: adopt the first one seen
            self.value = now
            return
        if now != self.value:
            what = "is gone" if now is None else f"was replaced by {now}"
            raise BusReset(f"Redis lost the data of namespace {self.keys.namespace}: its bus epoch {self.value} "
                           f"{what} (a restart without persistence, a FLUSHALL, or a failover to an empty replica)")


class EpochWatch:
    """Checks the epoch every ``interval_s`` from a daemon thread; the first ``BusReset`` goes to ``on_reset``."""

    def __init__(self, epoch: BusEpoch, on_reset: Callable[[BusReset], None], interval_s: float | None = None,
                 name: str = "role") -> None:
        self.epoch = epoch
        self.on_reset = on_reset
        self.interval_s = interval_s if interval_s is not None else check_interval_s()
        self.name = name
        self.reset: BusReset | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"bus epoch {name}", daemon=True)

    def start(self) -> EpochWatch:
        try:
            self.epoch.join()
        except BusError as exc:  # Redis away at start: the first check adopts the epoch it finds
            log.warning("%s: cannot read the bus epoch yet: %s", self.name, exc)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check_now(self) -> None:
        """Check the epoch at once, not at the next interval: a role whose lease vanished asks whether Redis
        lost everything, which is then the cause to report (``BusReset``)."""
        try:
            self.epoch.check()
        except BusReset as exc:
            self.reset = exc
            log.error("%s: stopping: %s", self.name, exc)
            raise
        except BusError as exc:
            log.debug("%s: bus epoch not checked: %s", self.name, exc)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.epoch.check()
            except BusReset as exc:
                self.reset = exc
                log.error("%s: %s", self.name, exc)
                self.on_reset(exc)
                return
            except BusError as exc:  # unreachable for now: the role's own calls say so
                log.debug("%s: bus epoch not checked: %s", self.name, exc)


class stop_on_bus_reset:  # noqa: N801 (a context manager used as a statement)
    """Run a role's body; on a bus reset, stop it as SIGTERM would, then raise the ``BusReset``."""

    def __init__(self, client: redis.Redis, keys: Keys, role: str, *, grace_s: float = 30.0,
                 interval_s: float | None = None, create: bool = False) -> None:
        self.role = role
        self.grace_s = grace_s
        self.watch = EpochWatch(BusEpoch(client, keys, create=create), self._stop_role, interval_s, role)

    def _stop_role(self, exc: BusReset) -> None:
        log.error("%s: stopping: %s", self.role, exc)
        timer = threading.Timer(self.grace_s, _hard_exit, args=(self.role,))
        timer.daemon = True
        timer.start()
        os.kill(os.getpid(), signal.SIGTERM)

    def __enter__(self) -> EpochWatch:
        return self.watch.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.watch.stop()
        if self.watch.reset is None:  # stopped before the watch's next check (the main job saw it first)
            with contextlib.suppress(BusReset):
                self.watch.check_now()  # so the role still says why the run stops
        if self.watch.reset is not None:
            log.error("%s: exiting: %s", self.role, self.watch.reset)
            raise BusReset(str(self.watch.reset)) from None


def _hard_exit(role: str) -> None:
    log.error("%s: did not stop within its grace after the bus reset: exiting with %d", role, EXIT_BUS_RESET)
    os._exit(EXIT_BUS_RESET)


def create_epoch(client: redis.Redis, keys: Keys) -> BusEpoch:
    """The main job's epoch, written before any role starts (``join``)."""
    epoch = BusEpoch(client, keys, create=True)
    epoch.join()
    return epoch
