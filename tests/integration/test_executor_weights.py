"""Weight updates during a rollout: versions recorded per sample, abort-mode pauses continued."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.rollouts import RolloutRequest, SamplingParams
from rollout_bus.events.submit import RolloutSubmitter
from rollout_bus.executor.config import ExecutorConfig
from rollout_bus.executor.service import ExecutorService
from tests.engine_proc import EngineProcess, make_weights_dir
from tests.support.executor_procs import batch_ready, register_engines, rollout_events, train_data
from tests.support.procs import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineProcess]:
    with tempfile.TemporaryDirectory() as tmp:
        proc = EngineProcess(make_weights_dir(Path(tmp) / "w"), token_delay_ms=25)
        yield proc
        proc.kill()


def run_while(redis_server: RedisServer, keys: Keys, engine: EngineProcess, action: Callable[[], None]) -> None:
    """Run an executor in burst mode here while ``action`` runs once generation is under way."""
    def act() -> None:
        wait_for("generation", lambda: engine.state().get("running", 0) > 0, every_s=0.01)
        time.sleep(0.15)
        action()

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    service = ExecutorService(ExecutorConfig(redis_url=redis_server.url, namespace=keys.namespace)).start()
    try:
        service.work(burst=True)
    finally:
        service.stop()
    thread.join(10)


def test_a_version_change_mid_sample_is_recorded_as_oldest_and_newest(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys, engine: EngineProcess) -> None:
    register_engines(redis_client, keys, {"e0": engine.url})
    request = RolloutRequest.create("p", 0, 2, 4, sampling=SamplingParams(max_new_tokens=24), timeout_s=60)
    RolloutSubmitter(redis_client, keys).submit(request)
    run_while(redis_server, keys, engine, lambda: engine.post(
        "/update_weight_version", {"new_version": "1", "abort_all_requests": False}))
    data = train_data(redis_client, keys, batch_ready(redis_client, keys)[0])
    long_enough = data.response_lengths > 12
    assert bool(long_enough.any())
    assert data.weight_versions[long_enough].tolist() == [0] * int(long_enough.sum())
    assert data.weight_versions_max[long_enough].tolist() == [1] * int(long_enough.sum())


def test_an_abort_mode_pause_is_continued_as_a_partial_rollout(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys, engine: EngineProcess) -> None:
    register_engines(redis_client, keys, {"e0": engine.url})
    request = RolloutRequest.create("p", 0, 2, 2, sampling=SamplingParams(max_new_tokens=24), timeout_s=60)
    RolloutSubmitter(redis_client, keys).submit(request)

    def pause_abort_and_continue() -> None:
        engine.post("/pause_generation", {"mode": "abort"})
        time.sleep(0.2)
        engine.post("/continue_generation", {})

    run_while(redis_server, keys, engine, pause_abort_and_continue)
    (done,) = rollout_events(redis_client, keys, "RolloutCompleted")
    assert done.metrics["aborts"] >= 1 and done.metrics["aborted_frac"] == 0.0
    data = train_data(redis_client, keys, batch_ready(redis_client, keys)[0])
    assert len(data) == 4
    for view in data.samples():  # continued responses: one sequence of tokens, each with its log-prob
        assert view.response_length == len(view.rollout_log_probs) <= 24
        assert view.tokens[: view.prompt_length].tolist() == view.prompt_tokens.tolist()
