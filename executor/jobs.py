"""The functions rq calls by name: the rollout job and its failure callback.

rq imports a job's function from its dotted name; the warm state it needs (event loop,
HTTP pool, plug-ins) belongs to the ``ExecutorService`` running the worker, which binds
itself to the thread that executes jobs (``bind``) for the duration of each job.

The failure callback runs for every failed attempt, in the executor that ran it or, for
an abandoned job (its executor died), in whichever executor found it. Only the final
failure (no retries left) publishes ``RolloutFailed`` and gives the request's reserved
prompts back.
"""

from __future__ import annotations

import contextvars
import logging
import socket
from types import TracebackType
from typing import Any, Protocol

from rq.exceptions import AbandonedJobError
from rq.job import Job, get_current_job

from rollout_bus.events.connection import Redis
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import Producer, RolloutFailed
from rollout_bus.executor.cursor import CursorStore
from rollout_bus.executor.errors import DataError

log = logging.getLogger(__name__)


class JobHost(Protocol):
    """What a job needs of the worker running it (``executor.service.ExecutorService``)."""

    producer: Producer
    publisher: Publisher | None

    def run_job(self, request_json: dict[str, Any], job: Job) -> dict[str, Any]: ...


_service: contextvars.ContextVar[JobHost | None] = contextvars.ContextVar("executor_service", default=None)


def bind(service: JobHost) -> contextvars.Token[JobHost | None]:
    return _service.set(service)


def unbind(token: contextvars.Token[JobHost | None]) -> None:
    _service.reset(token)


def current_service() -> JobHost:
    service = _service.get()
    if service is None:
        raise RuntimeError("rollout jobs run only inside an executor worker (rollout-bus executor)")
    return service


def attempt_of(job: Job) -> int:
    """The 1-based number of the attempt now starting."""
    max_retries = int(job.meta.get("max_retries", 0))
    left = job.retries_left if job.retries_left is not None else max_retries
    return max_retries - left + 1


def run_rollout(request: dict[str, Any]) -> dict[str, Any]:
    """The rq job: serve one rollout request; returns a JSON summary."""
    job = get_current_job()
    if job is None:
        raise RuntimeError("run_rollout must run as an rq job")
    return current_service().run_job(request, job)


def on_job_failure(job: Job, connection: Redis, exc_type: type[BaseException] | None,
                   exc_value: BaseException | None, tb: TracebackType | None) -> None:
    """rq failure callback: on the final failure, RolloutFailed and the prompts go back."""
    if job.retries_left:
        log.warning("request %s attempt %s failed (%s); %d retr%s left", job.id, job.meta.get("attempt", "?"),
                    describe(exc_type, exc_value), job.retries_left, "y" if job.retries_left == 1 else "ies")
        return
    keys = Keys(job.meta.get("namespace") or Keys().namespace)
    request = job.kwargs.get("request") if isinstance(job.kwargs, dict) else None
    request = request if isinstance(request, dict) else {}
    reason = describe(exc_type, exc_value)
    attempts = int(job.meta.get("attempt", 1))
    service = _service.get()
    producer = service.producer if service is not None else Producer("executor", socket.gethostname())
    publisher = service.publisher if service is not None and service.publisher is not None else Publisher(
        connection, keys, producer)
    cursor_key = job.meta.get("cursor_key")
    if isinstance(cursor_key, str):
        drop: bool | tuple[int, ...] = False
        if isinstance(exc_value, DataError):
            drop = exc_value.indices if exc_value.indices is not None else True
        CursorStore(connection, keys).release(cursor_key, job.id, drop=drop)
    rollout_id = request.get("rollout_id")
    publisher.publish(keys.rollout_stream, RolloutFailed(
        producer=producer, policy=str(request.get("policy", "")),
        rollout_id=rollout_id if isinstance(rollout_id, int) else -1, request_id=job.id, reason=reason,
        attempts=attempts), idempotency_key=f"{job.id}:failed")
    log.error("request %s failed after %d attempt(s): %s", job.id, attempts, reason)


def describe(exc_type: type[BaseException] | None, exc_value: BaseException | None) -> str:
    if exc_type is AbandonedJobError or isinstance(exc_value, AbandonedJobError):
        return "abandoned: the executor running the request stopped sending heartbeats (died or hung)"
    if exc_value is None:
        return exc_type.__name__ if exc_type is not None else "unknown error"
    return f"{type(exc_value).__name__}: {exc_value}"
