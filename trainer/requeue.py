"""Giving the prompts of stale groups back to the executors' data source.

The data source's shared position lives in the cursor hash of ``(policy, source)``
(see ``executor.cursor``); items in its ``returned`` field go out first in the next
rollout. A stale group's item is rebuilt from the batch: its prompt index (the group
index), prompt tokens and label.
"""

from __future__ import annotations

import logging
from typing import Any

from events.connection import Redis
from events.names import Keys
from events.train_data import TrainData
from executor.cursor import CursorStore
from lm.tokenizer import decode

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


class Requeuer:
    """Gives items back to a data-source cursor; they go out first in the next rollout."""

    def __init__(self, client: Redis, keys: Keys) -> None:
        self.keys = keys
        self.cursor = CursorStore(client, keys)

    def give_back(self, policy: str, source_name: str, items: list[Item]) -> int:
        if not items:
            return 0
        added = self.cursor.give_back(self.keys.data_cursor(policy, source_name), items)
        log.info("requeued %d stale prompt(s) of %s into %s", added, policy, source_name)
        return len(items)
