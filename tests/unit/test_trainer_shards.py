"""Data-parallel shards split a batch by prompt group, never inside one."""

from __future__ import annotations

import pytest

from rollout_bus.trainer.shards import shard
from tests.support.fake_rollouts import fake_batch


def test_shards_cover_the_batch_once_and_keep_groups_whole() -> None:
    data = fake_batch(5, 3, rollout_id=0, version=0)
    parts = [shard(data, r, 2) for r in range(2)]
    assert all(p is not None for p in parts)
    groups = [sorted(set(p.group_indices.tolist())) for p in parts if p is not None]
    assert groups == [[0, 2, 4], [1, 3]]
    assert sum(len(p) for p in parts if p is not None) == len(data)
    assert shard(data, 0, 1) is data


def test_a_rank_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError):
        shard(fake_batch(1, 1, rollout_id=0, version=0), 2, 2)
