"""Connections to Redis and the boundary where driver errors become the project's own.

``connect`` builds a client from ``REDIS_URL`` (``redis://``, ``rediss://`` or
``unix://``, with username and password, or ``redis+sentinel://``: see ``SentinelURL``). ``Guard.call`` runs one Redis operation; when the
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

import json
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.sentinel
from hiredis import pack_command as _pack_command
from prometheus_client import Counter, Gauge
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from rollout_bus.events.errors import BusUnavailable, InvalidRequest, RedisCommandError, ReplicationTimeout
from rollout_bus.events.settings import env_int, env_seconds

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

    A ``redis+sentinel://`` url gives a client of the primary that the sentinels name; the
    sentinels are asked once here (``SentinelURL.check``), so an unreachable Sentinel or an
    unknown master name is a clear error at start, not an endless reconnect later.
    """
    target = redis_url(url)
    retry = (Retry(ExponentialBackoff(cap=0.5, base=0.02), retries=retries) if retries > 0
             else Retry(NoBackoff(), retries=0))
    common: dict[str, Any] = dict(
        decode_responses=False,
        socket_connect_timeout=5.0,
        socket_timeout=socket_timeout_s,
        health_check_interval=15,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError] if retries > 0 else [],
    )
    if SentinelURL.matches(target):
        return SentinelURL.parse(target).connect(common)
    tcp: dict[str, Any] = {} if target.startswith("unix://") else {"socket_keepalive": True}
    return redis.Redis.from_url(target, **common, **tcp)


SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_CHECK_S = 10.0
"""How long ``connect`` keeps asking unreachable sentinels before it gives up (``BusUnavailable``)."""


@dataclass(frozen=True)
class SentinelURL:
    """``redis+sentinel://[user:password@]host:port[,host:port...]/<master name>[/<db>][?options]``.

    The hosts are sentinels (port 26379 when left out); the user and password are those of the
    primary and its replicas. Options: ``sentinel_username`` and ``sentinel_password`` when the
    sentinels want their own, ``check_s`` (seconds ``connect`` waits for a reachable sentinel,
    default 10). Example: ``redis+sentinel://h1:26379,h2:26379,h3:26379/mymaster/0``.
    """

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    check_s: float = SENTINEL_CHECK_S

    @staticmethod
    def matches(url: str) -> bool:
        return url.startswith(SENTINEL_SCHEME + "://")

    @classmethod
    def parse(cls, url: str) -> SentinelURL:
        shape = f"{SENTINEL_SCHEME}://host:port[,host:port...]/<master name>[/<db>]"
        parts = urlsplit(url)
        if parts.scheme != SENTINEL_SCHEME:
            raise InvalidRequest(f"not a Sentinel url: {url!r} (expected {shape})")
        userinfo, _, hosts = parts.netloc.rpartition("@")
        username = password = None
        if userinfo:
            user, sep, pw = userinfo.partition(":")
            username, password = (unquote(user) or None), (unquote(pw) if sep else None)
        sentinels: list[tuple[str, int]] = []
        for item in filter(None, hosts.split(",")):
            host, sep, port = item.rpartition(":")
            host, port = (host, port) if sep else (item, "26379")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise InvalidRequest(f"Sentinel address {item!r} in {redact(url)!r} must be host:port ({shape})")
            sentinels.append((host, int(port)))
        if not sentinels:
            raise InvalidRequest(f"{redact(url)!r} names no sentinel ({shape})")
        path = [unquote(p) for p in parts.path.split("/") if p]
        if not path or len(path) > 2:
            raise InvalidRequest(f"{redact(url)!r} must name the master, and at most a db after it ({shape})")
        if len(path) == 2 and not path[1].isdigit():
            raise InvalidRequest(f"db {path[1]!r} in {redact(url)!r} must be a number ({shape})")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = set(query) - {"sentinel_username", "sentinel_password", "check_s"}
        if unknown:
            raise InvalidRequest(f"{redact(url)!r} has unknown options {sorted(unknown)}; "
                                 "known: sentinel_username, sentinel_password, check_s")
        try:
            check_s = float(query.get("check_s", SENTINEL_CHECK_S))
        except ValueError:
            raise InvalidRequest(f"check_s={query['check_s']!r} in {redact(url)!r} must be seconds") from None
        return cls(tuple(sentinels), path[0], int(path[1]) if len(path) == 2 else 0, username, password,
                   query.get("sentinel_username"), query.get("sentinel_password"), check_s)

    def describe(self) -> str:
        return f"master {self.master!r} of sentinels {','.join(f'{h}:{p}' for h, p in self.sentinels)}"

    def sentinel(self, common: dict[str, Any]) -> redis.sentinel.Sentinel:
        # each question to a sentinel is asked once: the caller (``check``, or the guard around a
        # connection that looks the primary up) decides when to ask again
        sentinel_kwargs = {"socket_connect_timeout": 2.0, "socket_timeout": 2.0, "retry": Retry(NoBackoff(), 0),
                           "username": self.sentinel_username, "password": self.sentinel_password}
        return redis.sentinel.Sentinel(list(self.sentinels), sentinel_kwargs=sentinel_kwargs,
                                       socket_keepalive=True, **common)

    def connect(self, common: dict[str, Any]) -> redis.Redis:
        manager = self.sentinel(common)
        self.check(manager)
        return manager.master_for(self.master, redis_class=redis.Redis, connection_class=PrimaryConnection,
                                  db=self.db, username=self.username, password=self.password)

    def check(self, manager: redis.sentinel.Sentinel) -> None:
        """Ask the sentinels for the master until one answers (``check_s``); an unknown name is refused at once."""
        deadline = time.monotonic() + self.check_s
        while True:
            errors: list[str] = []
            known: set[str] = set()
            for node, (host, port) in zip(manager.sentinels, self.sentinels, strict=True):
                try:
                    masters = node.sentinel_masters()
                except redis.AuthenticationError as exc:
                    raise RedisCommandError(f"Sentinel {host}:{port} refused the credentials: {exc}") from None
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    errors.append(f"{host}:{port}: {exc}")
                    continue
                except redis.ResponseError as exc:  # e.g. a plain redis-server, not a sentinel
                    raise InvalidRequest(f"{host}:{port} is not a Redis Sentinel ({exc}); "
                                         f"a {SENTINEL_SCHEME}:// url names sentinels") from None
                if self.master in masters:
                    return
                known.update(as_str(m) for m in masters)
            if known or len(errors) < len(self.sentinels):
                raise InvalidRequest(f"no Sentinel knows a master named {self.master!r} (they know: "
                                     f"{sorted(known) or 'none'}): fix the name in REDIS_URL")
            if time.monotonic() > deadline:
                raise BusUnavailable(f"no Sentinel of {self.describe()} reachable within {self.check_s:g}s: "
                                     + "; ".join(errors))
            time.sleep(0.2)


