"""The staleness budget: which prompt groups of a batch may still be trained.

A sample's staleness is the trainer's current weight version minus the oldest weight
version the engines reported while making it. A group is kept only when every one of
its samples is within ``max_staleness`` (the oldest sample of a group decides, as in
miles' ``--max-weight-staleness``); GRPO advantages are per group, so a group is kept
or dropped whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout_bus.events.train_data import TrainData


@dataclass
class Split:
    fresh: TrainData | None
    """The samples to train, or None when no group is fresh enough."""
    stale_groups: list[int]
    """Prompt (group) indices of the groups left out."""
    stale_samples: int
    staleness: torch.Tensor
    """Per-sample staleness of the whole batch."""


def staleness_of(data: TrainData, version: int) -> torch.Tensor:
    return version - data.weight_versions


def split_stale(data: TrainData, version: int, max_staleness: int | None) -> Split:
    """Keep the groups whose oldest sample is at most ``max_staleness`` behind ``version``."""
    staleness = staleness_of(data, version)
    if max_staleness is None or len(data) == 0 or int(staleness.max()) <= max_staleness:
        return Split(data, [], 0, staleness)
    too_old = staleness > max_staleness
    stale_groups = sorted({int(g) for g in data.group_indices[too_old].tolist()})
    stale_set = torch.tensor(stale_groups, dtype=data.group_indices.dtype)
    keep = ~torch.isin(data.group_indices, stale_set)
    kept = keep.nonzero().squeeze(1).tolist()
    fresh = data.select(kept) if kept else None
    return Split(fresh, stale_groups, len(data) - len(kept), staleness)
