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
  host takes the name over and marks that process's executions expired at once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from rq import Queue, SimpleWorker
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.timeouts import TimerDeathPenalty

from rollout_bus.events import processes
from rollout_bus.events.connection import Redis

log = logging.getLogger(__name__)


class ExecutorWorker(SimpleWorker):
    """A ``SimpleWorker`` with short, refreshed execution heartbeats and a hook around each job."""

    def __init__(self, queues: list[Queue], *, name: str, connection: Redis, heartbeat_ttl_s: int,
                 heartbeat_interval_s: float, worker_ttl_s: int,
                 around_job: Callable[[Job], Any] | None = None) -> None:
        super().__init__(queues, name=name, connection=connection, serializer=JSONSerializer,
                         worker_ttl=worker_ttl_s, job_monitoring_interval=max(1, int(heartbeat_interval_s)))
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.around_job = around_job

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return self.heartbeat_ttl_s

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


class Reaper:
    """Retries or fails the jobs of dead executors soon after their heartbeats stop."""

    def __init__(self, connection: Redis, queues: list[Queue], *, name: str, interval_s: float,
                 on_thread_start: Callable[[], Any] | None = None) -> None:
        self.connection = connection
        self.queues = queues
        self.name = name
        self.interval_s = interval_s
        self.on_thread_start = on_thread_start
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
                StartedJobRegistry(queue=queue, death_penalty_class=TimerDeathPenalty).cleanup()
            finally:
                try:
                    lock.release()
                except Exception as exc:  # expired or Redis gone: either way the lock times out by itself
                    log.debug("releasing the cleaning lock of %s: %s", queue.name, exc)