class PrimaryConnection(redis.sentinel.SentinelManagedConnection):
    """A connection to the primary the sentinels name, refused when the server says it is not one.

    During a failover a sentinel that has not caught up may still name the old primary, back on its
    port as a replica by then; a write there fails in ways redis-py does not take for a failover
    (``NOSCRIPT`` before ``READONLY``). Asking ``HELLO`` for the role once per new connection turns that into a
    connection error, which the guard retries after asking the sentinels again. A connection kept
    out of the pool (``Lane``) that lost its socket asks the sentinels too, not the last address.
    """

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self._sock:  # redis-py would reconnect to the last address here; ask the sentinels instead
            self.connect()
        super().send_packed_command(command, check_health)

    def on_connect_check_health(self, check_health: bool = True) -> None:
        super().on_connect_check_health(check_health=check_health)
        if not self.connection_pool.is_master:
            return
        self.send_command("HELLO")  # no protocol version: nothing changes; every ACL user may (@connection)
        reply = self.read_response()
        info = dict(zip(reply[::2], reply[1::2], strict=True)) if isinstance(reply, list) else dict(reply or {})
        role = as_str(info.get(b"role", info.get("role", b"?")))
        if role != "master":
            where = f"{self.host}:{self.port}"
            self.disconnect()
            raise redis.ConnectionError(f"{where} is not the primary (its role: {role}); "
                                        "the sentinels are still failing over")


UNREACHABLE: tuple[type[BaseException], ...] = (BusUnavailable, redis.ConnectionError, redis.TimeoutError,
                                                ConnectionError)
"""What a call raises when its Redis is gone: ``BusUnavailable`` from a guard past its budget (or on an abandoned
client), the driver's connection and timeout errors from an unguarded call."""


