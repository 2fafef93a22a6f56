"""The main job end to end, once per mode: real processes, a real Redis, the reward rises."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.schema import BatchConsumed, TrainStepDone, decode
from rollout_bus.launch.config import RunConfig
from rollout_bus.launch.job import run_job
from tests.support.fake_rollouts import shared_init_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 16
MIN_RISE = 0.15


def run(mode: str, tmp_path: Path, redis_server: RedisServer, keys: Keys, **overrides: object):  # type: ignore[no-untyped-def]
    config = RunConfig(mode=mode, steps=STEPS, seed=0, out=str(tmp_path / "out"), redis_url=redis_server.url,
                       namespace=keys.namespace, init_dir=str(shared_init_dir()), progress=False, timeout_s=240.0,
                       **overrides)  # type: ignore[arg-type]
    return run_job(config)


def trainer_events(redis_server: RedisServer, keys: Keys) -> list:
    from rollout_bus.events.connection import connect

    client = connect(redis_server.url)
    try:
        return [decode(f) for _, f in page(client, keys.trainer_stream)]
    finally:
        client.close()


@pytest.mark.parametrize("mode", ["sync", "one-step"])
def test_the_reward_rises_in_a_short_run(mode: str, tmp_path: Path, redis_server: RedisServer, keys: Keys) -> None:
    result = run(mode, tmp_path, redis_server, keys)
    p0 = result.summaries["p0"]
    assert p0["steps"] == STEPS
    assert p0["reward_after"] - p0["reward_before"] >= MIN_RISE, p0["rewards"]
    assert (result.out / "reward.png").stat().st_size > 0 and (result.out / "summary.json").is_file()
    expected = {0} if mode == "sync" else {0, 1}
    assert set(p0["staleness_hist"]) == expected  # on-policy, or exactly one version behind after the first
    steps = [e for e in trainer_events(redis_server, keys) if isinstance(e, TrainStepDone)]
    assert sorted(e.step for e in steps) == list(range(1, STEPS + 1))


def test_fully_async_keeps_the_staleness_budget_and_still_learns(tmp_path: Path, redis_server: RedisServer,
                                                                 keys: Keys) -> None:
    # two executors and four requests in flight: batches do come back more than one version behind
    result = run("async", tmp_path, redis_server, keys, executors=2, in_flight=4, max_staleness=1)
    p0 = result.summaries["p0"]
    assert p0["steps"] == STEPS
    assert max(p0["staleness_hist"]) <= 1
    events = trainer_events(redis_server, keys)
    steps = [e for e in events if isinstance(e, TrainStepDone)]
    assert all(e.metrics["staleness_max"] <= 1 for e in steps)
    consumed = [e for e in events if isinstance(e, BatchConsumed)]
    assert sum(1 for c in consumed if c.accepted) == STEPS
    assert all(c.staleness > 1 for c in consumed if not c.accepted)  # only stale batches go untrained
    assert p0["reward_after"] - p0["reward_before"] >= MIN_RISE - 0.05, p0["rewards"]
