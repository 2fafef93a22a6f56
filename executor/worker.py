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
- dequeuing never loses a job, and never hands one to two workers: rq takes a job from several queues
  with ``BLPOP``, so a worker that dies between taking a job and registering it as started (milliseconds,
  but a SIGKILL can land there) leaves it in no queue and no registry. ``ReliableQueue`` moves the job id to
  a list of the worker's own (``taken_key``: ``LMOVE``, atomic), the worker removes it there once the start is
  registered, and puts back on its queue whatever it finds there before it takes the next job (one job at a
  time: anything left is from an attempt that never started). The ``Reaper`` puts back a job left in the list
  of a worker that is gone, judged by the worker's heartbeat (its rq worker key expired or marked dead, or its
  pid, on this host, dead), never by how long the job has been there: a live worker's job is never put back,
  however slow it is to start it. The mark is the attempt's own: it goes when the attempt starts (the job's
  status is then ``started`` and the started registry's heartbeat owns it) or is put back.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from rq import Queue, SimpleWorker
from rq.exceptions import DequeueTimeout
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.timeouts import TimerDeathPenalty

from rollout_bus.events import processes
from rollout_bus.events.connection import Redis, as_str
from rollout_bus.executor.rqjob import RolloutJob, refusal

log = logging.getLogger(__name__)


def taken_key(queue_key: str, worker: str) -> str:
    """The list of the job ids ``worker`` took from ``queue_key`` and has not started yet (beside rq's keys)."""
    return f"{queue_key}:taken:{worker}"


def takers_key(queue_key: str) -> str:
    """The set of the workers that take jobs from ``queue_key`` (whose ``taken_key`` lists the reaper looks at)."""
    return f"{queue_key}:takers"


# KEYS[1] queue, KEYS[2] the worker's taken list, KEYS[3] takers set; ARGV[1] worker name. Take the next job.
_TAKE = """
redis.call('SADD', KEYS[3], ARGV[1])
return redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
"""

# KEYS[1] the worker's taken list, KEYS[2] queue, KEYS[3] the worker's rq key, KEYS[4] takers set; ARGV[1] worker
# name, ARGV[2] the pid the caller found dead ('' when it found the key gone or marked dead), ARGV[3] '1' when the
# worker gives back its own, ARGV[4] rq's job key prefix. Unless the worker came back meanwhile (its key holds
# another pid, or is there again unmarked), every job id in the list whose job is still queued goes back to the
# head of its queue; one already started (its started registry entry owns it) or gone is dropped. Returns the
# number put back, -1 when the worker is alive.
_GIVE_BACK = """
if ARGV[3] ~= '1' and redis.call('EXISTS', KEYS[3]) == 1 and redis.call('HEXISTS', KEYS[3], 'death') == 0 then
  local pid = redis.call('HGET', KEYS[3], 'pid')
  if ARGV[2] == '' or pid ~= ARGV[2] then
    return -1
  end
end
local n = 0
while true do
  local id = redis.call('RPOP', KEYS[1])
  if not id then
    break
  end
  if redis.call('HGET', ARGV[4] .. id, 'status') == 'queued' then
    redis.call('LPUSH', KEYS[2], id)
    n = n + 1
  end
end
if ARGV[3] ~= '1' then
  redis.call('SREM', KEYS[4], ARGV[1])
end
return n
"""


class ReliableQueue(Queue):
    """A queue whose dequeue moves the job id to a list of the taking worker's own (``taken_key``) instead of popping
    it: a worker that dies before the job is registered as started leaves it where the ``Reaper`` finds it.
    Dequeuing is for a named worker: ``taken_by(name)`` is the class its worker uses."""

    job_class = RolloutJob
    BLOCK_SLICE_S = 1
    """While blocked on the first (highest-priority) queue, the others are looked at again this often."""
    taker: str | None = None

    @classmethod
    def taken_by(cls, worker: str) -> type[ReliableQueue]:
        return type(cls.__name__, (cls,), {"taker": worker})

    @classmethod
    def dequeue_any(cls, queues: Iterable[Queue], timeout: int | None, connection: Redis,  # type: ignore[override]
                    job_class: Any = None, serializer: Any = None,
                    death_penalty_class: Any = None) -> tuple[Job, Queue] | None:
        if cls.taker is None:
            raise RuntimeError("a ReliableQueue dequeues for a named worker: use ReliableQueue.taken_by(name)")
        taker = cls.taker
        ordered = list(queues)
        take = connection.register_script(_TAKE)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job_id: Any = None
            for queue in ordered:  # in priority order, without blocking
                job_id = take(keys=[queue.key, taken_key(queue.key, taker), takers_key(queue.key)], args=[taker])
                if job_id is not None:
                    break
            else:
                if deadline is None:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DequeueTimeout(timeout, [q.key for q in ordered])
                queue = ordered[0]
                connection.sadd(takers_key(queue.key), taker)  # before the list can hold anything
                job_id = connection.blmove(queue.key, taken_key(queue.key, taker),
                                           max(1, round(left)) if len(ordered) < 2 else cls.BLOCK_SLICE_S)
            if job_id is not None:
                found = cls._fetch_dequeued_job(connection, queue.key, as_str(job_id), job_class=job_class,
                                                serializer=serializer, death_penalty_class=death_penalty_class)
                if found is not None:
                    return found
                connection.lrem(taken_key(queue.key, taker), 1, as_str(job_id))  # a job id without a job


