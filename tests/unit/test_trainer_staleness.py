"""The staleness budget keeps or drops whole prompt groups."""

from __future__ import annotations

import dataclasses

import torch

from rollout_bus.trainer.staleness import split_stale
from tests.support.fake_rollouts import fake_batch


def test_groups_over_the_budget_are_left_out_whole() -> None:
    data = fake_batch(3, 2, rollout_id=0, version=5)
    versions = data.weight_versions.clone()
    versions[2] = 2  # one sample of group 1 is 4 versions behind version 6
    data = dataclasses.replace(data, weight_versions=versions)
    split = split_stale(data, version=6, max_staleness=2)
    assert split.stale_groups == [1]
    assert split.stale_samples == 2
    assert split.fresh is not None and split.fresh.group_indices.tolist() == [0, 0, 2, 2]
    assert torch.equal(split.staleness, 6 - versions)


def test_no_budget_or_a_fresh_batch_keeps_everything() -> None:
    data = fake_batch(2, 2, rollout_id=0, version=0)
    assert split_stale(data, version=9, max_staleness=None).fresh is data
    assert split_stale(data, version=1, max_staleness=1).fresh is data


def test_an_entirely_stale_batch_leaves_nothing_to_train() -> None:
    split = split_stale(fake_batch(2, 2, rollout_id=0, version=0), version=3, max_staleness=1)
    assert split.fresh is None and split.stale_groups == [0, 1]
