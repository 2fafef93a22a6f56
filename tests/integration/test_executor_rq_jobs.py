"""Which rq jobs an executor runs, and how its reaper treats a retried job: a real redis-server, a real
``rollout-bus executor`` process and a real CPU engine."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis
from rq import Queue, Retry
from rq.callbacks import Callback
from rq.intermediate_queue import IntermediateQueue
from rq.job import JobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.rollouts import RolloutRequest, SamplingParams
from rollout_bus.events.submit import FAILURE_CALLBACK, JOB_FUNC, RolloutSubmitter, SubmitConfig
from rollout_bus.executor.config import ExecutorConfig
from rollout_bus.executor.service import ExecutorService
from rollout_bus.executor.worker import Reaper, ReliableQueue
from tests.engine_proc import EngineProcess, make_weights_dir
from tests.support.executor_procs import ExecutorProcess, batch_counts, job, jobs_done, register_engines
from tests.support.procs import wait_for

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


def test_a_retried_job_taken_by_a_live_worker_is_not_put_back_on_the_queue_early(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys) -> None:
    stranded_after_s = 1.0
    service = ExecutorService(ExecutorConfig(redis_url=redis_server.url, namespace=keys.namespace, index=3)).start()
    assert service._reaper is not None and service.worker is not None
    service._reaper.stop()  # the test runs the reaper's passes itself
    service._reaper = None
    worker = service.worker
    queue = ReliableQueue(keys.rollout_queue, connection=redis_client, serializer=JSONSerializer)
    reaper = Reaper(redis_client, [queue], name="reaper", interval_s=1, stranded_after_s=stranded_after_s)
    intermediate = IntermediateQueue(queue.key, connection=redis_client)
    try:
        request = RolloutRequest.create("p", 0, 1, 2, timeout_s=60)
        RolloutSubmitter(redis_client, keys, SubmitConfig(known_policies=("p",))).submit(request)
        # attempt 1: taken, seen in the intermediate list by a reaper pass, started, then its executor died
        taken = worker.dequeue_job_and_maintain_ttl(timeout=5)
        assert taken is not None and taken[0].id == request.request_id
        reaper.reap_once()
        first = intermediate.get_first_seen(request.request_id)
        assert first is not None
        wait_for("the first sighting is older than the stranded threshold",
                 lambda: (datetime.now(UTC) - first).total_seconds() > stranded_after_s, 10)
        worker.prepare_execution(taken[0])
        worker.prepare_job_execution(taken[0])
        started = StartedJobRegistry(queue=queue)
        members = redis_client.zrange(started.key, 0, -1)
        assert members
        redis_client.zadd(started.key, dict.fromkeys(members, 0), xx=True)  # its heartbeat ran out
        reaper.reap_once()  # abandoned: retried
        assert job(redis_client, request.request_id).retries_left == 2
        assert redis_client.lrange(queue.key, 0, -1) == [request.request_id.encode()]
        # attempt 2: a live worker takes it; the next reaper pass must leave it to that worker
        again = worker.dequeue_job_and_maintain_ttl(timeout=5)
        assert again is not None and again[0].id == request.request_id
        assert intermediate.get_job_ids() == [request.request_id]
        reaper.reap_once()
        assert redis_client.llen(queue.key) == 0, "the retried job was put back while a live worker holds it"
        assert intermediate.get_job_ids() == [request.request_id]
    finally:
        service.stop()