PUBSUB_STOP_S = 1.0
"""How long a stopping worker waits for its pubsub thread (rq's own wait after asking it to stop)."""


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
        self.queue_class = ReliableQueue.taken_by(name)
        self._give_back = connection.register_script(_GIVE_BACK)

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return self.heartbeat_ttl_s

    def unsubscribe(self) -> None:
        """rq's, with the wait for the pubsub thread bounded. rq runs that thread with a 60 s sleep and
        unsubscribes before it stops it; a thread that loops once more after the unsubscribe waits, unsubscribed,
        up to those 60 s for a subscription that never comes, and redis-py's ``stop`` (5.3+) joins it with no
        limit, so a worker told to stop sat there until its supervisor's SIGKILL. The thread is a daemon: the
        process exits without it."""
        thread = self.pubsub_thread
        if thread is None or self.pubsub is None:
            return
        self.log.info("Worker %s: unsubscribing from channel %s", self.name, self.pubsub_channel_name)
        self.pubsub.unsubscribe()
        if "timeout" in inspect.signature(thread.stop).parameters:
            thread.stop(timeout=PUBSUB_STOP_S)
        else:  # redis-py before 5.3: stop() only asks
            thread.stop()
        thread.join(timeout=PUBSUB_STOP_S)

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        # The worker key lives only a little longer than the longest gap between beats (a blocked dequeue), not
        # rq's worker_ttl + 60: the reaper reads its expiry as this worker's death.
        longest_gap = self.dequeue_timeout + self.heartbeat_ttl_s
        super().heartbeat(min(timeout or longest_gap, longest_gap), pipeline=pipeline)

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None
                                     ) -> tuple[Job, Queue] | None:
        for queue in self.queues:  # one job at a time: what our list still holds, no attempt of ours will start
            put_back = give_back(self._give_back, queue.key, self.name, own=True)
            if put_back:
                log.warning("%d job(s) %s took from %s were never started: back on the queue", put_back, self.name,
                            queue.name)
        return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        super().prepare_job_execution(job, remove_from_intermediate_queue=False)
        # the start is registered (the job's status is 'started'): the mark of the attempt goes with it
        self.connection.lrem(taken_key(self.queue_class.redis_queue_namespace_prefix + job.origin, self.name), 1,
                             job.id)

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


def give_back(script: Any, queue_key: str, worker: str, *, own: bool = False, dead_pid: int | None = None) -> int:
    """Put back on its queue what ``worker`` took and never started (``_GIVE_BACK``); -1 when it is alive."""
    return int(script(keys=[taken_key(queue_key, worker), queue_key, SimpleWorker.redis_worker_namespace_prefix + worker,
                            takers_key(queue_key)],
                      args=[worker, "" if dead_pid is None else str(dead_pid), "1" if own else "0",
                            RolloutJob.redis_job_namespace_prefix]))


class Reaper:
    """Retries or fails the jobs of dead executors soon after their heartbeats stop, and puts back on
    their queue jobs a dead executor took but never started."""

    def __init__(self, connection: Redis, queues: list[Queue], *, name: str, interval_s: float,
                 on_thread_start: Callable[[], Any] | None = None) -> None:
        self.connection = connection
        self.queues = queues
        self.name = name
        self.interval_s = interval_s
        self.on_thread_start = on_thread_start
        self.host = socket.gethostname()
        self._give_back = connection.register_script(_GIVE_BACK)
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
                self.requeue_abandoned(queue)
            finally:
                try:
                    lock.release()
                except Exception as exc:  # expired or Redis gone: either way the lock times out by itself
                    log.debug("releasing the cleaning lock of %s: %s", queue.name, exc)

    def gone(self, worker: str) -> tuple[bool, int | None]:
        """Whether ``worker`` is gone, judged by its heartbeat: its rq key expired (it stopped beating) or says it
        died, or it is a process of this host that is dead (then also its pid)."""
        host, pid_text, death = self.connection.hmget(SimpleWorker.redis_worker_namespace_prefix + worker,
                                                      ["hostname", "pid", "death"])
        if death is not None or not self.connection.exists(SimpleWorker.redis_worker_namespace_prefix + worker):
            return True, None
        pid = int(pid_text) if pid_text is not None and as_str(pid_text).isdigit() else 0
        if host is not None and as_str(host) == self.host and pid and not processes.alive(pid):
            return True, pid
        return False, None

    def requeue_abandoned(self, queue: Queue) -> int:
        """Jobs a worker that is gone took from ``queue`` and never started: back to the head of the queue (not a
        retry: no attempt ran). A live worker's are left to it, however long it holds them. Returns how many."""
        requeued = 0
        for raw in self.connection.smembers(takers_key(queue.key)):  # type: ignore[union-attr]
            worker = as_str(raw)
            gone, pid = self.gone(worker)
            if not gone:
                continue
            put_back = give_back(self._give_back, queue.key, worker, dead_pid=pid)
            if put_back > 0:
                requeued += put_back
                log.warning("%d job(s) taken from %s by %s, which is gone, were never started: back on the queue",
                            put_back, queue.name, worker)
        return requeued
