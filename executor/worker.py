"""The rq worker of an executor: in-process jobs, short heartbeats, fast reaping of dead peers.

rq's ``SimpleWorker`` runs jobs in its own process (no fork), which keeps the HTTP pool
and the plug-ins warm, but it sets a job's heartbeat once, for the whole job timeout plus
a minute, and looks for abandoned jobs only every ten minutes. Here:

- ``ExecutorWorker`` gives each execution a TTL of ``heartbeat_ttl_s`` and refreshes it
  from a thread every ``heartbeat_interval_s`` while the job runs; if the process dies,
  the execution expires within ``heartbeat_ttl_s``;
- ``Reaper`` (one thread per executor) runs rq's abandoned-job handling on the started
  registries every ``reap_interval_s``, so a dead executor's job is retried elsewhere within
  about ``heartbeat_ttl_s + reap_interval_s``. It holds rq's own registry-cleaning lock while
  it does, so neither another reaper nor rq's maintenance pass retries the same job twice;
- a worker that finds its own stable name still registered by a dead process on the same
  host takes the name over and marks that process's executions expired at once;
- only rollout jobs run: the worker, its queues and the reaper's registries use ``RolloutJob``
  (``executor/rqjob.py``), which imports no function or callback but the project's own; any other
  job fails at once, unretried, with the reason;
- dequeuing never loses a job: rq takes a job from several queues with ``BLPOP``, so a worker
  that dies between taking a job and registering it as started (milliseconds, but a SIGKILL can
  land there) leaves it in no queue and no registry. ``ReliableQueue`` always moves the job id
  to the queue's intermediate list (``LMOVE``, rq's own single-queue way), the worker removes it
  there when it registers the start, and the ``Reaper`` puts back on its queue a job left in an
  intermediate list for longer than a live worker ever takes (``stranded_after_s``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from rq import Queue, SimpleWorker
from rq.exceptions import DequeueTimeout
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.timeouts import TimerDeathPenalty

from rollout_bus.events import processes
from rollout_bus.events.connection import Redis, as_str
from rollout_bus.executor.rqjob import RolloutJob, first_seen_key, refusal

log = logging.getLogger(__name__)


class ReliableQueue(Queue):
    """A queue whose dequeue from several queues moves the job id to an intermediate list, like rq's
    single-queue dequeue, instead of popping it: a worker that dies before the job is registered as
    started leaves it where the ``Reaper`` finds it."""

    job_class = RolloutJob
    BLOCK_SLICE_S = 1
    """While blocked on the first (highest-priority) queue, the others are looked at again this often."""

    @classmethod
    def dequeue_any(cls, queues: Iterable[Queue], timeout: int | None, connection: Redis,  # type: ignore[override]
                    job_class: Any = None, serializer: Any = None,
                    death_penalty_class: Any = None) -> tuple[Job, Queue] | None:
        ordered = list(queues)
        if len(ordered) < 2:
            return super().dequeue_any(ordered, timeout, connection, job_class=job_class, serializer=serializer,
                                       death_penalty_class=death_penalty_class)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for queue in ordered:  # in priority order, without blocking
                job_id = connection.lmove(queue.key, IntermediateQueue.get_intermediate_queue_key(queue.key))
                if job_id is not None:
                    found = cls._fetch_dequeued_job(connection, queue.key, as_str(job_id), job_class=job_class,
                                                    serializer=serializer, death_penalty_class=death_penalty_class)
                    if found is not None:
                        return found
                    break  # a job id without a job: look again from the top
            else:
                if deadline is None:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DequeueTimeout(timeout, [q.key for q in ordered])
                first = ordered[0].key
                job_id = connection.blmove(first, IntermediateQueue.get_intermediate_queue_key(first),
                                           cls.BLOCK_SLICE_S)
                if job_id is not None:
                    found = cls._fetch_dequeued_job(connection, first, as_str(job_id), job_class=job_class,
                                                    serializer=serializer, death_penalty_class=death_penalty_class)
                    if found is not None:
                        return found


class ExecutorWorker(SimpleWorker):
    """A ``SimpleWorker`` with short, refreshed execution heartbeats and a hook around each job."""

    queue_class = ReliableQueue
    job_class = RolloutJob

    def __init__(self, queues: list[Queue], *, name: str, connection: Redis, heartbeat_ttl_s: int,
                 heartbeat_interval_s: float, worker_ttl_s: int,
                 around_job: Callable[[Job], Any] | None = None) -> None:
        super().__init__(queues, name=name, connection=connection, serializer=JSONSerializer, job_class=RolloutJob,
                         worker_ttl=worker_ttl_s, job_monitoring_interval=max(1, int(heartbeat_interval_s)))
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.around_job = around_job

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return self.heartbeat_ttl_s

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        # the job id is in its queue's intermediate list whatever the number of queues (ReliableQueue)
        super().prepare_job_execution(job, remove_from_intermediate_queue=True)

    def perform_job(self, job: Job, queue: Queue, execution: Any) -> bool:
        reason = refusal(job)
        if reason is not None:  # its function raises ForbiddenJob before anything is imported
            log.error("refusing %s", reason)
            job.retries_left = 0
        return bool(super().perform_job(job, queue, execution))

    def execute_job(self, job: Job, queue: Queue) -> None:
        stop = threading.Event()
        beat = threading.Thread(target=self._beat, args=(job, stop), name=f"heartbeat-{job.id}", daemon=True)
        context = self.around_job(job) if self.around_job is not None else None
        beat.start()
        try:
            if context is not None:
                with context:
                    super().execute_job(job, queue)
            else:
                super().execute_job(job, queue)
        finally:
            stop.set()
            beat.join(5)

    def _beat(self, job: Job, stop: threading.Event) -> None:
        while not stop.wait(self.heartbeat_interval_s):
            execution = next(iter(list(self.executions.values())), None)
            if execution is None:
                continue
            try:
                self.maintain_heartbeats(job, execution)
            except Exception as exc:  # a missed beat is retried next interval; the TTL has slack for one
                log.warning("heartbeat for job %s failed: %s", job.id, exc)

    def register_birth(self) -> None:
        self._take_over_stale_name()
        super().register_birth()

    def _take_over_stale_name(self) -> None:
        """If a dead process on this host left our name registered, expire its executions and drop it."""
        data: dict[bytes, bytes] = self.connection.hgetall(self.key)  # type: ignore[assignment]
        if not data or b"death" in data:
            return
        host = (data.get(b"hostname") or b"").decode()
        try:
            pid = int(data.get(b"pid") or 0)
        except ValueError:
            pid = 0
        if host != self.hostname or pid == os.getpid() or processes.alive(pid):
            return  # a live worker holds the name: rq refuses to start a second one
        members: set[bytes] = self.connection.smembers(self.executions_key)  # type: ignore[assignment]
        composites = [c.decode() for c in members]
        log.warning("worker name %s was left registered by dead pid %d; taking it over and expiring its "
                    "%d execution(s) now", self.name, pid, len(composites))
        with self.connection.pipeline() as pipe:
            for queue in self.queues:
                for composite in composites:
                    pipe.zadd(queue.started_job_registry.key, {composite: 0}, xx=True)
            pipe.delete(self.key, self.executions_key)
            pipe.execute()


# KEYS[1] intermediate list, KEYS[2] queue; ARGV[1] job id. Back to the head of its queue, once.
_REQUEUE = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 1 then
  redis.call('LPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0
"""


