"""Rollout requests end to end on a real redis-server and real CPU engines, with an executor run
in-process in burst mode: validation, duplicates, eval, and every kind of bad input."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.errors import InvalidRequest
from rollout_bus.events.names import Keys
from rollout_bus.events.registry import PolicyRecord, Registry
from rollout_bus.events.rollouts import RolloutRequest, SamplingParams
from rollout_bus.events.submit import RolloutSubmitter, SubmitConfig
from rollout_bus.executor.config import ExecutorConfig
from rollout_bus.executor.engines import RouterConfig
from rollout_bus.executor.plugins import PluginConfig
from rollout_bus.executor.service import ExecutorService
from tests.engine_proc import EngineProcess, make_weights_dir
from tests.support.executor_procs import (
    batch_counts,
    batch_ready,
    job,
    register_engines,
    rollout_events,
    train_data,
)

pytestmark = pytest.mark.integration

SHORT = SamplingParams(max_new_tokens=6)


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as tmp:
        engine = EngineProcess(make_weights_dir(Path(tmp) / "w"), token_delay_ms=1)
        try:
            yield engine.url
        finally:
            engine.kill()


@pytest.fixture()
def served(redis_client: redis.Redis, keys: Keys, engine_url: str) -> Keys:
    register_engines(redis_client, keys, {"e0": engine_url})
    return keys


def run_executor(redis_server: RedisServer, keys: Keys, **plugin_args: Any) -> ExecutorService:
    config = ExecutorConfig(redis_url=redis_server.url, namespace=keys.namespace,
                            plugins=PluginConfig(**plugin_args), router=RouterConfig(wait_poll_s=0.05))
    service = ExecutorService(config).start()
    try:
        service.work(burst=True)
    finally:
        service.stop()
    return service


def failed_with(client: redis.Redis, keys: Keys, request: RolloutRequest) -> str:
    """The reason of the request's RolloutFailed, after checking the rest of the failure contract."""
    failed = [e for e in rollout_events(client, keys, "RolloutFailed") if e.request_id == request.request_id]
    assert len(failed) == 1
    queue = keys.eval_queue if request.eval else keys.rollout_queue
    assert request.request_id in FailedJobRegistry(queue, connection=client, serializer=JSONSerializer)
    assert batch_counts(client, keys, request.policy)[request.batch_id] == 0
    assert failed[0].attempts == 1  # a permanent failure is not retried
    return str(failed[0].reason)


def test_a_request_yields_one_batch_of_normalised_train_data(redis_server: RedisServer, redis_client: redis.Redis,
                                                             served: Keys) -> None:
    request = RolloutRequest.create("p", 7, 3, 4, sampling=SHORT, timeout_s=60)
    RolloutSubmitter(redis_client, served).submit(request)
    run_executor(redis_server, served)
    (ready,) = rollout_events(redis_client, served, "RolloutCompleted")
    assert ready.batch_id == request.batch_id and ready.n_samples == 12
    (event,) = batch_ready(redis_client, served)
    data = train_data(redis_client, served, event)
    assert len(data) == 12 and set(data.rollout_ids.tolist()) == {7}
    assert sorted(set(data.group_indices.tolist())) == [0, 1, 2]
    for g in range(3):
        assert abs(float(data.rewards[data.group_indices == g].sum())) < 1e-5
    assert data.weight_versions.tolist() == [0] * 12
    view = data.sample(0)
    assert view.response_length == len(view.rollout_log_probs) == len(view.loss_mask) > 0
    assert job(redis_client, request.request_id).return_value()["batch_id"] == request.batch_id


def test_enqueue_rejects_invalid_requests_with_what_to_fix(redis_client: redis.Redis, served: Keys) -> None:
    submitter = RolloutSubmitter(redis_client, served)
    cases = {
        "unknown policy 'ghost'": RolloutRequest("ghost", 0, 1, 1),
        "n_groups must be a positive integer": RolloutRequest("p", 0, 0, 1),
        "n_samples_per_group must be a positive integer": RolloutRequest("p", 0, 1, -2),
        "sampling.top_p": RolloutRequest("p", 0, 1, 1, sampling=SamplingParams(top_p=1.5)),
        "sampling.max_new_tokens": RolloutRequest("p", 0, 1, 1, sampling=SamplingParams(max_new_tokens=0)),
        "in the past": RolloutRequest.create("p", 0, 1, 1, timeout_s=-5),
    }
    for expected, request in cases.items():
        with pytest.raises(InvalidRequest, match=expected):
            submitter.submit(request)
    assert redis_client.llen(f"rq:queue:{served.rollout_queue}") == 0
    assert rollout_events(redis_client, served) == []


def test_a_duplicate_enqueue_is_one_job_and_one_event(redis_client: redis.Redis, served: Keys) -> None:
    submitter = RolloutSubmitter(redis_client, served)
    request = RolloutRequest.create("p", 0, 1, 2, timeout_s=60)
    first = submitter.submit(request)
    second = submitter.submit(RolloutRequest.from_json(request.to_json()))
    assert first.id == second.id == request.request_id
    assert redis_client.llen(f"rq:queue:{served.rollout_queue}") == 1
    assert len(rollout_events(redis_client, served, "RolloutRequested")) == 1


