"""Fault tests with real processes: executors and engines SIGKILLed mid-request, executor restarts."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.rollouts import RolloutRequest, SamplingParams
from rollout_bus.events.submit import RolloutSubmitter
from tests.engine_proc import EngineProcess, make_weights_dir
from tests.support.executor_procs import (
    ExecutorProcess,
    batch_counts,
    batch_ready,
    job,
    jobs_done,
    register_engines,
    rollout_events,
    train_data,
)
from tests.support.procs import spawn, wait_for

pytestmark = pytest.mark.integration

# ~0.5 s of engine time per request: long enough to be killed in the middle of one
SLOW = SamplingParams(max_new_tokens=24, temperature=1.0)


@pytest.fixture(scope="module")
def weights() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        yield make_weights_dir(Path(tmp) / "w")


@pytest.fixture(scope="module")
def engine_pair(weights: Path) -> Iterator[list[EngineProcess]]:
    procs: list[EngineProcess] = []
    try:
        for _ in range(2):  # one at a time, so a failed start still stops the first
            procs.append(EngineProcess(weights, token_delay_ms=20))
        yield procs
    finally:
        for proc in procs:
            proc.kill()


@pytest.fixture()
def engines(engine_pair: list[EngineProcess]) -> list[EngineProcess]:
    """The module's two engines, each (re)started if a test killed it."""
    for proc in engine_pair:
        proc.start()
    return engine_pair


@pytest.fixture()
def executors() -> Iterator[list[ExecutorProcess]]:
    started: list[ExecutorProcess] = []
    yield started
    for proc in started:
        proc.kill()


def submit(client: redis.Redis, keys: Keys, n: int) -> list[RolloutRequest]:
    submitter = RolloutSubmitter(client, keys)
    requests = [RolloutRequest.create("p", i, 2, 2, sampling=SLOW, timeout_s=120) for i in range(n)]
    for request in requests:
        submitter.submit(request)
    return requests


def started_by(client: redis.Redis, keys: Keys, executor_index: int) -> list[str]:
    suffix = f"-executor-{executor_index}"
    done = {e.request_id for e in rollout_events(client, keys, "RolloutCompleted")}
    return [e.request_id for e in rollout_events(client, keys, "RolloutStarted")
            if e.executor.endswith(suffix) and e.request_id not in done]


def test_three_executors_one_killed_mid_request_every_request_one_batch(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys, engines: list[EngineProcess],
        executors: list[ExecutorProcess]) -> None:
    register_engines(redis_client, keys, {f"e{i}": e.url for i, e in enumerate(engines)})
    requests = submit(redis_client, keys, 20)
    executors += [ExecutorProcess(redis_server.url, keys.namespace, i) for i in range(3)]
    wait_for("executor 0 to be in the middle of a request", lambda: bool(started_by(redis_client, keys, 0)),
             every_s=0.01)
    executors[0].kill()
    (victim,) = started_by(redis_client, keys, 0)
    wait_for("every request to finish", lambda: jobs_done(redis_client, [r.request_id for r in requests]),
             timeout_s=60)
    counts = batch_counts(redis_client, keys)
    assert {r.batch_id: counts[r.batch_id] for r in requests} == {r.batch_id: 1 for r in requests}
    assert sum(counts.values()) == 20
    assert rollout_events(redis_client, keys, "RolloutFailed") == []
    attempts = [e.attempt for e in rollout_events(redis_client, keys, "RolloutStarted") if e.request_id == victim]
    assert attempts == [1, 2]
    assert job(redis_client, victim).return_value()["attempt"] == 2


