"""Which rq jobs an executor runs, and which jobs its reaper puts back: a real redis-server, real executor
processes (one killed by pid while it holds a job) and a real CPU engine."""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from rq import Queue, Retry
from rq.callbacks import Callback
from rq.job import JobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.rollouts import RolloutRequest, SamplingParams
from rollout_bus.events.submit import FAILURE_CALLBACK, JOB_FUNC, RolloutSubmitter, SubmitConfig
from rollout_bus.executor.config import ExecutorConfig
from rollout_bus.executor.service import ExecutorService
from rollout_bus.executor.worker import Reaper, ReliableQueue, taken_key, takers_key
from tests.engine_proc import EngineProcess, make_weights_dir
from tests.support.executor_procs import ExecutorProcess, batch_counts, job, jobs_done, register_engines
from tests.support.procs import spawn, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture()
def engine_url() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as tmp:
        engine = EngineProcess(make_weights_dir(Path(tmp) / "w"), token_delay_ms=1)
        try:
            yield engine.url
        finally:
            engine.kill()


def test_an_executor_runs_only_the_rollout_job_and_fails_any_other_with_the_reason(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys, engine_url: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "ran"
    monkeypatch.setenv("ROLLOUT_BUS_TEST_MARKER", str(marker))  # the executor process inherits it
    register_engines(redis_client, keys, {"e0": engine_url})
    queue = Queue(keys.rollout_queue, connection=redis_client, serializer=JSONSerializer)  # rq's own API
    hostile = [
        queue.enqueue_call("os.system", args=[f"touch {marker}"], job_id="shell", retry=Retry(max=2)),
        queue.enqueue_call("tests.support.hostile_job.run", job_id="module", retry=Retry(max=2)),
        queue.enqueue_call(JOB_FUNC, kwargs={"request": {}}, job_id="callback",
                           on_failure=Callback("tests.support.hostile_job.run"),
                           on_success=Callback("tests.support.hostile_job.run")),
        queue.enqueue_call(JOB_FUNC, kwargs={"request": {}}, job_id="failure",
                           on_failure=Callback("tests.support.hostile_job.run")),
        queue.enqueue_call(JOB_FUNC, kwargs={"request": {}}, job_id="stopped", on_failure=Callback(FAILURE_CALLBACK),
                           on_stopped=Callback("os.system")),
    ]
    request = RolloutRequest.create("p", 0, 1, 2, sampling=SamplingParams(max_new_tokens=4), timeout_s=60)
    RolloutSubmitter(redis_client, keys).submit(request)
    executor = ExecutorProcess(redis_server.url, keys.namespace, 0)
    try:
        ids = [j.id for j in hostile] + [request.request_id]
        wait_for("every job ended", lambda: jobs_done(redis_client, ids), 60)
        assert executor.proc.poll() is None, executor.log_tail()
    finally:
        executor.stop()
    assert not marker.exists(), marker.read_text()  # nothing named ran, nothing of the module was imported
    assert job(redis_client, request.request_id).get_status() == JobStatus.FINISHED
    assert batch_counts(redis_client, keys, "p") == {request.batch_id: 1}  # the real rollout job still works
    reasons = {
        "shell": "names 'os.system': executors run only rollout_bus.executor.jobs.run_rollout",
        "module": "names 'tests.support.hostile_job.run': executors run only",
        "callback": "names 'tests.support.hostile_job.run' as its success callback",
        "failure": "names 'tests.support.hostile_job.run' as its failure callback",
        "stopped": "names 'os.system' as its stopped callback",
    }
    for job_id, reason in reasons.items():
        failed = job(redis_client, job_id)
        assert failed.get_status() == JobStatus.FAILED
        last = failed.latest_result()
        assert last is not None and "ForbiddenJob" in last.exc_string and reason in last.exc_string, last.exc_string
        assert not failed.retries_left  # refused once, never retried
    assert "refusing job shell names 'os.system'" in executor.log_path.read_text()


def test_a_retried_job_taken_by_a_live_worker_is_never_put_back_however_long_it_holds_it(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys) -> None:
    cfg = ExecutorConfig(redis_url=redis_server.url, namespace=keys.namespace, index=3, heartbeat_ttl_s=2,
                         heartbeat_interval_s=1)
    service = ExecutorService(cfg).start()
    assert service._reaper is not None and service.worker is not None
    reaper = service._reaper
    reaper.stop()  # the test runs the service's reaper passes itself, between the worker's steps
    worker = service.worker
    queue = ReliableQueue(keys.rollout_queue, connection=redis_client, serializer=JSONSerializer)
    try:
        request = RolloutRequest.create("p", 0, 1, 2, timeout_s=60)
        RolloutSubmitter(redis_client, keys, SubmitConfig(known_policies=("p",))).submit(request)
        # attempt 1: taken, seen by a reaper pass while in the worker's hands, started, then its heartbeat ran out
        taken = worker.dequeue_job_and_maintain_ttl(timeout=5)
        assert taken is not None and taken[0].id == request.request_id
        reaper.reap_once()
        worker.prepare_execution(taken[0])
        worker.prepare_job_execution(taken[0])
        started = StartedJobRegistry(queue=queue)
        members = redis_client.zrange(started.key, 0, -1)
        assert members
        redis_client.zadd(started.key, dict.fromkeys(members, 0), xx=True)  # its execution's heartbeat ran out
        reaper.reap_once()  # abandoned: retried
        assert job(redis_client, request.request_id).retries_left == 2
        assert redis_client.lrange(queue.key, 0, -1) == [request.request_id.encode()]
        # attempt 2: the live worker takes it and is slow to start it, past any heartbeat TTL; reaper passes go on
        again = worker.dequeue_job_and_maintain_ttl(timeout=5)
        assert again is not None and again[0].id == request.request_id
        held_since = time.monotonic()
        passes = 0
        while time.monotonic() - held_since < 2 * cfg.heartbeat_ttl_s or passes < 3:
            reaper.reap_once()
            passes += 1
            assert redis_client.llen(queue.key) == 0, f"put back on pass {passes} while a live worker holds it"
            worker.heartbeat()  # alive: it beats (rq beats as it dequeues and from its job heartbeat thread)
            time.sleep(0.1)
        assert redis_client.lrange(taken_key(queue.key, worker.name), 0, -1) == [request.request_id.encode()]
        worker.prepare_execution(again[0])
        worker.prepare_job_execution(again[0])  # started: the attempt's mark goes
        assert redis_client.llen(taken_key(queue.key, worker.name)) == 0
        reaper.reap_once()
        assert redis_client.llen(queue.key) == 0
    finally:
        service.stop()


def test_a_job_taken_by_a_worker_that_died_before_starting_it_goes_back_once_and_only_then(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    queue = ReliableQueue(keys.rollout_queue, connection=redis_client, serializer=JSONSerializer)
    reaper = Reaper(redis_client, [queue], name="reaper", interval_s=1)
    request = RolloutRequest.create("p", 0, 1, 2, timeout_s=60)
    RolloutSubmitter(redis_client, keys, SubmitConfig(known_policies=("p",))).submit(request)
    log_path = tmp_path / "taker.log"
    taker = spawn("taker_proc.py", redis_server.url, keys.namespace, "5", log_path=log_path)
    name = f"{socket.gethostname()}-{keys.namespace}-executor-5"
    try:
        wait_for("the job in the taker's hands", lambda: f"taken {request.request_id}" in log_path.read_text(), 60)
        assert redis_client.llen(queue.key) == 0
        assert redis_client.lrange(taken_key(queue.key, name), 0, -1) == [request.request_id.encode()]
        reaper.reap_once()  # alive: its job stays with it
        assert redis_client.llen(queue.key) == 0
        os.kill(taker.pid, signal.SIGKILL)
        assert taker.wait(10) == -signal.SIGKILL  # the kill landed: it died holding the job, never started
        reaper.reap_once()
        assert redis_client.lrange(queue.key, 0, -1) == [request.request_id.encode()]  # back, at the head, once
        assert redis_client.llen(taken_key(queue.key, name)) == 0
        assert name.encode() not in redis_client.smembers(takers_key(queue.key))
        reaper.reap_once()
        assert redis_client.lrange(queue.key, 0, -1) == [request.request_id.encode()]
        assert job(redis_client, request.request_id).get_status() == JobStatus.QUEUED  # not a retry: no attempt ran
    finally:
        if taker.poll() is None:
            os.kill(taker.pid, signal.SIGKILL)
            taker.wait(10)
