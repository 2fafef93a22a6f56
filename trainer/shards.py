"""Data-parallel ranks: which part of a batch a rank trains.

Two ways for the ranks of one trainer to read its policy's batches:

- ``shared-group``: every rank reads through the trainer's consumer group under its own
  stable consumer name (``<host>-<trainer>-<rank>``); each batch goes to one rank;
- ``shards``: every rank reads every batch through a group of its own
  (``<trainer>-rank<r>``, see ``TrainerConfig.group``) and trains the prompt groups
  ``shard`` assigns it, so GRPO groups are never split across ranks.
"""

from __future__ import annotations

from rollout_bus.events.train_data import TrainData


def shard(data: TrainData, rank: int, size: int) -> TrainData | None:
    """The samples of the prompt groups ``g`` with ``g % size == rank`` (None when there are none)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    if size == 1:
        return data
    keep = ((data.group_indices % size) == rank).nonzero().squeeze(1).tolist()
    return data.select(keep) if keep else None
