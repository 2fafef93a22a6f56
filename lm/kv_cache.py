"""Per-layer keys and values of already-seen tokens, so that decoding feeds one token per step.

A cache holds a batch, left-padded: ``mask[b, t]`` is True where row ``b`` has a real token at
slot ``t``. ``stack`` and ``split`` let a scheduler keep one cache per sequence and regroup them
into a batch at every step, which is what continuous batching needs when sequences come and go.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class KVCache:
    keys: list[Tensor]  # per layer, [batch, heads, time, head_dim]
    values: list[Tensor]  # per layer, same shape as keys
    mask: Tensor  # [batch, time], bool

    @property
    def batch_size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def token_counts(self) -> Tensor:
        """Real tokens per row, which is also the position of each row's next token."""
        return self.mask.sum(dim=1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @classmethod
    def empty(cls) -> KVCache:
        """A cache with no layers yet: ``TinyLM.forward(..., cache=KVCache.empty())`` fills it."""
        return cls([], [], torch.zeros(0, 0, dtype=torch.bool))

    @property
    def filled(self) -> bool:
        return bool(self.keys)

    def assign(self, other: KVCache) -> None:
        """Take ``other``'s contents (caches are grown in place by ``TinyLM.forward``)."""
        self.keys, self.values, self.mask = other.keys, other.values, other.mask

    def select(self, rows: Tensor) -> KVCache:
        """The given rows (a 1-D index tensor), with slots that are padding in every row dropped."""
        mask = self.mask.index_select(0, rows)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else mask.shape[1]
        return KVCache(
            keys=[k.index_select(0, rows)[:, :, start:] for k in self.keys],
            values=[v.index_select(0, rows)[:, :, start:] for v in self.values],
            mask=mask[:, start:],
        )

    @classmethod
    def stack(cls, caches: Sequence[KVCache]) -> KVCache:
        """One batch from several caches, each left-padded to the longest."""
        if not caches:
            raise ValueError("cannot stack an empty list of caches")
        length = max(c.length for c in caches)
        n_layers = len(caches[0].keys)
        keys = [torch.cat([_left_pad(c.keys[i], length) for c in caches]) for i in range(n_layers)]
        values = [torch.cat([_left_pad(c.values[i], length) for c in caches]) for i in range(n_layers)]
        mask = torch.cat([F.pad(c.mask, (length - c.length, 0), value=False) for c in caches])
        return cls(keys, values, mask)

    def split(self) -> list[KVCache]:
        """One cache per row, with that row's padding slots dropped."""
        rows: list[KVCache] = []
        for b in range(self.batch_size):
            slots = self.mask[b].nonzero().squeeze(1)
            rows.append(
                KVCache(
                    keys=[k[b : b + 1].index_select(2, slots) for k in self.keys],
                    values=[v[b : b + 1].index_select(2, slots) for v in self.values],
                    mask=self.mask[b : b + 1].index_select(1, slots),
                )
            )
        return rows


def _left_pad(t: Tensor, length: int) -> Tensor:
    return F.pad(t, (0, 0, length - t.shape[2], 0))
