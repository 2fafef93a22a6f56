"""Queueing rollout requests: validation, the rq job (JSON only) and the RolloutRequested event.

The job id is the request id and the job is enqueued with ``unique=True``, so a second
submit of the same request is a no-op that returns the existing job. Train requests go
to ``keys.rollout_queue``, eval requests to ``keys.eval_queue``.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from rq import Queue, Retry
from rq.exceptions import DuplicateJobError, NoSuchJobError
from rq.job import Callback, Job, JobStatus
from rq.serializers import JSONSerializer

from rollout_bus.events.connection import Guard, Redis
from rollout_bus.events.errors import BusUnavailable, InvalidRequest
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import Registry
from rollout_bus.events.rollouts import RequestBounds, RolloutRequest
from rollout_bus.events.schema import Producer, RolloutRequested

log = logging.getLogger(__name__)

JOB_FUNC = "rollout_bus.executor.jobs.run_rollout"
FAILURE_CALLBACK = "rollout_bus.executor.jobs.on_job_failure"


@dataclass
class SubmitConfig:
    max_retries: int = 3
    """rq retries after the first attempt (a dead executor's job counts one)."""
    job_timeout_s: int = 900
    """Job timeout when the request has no deadline."""
    deadline_grace_s: int = 30
    """With a deadline, the rq timeout is the time left plus this (the executor enforces the deadline)."""
    failure_ttl_s: int = 7 * 86400
    result_ttl_s: int = 300
    """How long a finished job and its rq result stay (``outcome``, ``request --wait`` read them); the
    batch itself travels on the bus, so keeping one key per request for a day only costs memory."""
    known_policies: tuple[str, ...] | None = None
    """Policies a request may name; None: those in the registry (policy records and engine versions)."""
    bounds: RequestBounds = field(default_factory=RequestBounds)
    """Upper bounds of a request's sizes (the executors check their own again)."""


def queue_name(keys: Keys, eval_request: bool) -> str:
    return keys.eval_queue if eval_request else keys.rollout_queue


def rq_queue(client: Redis, name: str) -> Queue:
    return Queue(name, connection=client, serializer=JSONSerializer)


class RolloutSubmitter:
    """Validates and queues rollout requests for one namespace."""

    def __init__(self, client: Redis, keys: Keys, config: SubmitConfig | None = None, *,
                 producer: Producer | None = None) -> None:
        self.client = client
        self.keys = keys
        self.config = config or SubmitConfig()
        self.producer = producer or Producer("client", f"{socket.gethostname()}-{os.getpid()}")
        self.registry = Registry(client, keys)
        self.publisher = Publisher(client, keys, self.producer)
        self.guard = Guard(client, name=f"submitter {self.producer}")
        self._queues = {name: rq_queue(client, name) for name in (keys.rollout_queue, keys.eval_queue)}

    def known_policies(self, wanted: str | None = None) -> set[str]:
        """Policies a request may name. With ``wanted``: the policy records, and only when ``wanted`` has
        none, the engines' versions too (a submit reads one small hash, not every engine record)."""
        if self.config.known_policies is not None:
            return set(self.config.known_policies)
        return known_policies(self.registry, wanted)

    def submit(self, request: RolloutRequest) -> Job:
        """Queue ``request`` (``InvalidRequest`` if it is not valid); a repeat returns the existing job."""
        request.validate(self.known_policies(request.policy), bounds=self.config.bounds)
        queue = self._queues[queue_name(self.keys, request.eval)]

        def enqueue(_: Redis) -> Job:  # a retry after a lost reply finds the job there: DuplicateJobError
            try:
                return queue.enqueue_call(
                    JOB_FUNC, kwargs={"request": request.to_json()}, job_id=request.request_id, unique=True,
                    timeout=self._timeout_s(request), retry=Retry(max=self.config.max_retries),
                    failure_ttl=self.config.failure_ttl_s, result_ttl=self.config.result_ttl_s,
                    on_failure=Callback(FAILURE_CALLBACK),
                    meta={"namespace": self.keys.namespace, "max_retries": self.config.max_retries},
                    description=f"rollout {request.policy}/{request.rollout_id} ({request.request_id})")
            except DuplicateJobError:
                log.info("request %s is already queued: not enqueued again", request.request_id)
                return Job.fetch(request.request_id, connection=self.client, serializer=JSONSerializer)
        event = RolloutRequested(
            producer=self.producer, policy=request.policy, rollout_id=request.rollout_id,
            request_id=request.request_id, n_groups=request.n_groups,
            n_samples_per_group=request.n_samples_per_group, eval=request.eval)
        durable = self.publisher.durability.replicas > 0
        for _ in range(3):
            job = self.guard.call(enqueue)
            # With replicas, the event's WAIT also covers the job written before it (replication is one
            # ordered stream); a failover between the two could still have lost the job on the old
            # primary, so it is looked for once more after the WAIT, and enqueued again if gone.
            self.publisher.publish(self.keys.rollout_stream, event, idempotency_key=request.request_id,
                                   durable=durable)
            if not durable or self.guard.call(lambda c, key=job.key: c.exists(key)):  # type: ignore[misc]
                return job
            log.warning("request %s: its rq job was lost in a failover; enqueueing it again", request.request_id)
        raise BusUnavailable(f"request {request.request_id}: its rq job was lost to failovers three times")

    def _timeout_s(self, request: RolloutRequest) -> int:
        remaining = request.remaining_s()
        if remaining is None:
            return self.config.job_timeout_s
        return max(1, math.ceil(remaining)) + self.config.deadline_grace_s


@dataclass(frozen=True)
class Outcome:
    """Where a queued request stands: its job's state, and its result or error once it ended."""

    state: Literal["queued", "running", "finished", "failed"]
    result: dict[str, Any] | None = None
    error: str | None = None

    @property
    def ended(self) -> bool:
        return self.state in ("finished", "failed")


def outcome(client: Redis, request_id: str) -> Outcome:
    """The state of request ``request_id`` (``InvalidRequest`` if no such request is queued)."""
    try:
        job = Job.fetch(request_id, connection=client, serializer=JSONSerializer)
    except NoSuchJobError:
        raise InvalidRequest(f"no rollout request {request_id!r} is queued (or its record expired)") from None
    status = job.get_status(refresh=True)
    if status == JobStatus.FINISHED:
        value = job.return_value()
        return Outcome("finished", result=value if isinstance(value, dict) else {"value": value})
    if status == JobStatus.FAILED:
        last = job.latest_result()
        return Outcome("failed", error=last.exc_string if last is not None else "failed")
    return Outcome("running" if status == JobStatus.STARTED else "queued")


def wait_outcome(client: Redis, request_id: str, timeout_s: float, *, poll_s: float = 0.2) -> Outcome:
    """Poll ``outcome`` until the request ended or ``timeout_s`` passed (then its last state)."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = outcome(client, request_id)
        if current.ended or time.monotonic() >= deadline:
            return current
        time.sleep(poll_s)


def known_policies(registry: Registry, wanted: str | None = None) -> set[str]:
    """Policies a request for ``wanted`` may name: the policy records, and only when ``wanted`` has none
    (an adapter policy), every engine's versions too. The engine registry grows with the fleet and is read
    for every request checked (submit and execution), so a policy with a record costs one small hash."""
    if wanted is not None:
        policies = set(registry.policies())
        if wanted in policies:
            return policies
    return registry_policies(registry)


def registry_policies(registry: Registry) -> set[str]:
    """Policies the registry knows: those with a policy record and those any engine has weights for."""
    known = set(registry.policies())
    for record in registry.engines().values():
        known.update(record.versions)
    return known