def probe_client(url: str, timeout_s: float = 1.0) -> redis.Redis:
    """A client for reachability checks: connecting and every reply time out after ``timeout_s``, nothing is sent
    again (a server that is gone is known as such within ``timeout_s``)."""
    if SentinelURL.matches(url):
        return connect(url, socket_timeout_s=timeout_s)
    return redis.Redis.from_url(redis_url(url), socket_connect_timeout=timeout_s, socket_timeout=timeout_s)


def answers(client: redis.Redis) -> bool:
    """Whether ``client``'s server answers a PING now."""
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False


def redis_host(url: str | None = None) -> tuple[str, int]:
    """The host and port a url's first server is reached at (a Sentinel url: its first sentinel)."""
    target = redis_url(url)
    if SentinelURL.matches(target):
        return SentinelURL.parse(target).sentinels[0]
    if target.startswith("unix://"):
        return "127.0.0.1", 6379
    parts = urlsplit(target)
    return parts.hostname or "127.0.0.1", parts.port or 6379


def route_address(url: str | None = None) -> str:
    """This host's address on the route to Redis: where other hosts that reach Redis can reach us.

    No packet is sent (a UDP socket's ``connect`` only picks the route); 127.0.0.1 when Redis is local.
    """
    host, port = redis_host(url)
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(infos[0][4])
            return str(sock.getsockname()[0])
    except OSError as exc:
        raise BusUnavailable(f"no route from this host to Redis at {host}:{port} ({exc}): give the address other "
                             "hosts reach this one at (--advertise-host)") from None


def redact(url: str) -> str:
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]).geturl()


def is_sentinel_client(client: Any) -> bool:
    return isinstance(getattr(client, "connection_pool", None), redis.sentinel.SentinelConnectionPool)


@dataclass(frozen=True)
class Durability:
    """How a write that must survive a failover is acknowledged: ``WAIT replicas timeout_ms`` after it.

    ``replicas`` 0: no ``WAIT`` (a single Redis). A ``WAIT`` that returns fewer replicas is tried
    again (the writes are idempotent, so the retry adds nothing) up to ``attempts`` times in all.
    Then the write is *degraded*: it keeps trying, with backoff, for up to ``wait_s`` more, with a
    visible status (a log line, ``rollout_bus_durable_writes_waiting``, the writer's entry in
    ``keys.durability_status`` that ``rollout-bus status`` shows), so a lost replica stalls a role
    instead of crashing it; past the bound the writer gets ``ReplicationTimeout``. Never an
    acknowledgement the replicas did not give.
    """

    replicas: int = 0
    timeout_ms: int = 2000
    attempts: int = 3
    wait_s: float = 0.0


DURABLE_WAITING = Gauge("rollout_bus_durable_writes_waiting", "Durable writes of this process waiting for their "
                        "replicas past their tries (degraded durability)")
DURABLE_SHORT = Counter("rollout_bus_durable_write_short_waits", "WAITs that returned fewer replicas than asked")
DURABLE_TIMEOUTS = Counter("rollout_bus_durable_write_timeouts", "Durable writes given up past their bound "
                           "(ReplicationTimeout)")
DEGRADED_BACKOFF_CAP_S = 5.0

StatusHook = Callable[[dict[str, Any] | None], None]
"""Where a degraded write says so: a dict while it waits (what, replicas asked and acknowledged, since),
None once it is confirmed or given up."""


def confirm_replicated(d: Durability, what: str, attempt: Callable[[], tuple[T, int]],
                       status: StatusHook | None = None) -> T:
    """Run ``attempt`` (the write and its ``WAIT``, returning the result and the replicas that acked)
    until ``d.replicas`` acknowledge it: ``d.attempts`` tries, then degraded for up to ``d.wait_s``
    (see ``Durability``); then ``ReplicationTimeout``."""
    acks = 0
    for i in range(d.attempts):
        result, acks = attempt()
        if acks >= d.replicas:
            return result
        DURABLE_SHORT.inc()
        log.warning("%s: WAIT %d %d: %d replica(s) acknowledged (try %d of %d)", what, d.replicas, d.timeout_ms,
                    acks, i + 1, d.attempts)
    if d.wait_s > 0:
        confirmed, acks = _degraded(d, what, attempt, status, acks)
        if confirmed is not None:
            return confirmed[0]
    DURABLE_TIMEOUTS.inc()
    waited = f" and {d.wait_s:g}s degraded" if d.wait_s > 0 else ""
    raise ReplicationTimeout(
        f"{what}: only {acks} of {d.replicas} replica(s) acknowledged the write within {d.timeout_ms} ms "
        f"(WAIT, {d.attempts} tries{waited}): it is on the primary but a failover now could lose it; check the "
        "replicas (INFO replication on the primary), or set ROLLOUT_BUS_WAIT_REPLICAS=0 to run without them")


