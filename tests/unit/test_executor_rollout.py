"""The rollout of one request without engines: groups, rewards, filter, over-sampling rounds, cursor."""

from __future__ import annotations

import asyncio

import fakeredis
import pytest

from rollout_bus.events.names import Keys
from rollout_bus.events.registry import Registry
from rollout_bus.events.rollouts import RolloutRequest
from rollout_bus.executor.cursor import CursorStore
from rollout_bus.executor.engines import EngineCaller, EngineRouter, EngineTime
from rollout_bus.executor.errors import FilterError, RewardError
from rollout_bus.executor.plugins import PluginConfig, Plugins
from rollout_bus.executor.rollout import RolloutOutcome, RolloutRunner


def run(request: RolloutRequest, client: fakeredis.FakeRedis, keys: Keys, **plugin_args: object) -> RolloutOutcome:
    plugins = Plugins(PluginConfig(generate_path="tests.support.executor_plugins.scripted_generate",
                                   **plugin_args))  # type: ignore[arg-type]
    cursor = CursorStore(client, keys)
    runner = RolloutRunner(plugins, EngineCaller(EngineRouter(Registry(client, keys))), cursor)
    source = plugins.data_source(request.data)
    return asyncio.run(runner.run(request, source=source, cursor_key=cursor.key(request.policy, source),
                                  timer=EngineTime()))


def test_train_data_of_a_request(fake_client: fakeredis.FakeRedis, keys: Keys) -> None:
    out = run(RolloutRequest("p", 5, 2, 4), fake_client, keys)
    data = out.train_data
    assert data is not None and len(data) == 8
    assert data.group_indices.tolist() == [0] * 4 + [1] * 4
    assert data.sample_indices.tolist() == list(range(8))
    assert data.raw_reward.tolist() == [1.0, 0.0, 1.0, 0.0] + [0.0] * 4
    assert data.rewards.tolist() == [0.5, -0.5, 0.5, -0.5] + [0.0] * 4
    assert data.weight_versions.tolist() == [3] * 8 and data.rollout_ids.tolist() == [5] * 8
    assert data.metadata["prompt_indices"] == [0, 1] and sorted(out.used_indices) == [0, 1]
    assert out.metrics["reward_mean"] == 0.25


def test_the_filter_drops_groups_and_more_rounds_fill_the_batch(fake_client: fakeredis.FakeRedis,
                                                                  keys: Keys) -> None:
    out = run(RolloutRequest("p", 0, 3, 2), fake_client, keys, filter_path="rollout_bus.executor.filters.nonzero_reward_std")
    assert out.train_data is not None
    assert out.train_data.metadata["prompt_indices"] == [0, 2, 4]
    assert sorted(out.used_indices) == [0, 1, 2, 3, 4]
    assert out.metrics["sampling_rounds"] == 3 and out.metrics["groups_filtered"] == 2


def test_over_sampling_stops_at_enough_groups_and_returns_the_rest(fake_client: fakeredis.FakeRedis,
                                                                   keys: Keys) -> None:
    request = RolloutRequest("p", 0, 1, 2, over_sample_groups=4)
    out = run(request, fake_client, keys)
    assert out.metrics["groups_drawn"] == 4 and out.metrics["groups_kept"] == 1
    assert out.train_data is not None and len(out.train_data.metadata["prompt_indices"]) == 1
    cursor = CursorStore(fake_client, keys)
    key = keys.data_cursor("p", "arith-+-d2-s0")
    cursor.mark_used(key, request.request_id, out.used_indices)
    assert cursor.finalize(key, request.request_id) == 4 - len(out.used_indices)


def test_a_filter_that_drops_everything_fails_the_request(fake_client: fakeredis.FakeRedis, keys: Keys) -> None:
    # one sample per group: no group has a reward spread
    with pytest.raises(FilterError, match="dropped all 4 groups drawn in 4 round"):
        run(RolloutRequest("p", 0, 1, 1), fake_client, keys, filter_path="rollout_bus.executor.filters.nonzero_reward_std")


def test_a_reward_that_raises_or_returns_garbage_is_a_reward_error(fake_client: fakeredis.FakeRedis,
                                                                   keys: Keys) -> None:
    with pytest.raises(RewardError, match="ZeroDivisionError"):
        run(RolloutRequest("p", 0, 1, 2), fake_client, keys,
            reward_path="tests.support.executor_plugins.exploding_reward")
    with pytest.raises(RewardError, match="returned 2 rewards for 3 samples|finite"):
        run(RolloutRequest("p", 0, 1, 3), fake_client, keys,
            reward_path="tests.support.executor_plugins.bad_group_reward", group_reward=True)


def test_pass_at_n_counts_correct_answers_not_partial_credit() -> None:
    from rollout_bus.executor.convert import pass_at_n
    from rollout_bus.executor.sample import Sample

    def made(reward: float, correct: bool | None = None) -> Sample:
        s = Sample(group_index=0, index=0, prompt="", prompt_ids=[1], reward=reward)
        if correct is not None:
            s.metadata["correct"] = correct
        return s

    formatted_but_wrong = [made(0.2, False), made(0.2, False)]
    right_once = [made(0.2, False), made(1.0, True)]
    assert pass_at_n([formatted_but_wrong, right_once]) == 0.5
    # Without the reward's own verdict, only full reward counts: partial credit is not a pass.
    assert pass_at_n([[made(0.5), made(0.0)], [made(1.0)]]) == 0.5
    assert pass_at_n([]) == 0.0


def test_over_sampling_with_the_filter_fills_the_batch_in_one_round(fake_client: fakeredis.FakeRedis,
                                                                     keys: Keys) -> None:
    # odd groups have no reward spread: drawing twice as many as needed fills the batch without a second round
    filtered = run(RolloutRequest("p", 0, 2, 2, over_sample_groups=4), fake_client, keys,
                   filter_path="rollout_bus.executor.filters.nonzero_reward_std")
    assert filtered.train_data is not None and filtered.train_data.metadata["prompt_indices"] == [0, 2]
    assert filtered.metrics["sampling_rounds"] == 1 and filtered.metrics["groups_drawn"] == 4
    assert filtered.metrics["groups_filtered"] >= 1 and filtered.train_data.metadata["filtered"]
    plain = run(RolloutRequest("p", 1, 2, 2), fake_client, keys,
                filter_path="rollout_bus.executor.filters.nonzero_reward_std")
    assert plain.metrics["sampling_rounds"] >= 2  # without over-sampling the filter costs a round