def test_an_eval_request_gives_metrics_and_no_batch(redis_server: RedisServer, redis_client: redis.Redis,
                                                    served: Keys) -> None:
    request = RolloutRequest.create("p", 3, 2, 2, sampling=SHORT, eval=True, timeout_s=60)
    RolloutSubmitter(redis_client, served).submit(request)
    assert redis_client.llen(f"rq:queue:{served.eval_queue}") == 1
    run_executor(redis_server, served)
    (done,) = rollout_events(redis_client, served, "RolloutCompleted")
    assert done.batch_id == "" and done.metrics["samples"] == 4 and "pass_at_n" in done.metrics
    assert batch_counts(redis_client, served) == {}


def test_an_unknown_policy_at_execution_fails_the_request(redis_server: RedisServer, redis_client: redis.Redis,
                                                          served: Keys) -> None:
    request = RolloutRequest.create("ghost", 0, 1, 1, timeout_s=60)
    RolloutSubmitter(redis_client, served, SubmitConfig(known_policies=("ghost",))).submit(request)
    run_executor(redis_server, served)
    assert "unknown policy 'ghost'" in failed_with(redis_client, served, request)


def test_no_serving_engine_fails_at_the_deadline(redis_server: RedisServer, redis_client: redis.Redis,
                                                 keys: Keys) -> None:
    Registry(redis_client, keys).put_policy(PolicyRecord(policy="p"))  # known, but no engine serves it
    request = RolloutRequest.create("p", 0, 1, 1, timeout_s=1.5)
    RolloutSubmitter(redis_client, keys).submit(request)
    run_executor(redis_server, keys)
    reason = failed_with(redis_client, keys, request)
    assert "no engine served policy 'p'" in reason


def test_malformed_prompt_data_fails_the_request(redis_server: RedisServer, redis_client: redis.Redis,
                                                 served: Keys) -> None:
    request = RolloutRequest.create("p", 0, 3, 1, sampling=SHORT, timeout_s=60)
    RolloutSubmitter(redis_client, served).submit(request)
    run_executor(redis_server, served, data_source_path="tests.support.executor_plugins.MalformedSource")
    assert "malformed prompt data: item 1" in failed_with(redis_client, served, request)
    # the malformed prompt is dropped, the good ones go back to the data source
    cursor = redis_client.hgetall(served.data_cursor("p", "malformed-arith-+-d2-s0"))
    assert [it["index"] for it in msgpack.unpackb(cursor[b"returned"])] == [0, 2]


def test_a_reward_function_that_raises_fails_the_request(redis_server: RedisServer, redis_client: redis.Redis,
                                                         served: Keys) -> None:
    request = RolloutRequest.create("p", 0, 2, 2, sampling=SHORT, timeout_s=60)
    RolloutSubmitter(redis_client, served).submit(request)
    run_executor(redis_server, served, reward_path="tests.support.executor_plugins.exploding_reward")
    reason = failed_with(redis_client, served, request)
    assert "ZeroDivisionError: the reward model fell over" in reason
    # its prompts go back to the data source: the next request gets them
    cursor = redis_client.hgetall(served.data_cursor("p", "arith-+-d2-s0"))
    assert b"returned" in cursor and not any(k.startswith(b"r:") for k in cursor)


def test_group_rewards_and_the_dynamic_filter(redis_server: RedisServer, redis_client: redis.Redis,
                                              served: Keys) -> None:
    request = RolloutRequest.create("p", 0, 2, 4, sampling=SHORT, timeout_s=60, std_normalise=True)
    RolloutSubmitter(redis_client, served).submit(request)
    run_executor(redis_server, served, reward_path="tests.support.executor_plugins.half_reward",
                 group_reward=True, filter_path="rollout_bus.executor.filters.nonzero_reward_std")
    (event,) = batch_ready(redis_client, served)
    data = train_data(redis_client, served, event)
    assert data.raw_reward.tolist() == [1.0, 1.0, 0.0, 0.0] * 2
    assert all(abs(r) > 0.5 for r in data.rewards.tolist())  # (x - 0.5) / std


def test_a_finished_requests_job_and_result_expire_in_minutes_not_a_day(redis_server: RedisServer,
                                                                       redis_client: redis.Redis,
                                                                       served: Keys) -> None:
    request = RolloutRequest.create("p", 1, 1, 2, sampling=SHORT, timeout_s=60)
    RolloutSubmitter(redis_client, served).submit(request)
    run_executor(redis_server, served)
    assert job(redis_client, request.request_id).return_value()["batch_id"] == request.batch_id
    for key in (f"rq:results:{request.request_id}", f"rq:job:{request.request_id}"):
        assert 0 < redis_client.ttl(key) <= SubmitConfig().result_ttl_s <= 600, key


def test_two_executors_started_with_defaults_on_one_host_both_register(redis_server: RedisServer,
                                                                       keys: Keys) -> None:
    services = [ExecutorService(ExecutorConfig(redis_url=redis_server.url, namespace=keys.namespace)).start()
                for _ in range(2)]
    try:
        for service in services:
            assert service.worker is not None
            service.worker.register_birth()  # rq refuses a second live worker of one name
        assert services[0].name != services[1].name
    finally:
        for service in services:
            if service.worker is not None:
                service.worker.register_death()
            service.stop()
