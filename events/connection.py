"""Connections to Redis and the boundary where driver errors become the project's own.

``connect`` builds a client from ``REDIS_URL`` (``redis://``, ``rediss://`` or
``unix://``, with username and password). ``Guard.call`` runs one Redis operation; when the
server is unreachable it reconnects with bounded exponential backoff, logs once when the
connection is lost and once when it is back, and raises ``BusUnavailable`` when the
budget is spent. Any other driver error becomes ``RedisCommandError``. ``Lane`` is a hot
path's kept connection for commands it packs itself (``pack``); ``raise_errors`` and
``as_str`` read what comes back.

``Guard`` is the one retry layer: clients from ``connect`` never re-send a command on their
own (redis-py's retry is off unless asked for), so a reply lost with its connection always
surfaces as an outage the guard counts. Consumers rely on that: a read whose reply died may
have delivered entries, and an outage is their cue to page through their own pending list.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from hiredis import pack_command as _pack_command
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from rollout_bus.events.errors import BusUnavailable, RedisCommandError

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_URL = "redis://127.0.0.1:6379/0"
Redis = redis.Redis
Pipeline = redis.client.Pipeline
ResponseError = redis.ResponseError


def redis_url(url: str | None = None) -> str:
    return url or os.environ.get("REDIS_URL") or DEFAULT_URL


def connect(url: str | None = None, *, socket_timeout_s: float | None = 30.0, retries: int = 0) -> redis.Redis:
    """A client for ``url`` (or ``$REDIS_URL``); replies are bytes, never decoded.

    ``retries`` > 0 lets redis-py send a command again after a connection error, for code the
    project does not guard itself (rq's worker); the project's own commands go through
    ``Guard``, which sees every lost reply only if nothing below it re-sends silently.
    """
    target = redis_url(url)
    tcp: dict[str, Any] = {} if target.startswith("unix://") else {"socket_keepalive": True}
    retry = (Retry(ExponentialBackoff(cap=0.5, base=0.02), retries=retries) if retries > 0
             else Retry(NoBackoff(), retries=0))
    return redis.Redis.from_url(
        target,
        decode_responses=False,
        socket_connect_timeout=5.0,
        socket_timeout=socket_timeout_s,
        health_check_interval=15,
        **tcp,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError] if retries > 0 else [],
    )


@dataclass
class ReconnectPolicy:
    max_wait_s: float = 60.0
    base_s: float = 0.05
    cap_s: float = 2.0


class Guard:
    """Runs Redis operations with reconnect-and-backoff and error translation."""

    def __init__(self, client: redis.Redis, policy: ReconnectPolicy | None = None, name: str = "redis") -> None:
        self.client = client
        self.policy = policy or ReconnectPolicy()
        self.name = name
        self._lost_since: float | None = None
        self._lock = threading.Lock()
        self.outages = 0  # times the connection was lost; a reply in flight may have been lost with it

    def call(self, fn: Callable[[Any], T]) -> T:
        delay = self.policy.base_s
        started = time.monotonic()
        while True:
            try:
                result = fn(self.client)
            except (redis.AuthenticationError, redis.exceptions.AuthorizationError) as exc:
                # reachable, but refused: retrying for the whole budget would only hide the cause
                self._note_back()
                raise RedisCommandError(f"{self.name}: {type(exc).__name__}: {exc}") from None
            except (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError) as exc:
                self._note_lost(exc)
                waited = time.monotonic() - started
                if waited > self.policy.max_wait_s:
                    raise BusUnavailable(f"{self.name}: Redis unreachable for {waited:.1f}s "
                                         f"(budget {self.policy.max_wait_s:g}s): {exc}") from None
                time.sleep(delay)
                delay = min(delay * 2, self.policy.cap_s)
                continue
            except redis.ResponseError as exc:
                self._note_back()
                raise RedisCommandError(str(exc)) from None
            except redis.RedisError as exc:
                raise RedisCommandError(f"{type(exc).__name__}: {exc}") from None
            self._note_back()
            return result

    def _note_lost(self, exc: BaseException) -> None:
        with self._lock:
            if self._lost_since is None:
                self._lost_since = time.monotonic()
                self.outages += 1
                log.warning("%s: connection to Redis lost (%s); reconnecting", self.name, exc)

    def _note_back(self) -> None:
        if self._lost_since is None:
            return
        with self._lock:
            if self._lost_since is not None:
                log.warning("%s: connection to Redis is back after %.2fs", self.name,
                            time.monotonic() - self._lost_since)
                self._lost_since = None


def pack(*args: Any) -> bytes:
    """One command in the Redis protocol: str, bytes (or bytes-like), int or float arguments."""
    try:
        return _pack_command(args)  # type: ignore[arg-type]  # its stub reads as a 1-tuple
    except TypeError:
        return _pack_command(tuple(bytes(a) if isinstance(a, bytearray | memoryview) else a  # type: ignore[arg-type]
                                   for a in args))


class Lane:
    """A hot path's own connection: already packed commands, replies read straight off it.

    ``execute_command`` costs ~20 us of client CPU a call on this project's 2-core hosts, of
    which the socket round trip is ~8 us: the rest is the pool check-out and check-in and
    redis-py's per-call bookkeeping. A lane keeps one connection of the client's pool checked
    out for its owner and sends commands the owner packed itself; what stays the same: the
    connection's own retry policy (a command is sent again after a connection error, so only
    idempotent commands belong here), its health checks, disconnect on any error, a fresh
    connection in a forked child. Concurrent callers do not queue behind the kept connection:
    whoever finds it busy borrows another from the pool for that call.

    ``direct`` is False (the owner keeps using the client's commands) for anything but a plain
    ``redis.Redis`` with a connection pool: single-connection clients, wrappers and proxies.
    A pool that may run out (``BlockingConnectionPool``) lends a connection per call instead.
    """

    def __init__(self, client: Any) -> None:
        pool = getattr(client, "connection_pool", None)
        # a plain client only: a wrapper (a test's fault injector, a proxy) keeps its own commands in the path
        self.direct = (isinstance(client, redis.Redis) and isinstance(pool, redis.ConnectionPool)
                       and client.connection is None)
        self._pool: Any = pool
        self._keep = self.direct and not isinstance(pool, redis.BlockingConnectionPool)
        self._held: list[Any] = [None, 0]  # the kept connection and the pid that took it
        self._lock = threading.Lock()
        if self._keep:  # a lane dropped without close() still gives its connection back
            weakref.finalize(self, _give_back, pool, self._held)

    def execute(self, packed: bytes, replies: int = 1) -> list[Any]:
        """Send ``packed`` (``replies`` commands) and read their replies, in order.

        An error reply takes the place of its command's reply as a ``ResponseError`` instance
        (the others are still read, so the connection stays in step); connection errors raise.
        """
        if self._keep and self._lock.acquire(blocking=False):
            try:
                held = self._held
                conn = held[0]
                if conn is None or held[1] != _PID[0]:  # after a fork the parent's socket is not ours
                    conn = held[0] = self._pool.get_connection()
                    held[1] = _PID[0]
                return _exchange(conn, packed, replies)
            finally:
                self._lock.release()
        conn = self._pool.get_connection()
        try:
            return _exchange(conn, packed, replies)
        finally:
            self._pool.release(conn)

    def close(self) -> None:
        """Give the kept connection back to the pool (a later call takes one again)."""
        with self._lock:
            _give_back(self._pool, self._held)


_PID = [os.getpid()]
"""This process's id, kept current across forks: ``os.getpid`` is a system call, and a lane asks per command."""
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


def _give_back(pool: Any, held: list[Any]) -> None:
    conn, pid = held
    held[0] = None
    if conn is not None and pid == os.getpid():
        pool.release(conn)


def _exchange(conn: Any, packed: bytes, replies: int) -> list[Any]:
    """Send once and read ``replies`` replies; on a connection error disconnect and raise (never re-send)."""
    if replies == 1:
        return [_exchange_one(conn, packed)]
    out: list[Any] = []
    try:
        conn.send_packed_command([packed])
        for _ in range(replies):
            try:
                out.append(conn.read_response())
            except redis.ResponseError as exc:  # the error reply has been read in full: keep going
                out.append(exc.with_traceback(None))  # no frames kept alive through a cycle via ``out``
    except BaseException:
        conn.disconnect()  # a half-read reply would put the next command out of step
        raise
    finally:
        if conn.should_reconnect():
            conn.disconnect()
    return out


def _exchange_one(conn: Any, packed: bytes) -> Any:
    """``_exchange`` of a single command: its reply, an error reply as a ``ResponseError`` instance."""
    try:
        conn.send_packed_command([packed])
        try:
            return conn.read_response()
        except redis.ResponseError as exc:
            return exc.with_traceback(None)
    except BaseException:
        conn.disconnect()
        raise
    finally:
        if conn.should_reconnect():
            conn.disconnect()


def raise_errors(replies: list[Any]) -> list[Any]:
    """``replies`` of ``Lane.execute`` as they are, or the first error reply among them raised."""
    for reply in replies:
        if isinstance(reply, redis.ResponseError):
            raise reply
    return replies


def as_str(value: Any) -> str:
    """A reply value (an id, a name) as text: bytes decoded as UTF-8, anything else through ``str``."""
    return value.decode() if isinstance(value, bytes) else str(value)


def is_busygroup(exc: BaseException) -> bool:
    return "BUSYGROUP" in str(exc)
