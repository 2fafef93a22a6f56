"""Connections to Redis and the boundary where driver errors become the project's own.

``connect`` builds a client from ``REDIS_URL`` (``redis://`` or ``rediss://``, with
username and password). ``Guard.call`` runs one Redis operation; when the server is
unreachable it reconnects with bounded exponential backoff, logs once when the
connection is lost and once when it is back, and raises ``BusUnavailable`` when the
budget is spent. Any other driver error becomes ``RedisCommandError``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from events.errors import BusUnavailable, RedisCommandError

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_URL = "redis://127.0.0.1:6379/0"
Redis = redis.Redis
Pipeline = redis.client.Pipeline
ResponseError = redis.ResponseError


def redis_url(url: str | None = None) -> str:
    return url or os.environ.get("REDIS_URL") or DEFAULT_URL


def connect(url: str | None = None, *, socket_timeout_s: float | None = 30.0) -> redis.Redis:
    """A client for ``url`` (or ``$REDIS_URL``); replies are bytes, never decoded."""
    target = redis_url(url)
    tcp: dict[str, Any] = {} if target.startswith("unix://") else {"socket_keepalive": True}
    return redis.Redis.from_url(
        target,
        decode_responses=False,
        socket_connect_timeout=5.0,
        socket_timeout=socket_timeout_s,
        health_check_interval=15,
        **tcp,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), retries=2),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
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


def is_busygroup(exc: BaseException) -> bool:
    return "BUSYGROUP" in str(exc)