def test_an_engine_killed_mid_request_the_request_completes_on_the_other(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys, engines: list[EngineProcess],
        executors: list[ExecutorProcess]) -> None:
    register_engines(redis_client, keys, {f"e{i}": e.url for i, e in enumerate(engines)})
    executors.append(ExecutorProcess(redis_server.url, keys.namespace, 0))
    request = RolloutRequest.create("p", 0, 4, 4, sampling=SamplingParams(max_new_tokens=24), timeout_s=120)
    RolloutSubmitter(redis_client, keys).submit(request)
    wait_for("generation to run on engine 0", lambda: engines[0].state().get("running", 0) > 0, every_s=0.01)
    time.sleep(0.1)
    engines[0].kill()
    wait_for("the request to finish", lambda: jobs_done(redis_client, [request.request_id]), timeout_s=60)
    (done,) = rollout_events(redis_client, keys, "RolloutCompleted")
    assert done.batch_id == request.batch_id and done.n_samples == 16
    assert done.metrics["failovers"] >= 1
    (event,) = batch_ready(redis_client, keys)
    data = train_data(redis_client, keys, event)
    assert len(data) == 16 and int(data.response_lengths.min()) >= 1
    assert job(redis_client, request.request_id).return_value()["attempt"] == 1  # failed over inside the job


def test_the_data_cursor_survives_executor_restarts_and_kills(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys, engines: list[EngineProcess],
        executors: list[ExecutorProcess]) -> None:
    register_engines(redis_client, keys, {f"e{i}": e.url for i, e in enumerate(engines)})
    first = submit(redis_client, keys, 3)
    executors.append(ExecutorProcess(redis_server.url, keys.namespace, 0))
    wait_for("the first requests", lambda: jobs_done(redis_client, [r.request_id for r in first]), timeout_s=60)
    executors[0].stop()  # a clean restart ...
    second = submit(redis_client, keys, 4)
    executors.append(ExecutorProcess(redis_server.url, keys.namespace, 0))
    wait_for("a request in flight", lambda: bool(started_by(redis_client, keys, 0)), every_s=0.01)
    executors[1].kill()  # ... and a crash mid-request, restarted under the same name
    executors.append(ExecutorProcess(redis_server.url, keys.namespace, 0))
    wait_for("every request", lambda: jobs_done(redis_client, [r.request_id for r in first + second]),
             timeout_s=60)
    indices = [i for e in batch_ready(redis_client, keys)
               for i in train_data(redis_client, keys, e).metadata["prompt_indices"]]
    assert sorted(indices) == list(range(2 * 7))  # 7 requests of 2 groups: none skipped, none repeated
    assert len(batch_ready(redis_client, keys)) == 7
    cursor = redis_client.hgetall(keys.data_cursor("p", "arith-+-d2-s0"))
    assert set(cursor) == {b"state"}  # no reservation or returned prompt left behind


def test_a_job_taken_by_an_executor_that_died_before_starting_it_goes_back_on_the_queue(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys, engines: list[EngineProcess],
        executors: list[ExecutorProcess], tmp_path: Path) -> None:
    register_engines(redis_client, keys, {f"e{i}": e.url for i, e in enumerate(engines)})
    (request,) = submit(redis_client, keys, 1)
    # an executor serving both queues takes the job the way every executor does, then dies before starting it
    log_path = tmp_path / "taker.log"
    dying = spawn("taker_proc.py", redis_server.url, keys.namespace, "7", log_path=log_path)
    try:
        wait_for("the job taken", lambda: f"taken {request.request_id}" in log_path.read_text(), 60)
        assert redis_client.llen(f"rq:queue:{keys.rollout_queue}") == 0  # off the queue, not started: in flight
    finally:
        os.kill(dying.pid, signal.SIGKILL)
        assert dying.wait(10) == -signal.SIGKILL
    executors.append(ExecutorProcess(redis_server.url, keys.namespace, 0))  # a live executor, another name
    wait_for("the job done by the live executor", lambda: jobs_done(redis_client, [request.request_id]), 60)
    assert batch_counts(redis_client, keys, "p") == {request.batch_id: 1}
    (started,) = [e for e in rollout_events(redis_client, keys, "RolloutStarted") if e.request_id == request.request_id]
    assert started.executor.endswith("-executor-0") and started.attempt == 1  # put back, not a retry
