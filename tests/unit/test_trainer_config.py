"""Trainer configuration: every problem reported at once; groups per trainer or per rank."""

from __future__ import annotations

import pytest

from rollout_bus.trainer.config import ConfigError, PublishConfig, ScheduleConfig, TrainerConfig


def test_every_invalid_setting_is_named() -> None:
    config = TrainerConfig(policy="bad policy", schedule=ScheduleConfig(mode="sometimes", in_flight=0),
                           dp_rank=2, dp_size=2)
    with pytest.raises(ConfigError) as info:
        config.validate()
    message = str(info.value)
    for fragment in ("policy", "mode 'sometimes'", "in_flight", "dp_rank", "weights_root"):
        assert fragment in message


def test_ranks_share_the_trainer_group_or_take_a_group_each_for_shards() -> None:
    shared = TrainerConfig(trainer_id="t", dp_rank=1, dp_size=2, publish=PublishConfig(weights_root="/w"))
    assert shared.validate().group == "t"
    sharded = TrainerConfig(trainer_id="t", dp_rank=1, dp_size=2, dp_strategy="shards",
                            publish=PublishConfig(weights_root="/w"))
    assert sharded.validate().group == "t-rank1"


def test_waiting_for_serving_defaults_to_every_mode_but_async() -> None:
    for mode, wait in (("sync", True), ("one-step", True), ("async", False)):
        assert TrainerConfig(schedule=ScheduleConfig(mode=mode)).wait_serving is wait
    forced = TrainerConfig(schedule=ScheduleConfig(mode="async"), publish=PublishConfig(wait_serving=True))
    assert forced.wait_serving is True
