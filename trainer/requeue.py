"""Giving the prompts of stale groups back to the data source.

A stale group's item is rebuilt from the batch (its prompt index, which is the group
index, its prompt tokens and label) and travels in the trainer's next rollout request
(``RolloutRequest.returned``); the executor that serves it returns the items to the
policy's data source, where they go out first.
"""

from __future__ import annotations

import logging
from typing import Any

from rollout_bus.events.train_data import TrainData
from rollout_bus.lm.tokenizer import decode

log = logging.getLogger(__name__)

Item = dict[str, Any]


def stale_items(data: TrainData, groups: list[int]) -> list[Item]:
    """One data-source item per group index in ``groups``, rebuilt from the batch."""
    meta = data.metadata
    labels = dict(zip(meta.get("prompt_indices", []), meta.get("labels", []), strict=False))
    wanted = set(groups)
    items: list[Item] = []
    seen: set[int] = set()
    for i in range(len(data)):
        g = int(data.group_indices[i])
        if g not in wanted or g in seen:
            continue
        seen.add(g)
        prompt_ids = [int(t) for t in data.tokens[i][:int(data.prompt_lengths[i])].tolist()]
        items.append({"index": g, "prompt": decode(prompt_ids), "prompt_ids": prompt_ids,
                      "label": labels.get(g)})
    return items