def _degraded(d: Durability, what: str, attempt: Callable[[], tuple[T, int]], status: StatusHook | None,
              acks: int) -> tuple[tuple[T] | None, int]:
    """Keep trying past the tries, saying so, until confirmed ((result,), acks) or ``d.wait_s`` ((None, acks))."""
    started = time.monotonic()
    since_ms = int(time.time() * 1000)
    log.error("%s: durability degraded: %d of %d replica(s) acknowledge; the write waits up to %gs for them "
              "(ROLLOUT_BUS_WAIT_DEGRADED_S) before it fails", what, acks, d.replicas, d.wait_s)
    DURABLE_WAITING.inc()
    delay, last_log, tries = 0.25, started, 0
    try:
        while True:
            _say(status, {"what": what, "replicas": d.replicas, "acked": acks, "since_ms": since_ms,
                          "bound_s": d.wait_s, "tries": tries})
            left = d.wait_s - (time.monotonic() - started)
            if left <= 0:
                return None, acks
            time.sleep(min(delay, left))
            delay = min(delay * 2, DEGRADED_BACKOFF_CAP_S)
            result, acks = attempt()
            tries += 1
            if acks >= d.replicas:
                log.warning("%s: confirmed by %d replica(s) after %.1fs degraded", what, acks,
                            time.monotonic() - started)
                return (result,), acks
            DURABLE_SHORT.inc()
            if time.monotonic() - last_log >= 10:
                last_log = time.monotonic()
                log.error("%s: still degraded after %.0fs: %d of %d replica(s)", what, last_log - started, acks,
                          d.replicas)
    finally:
        DURABLE_WAITING.dec()
        _say(status, None)


def status_hook(client: redis.Redis, key: str, writer: str) -> StatusHook:
    """A ``StatusHook`` that keeps ``writer``'s degraded write in the hash ``key`` (JSON; removed once over):
    a plain write on the primary, which is up, only its replicas are missing."""
    def say(state: dict[str, Any] | None) -> None:
        if state is None:
            client.hdel(key, writer)
        else:
            client.hset(key, writer, json.dumps(state))
    return say


def _say(status: StatusHook | None, state: dict[str, Any] | None) -> None:
    if status is None:
        return
    try:
        status(state)
    except Exception as exc:  # the status is a courtesy: never the reason a write fails
        log.debug("could not record the durability status: %s", exc)


def durability(client: Any) -> Durability:
    """From ``ROLLOUT_BUS_WAIT_REPLICAS`` / ``ROLLOUT_BUS_WAIT_TIMEOUT_MS`` / ``ROLLOUT_BUS_WAIT_ATTEMPTS`` /
    ``ROLLOUT_BUS_WAIT_DEGRADED_S`` (default 300, 0: fail at once, inf: wait as long as it takes); the replicas
    default to 1 for a Sentinel client (a replica is configured) and 0 otherwise."""
    wait_s = env_seconds("ROLLOUT_BUS_WAIT_DEGRADED_S", DEFAULT_DEGRADED_S, zero=True, forever=True)
    return Durability(env_int("ROLLOUT_BUS_WAIT_REPLICAS", 1 if is_sentinel_client(client) else 0, minimum=0),
                      env_int("ROLLOUT_BUS_WAIT_TIMEOUT_MS", 2000, minimum=1),
                      env_int("ROLLOUT_BUS_WAIT_ATTEMPTS", 3, minimum=1), wait_s)


DEFAULT_DEGRADED_S = 300.0
"""How long a durable write waits for its replicas past its tries, by default (``Durability.wait_s``)."""


@dataclass
class ReconnectPolicy:
    max_wait_s: float = 60.0
    base_s: float = 0.05
    cap_s: float = 2.0


_ABANDONED: weakref.WeakSet[Any] = weakref.WeakSet()


def abandon(client: Any) -> None:
    """Guards on ``client`` stop waiting for Redis: a call in its reconnect loop fails at its next try. For a role
    that is stopping: it must not wait a reconnect budget for a Redis that is gone (its worker threads would hold
    the process's exit)."""
    _ABANDONED.add(client)


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
                if self.client in _ABANDONED:
                    raise BusUnavailable(f"{self.name}: Redis unreachable and the client abandoned (stopping): "
                                         f"{exc}") from None
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