class Reaper:
    """Retries or fails the jobs of dead executors soon after their heartbeats stop, and puts back on
    their queue jobs a dead executor took but never started."""

    def __init__(self, connection: Redis, queues: list[Queue], *, name: str, interval_s: float,
                 on_thread_start: Callable[[], Any] | None = None, stranded_after_s: float = 10.0) -> None:
        self.connection = connection
        self.queues = queues
        self.name = name
        self.interval_s = interval_s
        self.on_thread_start = on_thread_start
        self.stranded_after_s = stranded_after_s
        self._requeue = connection.register_script(_REQUEUE)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="executor-reaper", daemon=True)

    def start(self) -> Reaper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        if self.on_thread_start is not None:
            self.on_thread_start()
        while True:
            try:
                self.reap_once()
            except Exception as exc:
                log.warning("looking for abandoned jobs failed: %s", exc)
            if self._stop.wait(self.interval_s):
                return

    def reap_once(self) -> None:
        for queue in self.queues:
            # rq's maintenance takes the same key (SET NX); the timeout only matters if we die holding it
            lock = self.connection.lock(queue.registry_cleaning_key, timeout=max(self.interval_s * 5, 10.0))
            if not lock.acquire(blocking=False):
                continue  # someone is cleaning this queue's registries right now
            try:
                StartedJobRegistry(queue=queue, job_class=RolloutJob,
                                   death_penalty_class=TimerDeathPenalty).cleanup()
                self.requeue_stranded(queue)
            finally:
                try:
                    lock.release()
                except Exception as exc:  # expired or Redis gone: either way the lock times out by itself
                    log.debug("releasing the cleaning lock of %s: %s", queue.name, exc)


    def requeue_stranded(self, queue: Queue) -> int:
        """Jobs in ``queue``'s intermediate list for longer than ``stranded_after_s``: taken by a worker that
        died before starting them. Back to the head of the queue (not a retry: no attempt ran); returns how many."""
        stranded = IntermediateQueue(queue.key, connection=self.connection)
        requeued = 0
        for job_id in stranded.get_job_ids():
            if stranded.set_first_seen(job_id):
                continue  # seen for the first time: a live worker may be starting it right now
            first = stranded.get_first_seen(job_id)
            if first is None or (datetime.now(UTC) - first).total_seconds() < self.stranded_after_s:
                continue
            if self._requeue(keys=[stranded.key, queue.key], args=[job_id]):
                self.connection.delete(first_seen_key(queue.key, job_id))
                requeued += 1
                log.warning("job %s was taken from %s by an executor that died before starting it: back on the "
                            "queue", job_id, queue.name)
        return requeued
