"""A Hugging Face KV cache that grows in place: each layer's keys and values are views of buffers with
room for more time slots, and a decode step writes its one new slot into that room.

``DynamicCache`` concatenates at every step: each layer's whole cache is copied once per token, so a
step's memory traffic grows with the sequence (a tenth of a decode step on SmolLM2-135M at batch 16,
32 tokens in). Here a layer copies only when it runs out of room (then it takes ``SLACK_FRACTION`` of
its length more, at least ``MIN_SLACK_SLOTS``), or when something outside replaced its tensors (rows
dropped with ``batch_select_indices``, padding slots cut off the left by ``HFBatch.keep``): the next
``update`` then starts a new buffer from them. ``keys`` and ``values`` stay what ``DynamicLayer``
exposes, ``[batch, heads, time, head_dim]``, so everything that reads them (attention, the prefix
cache, the batch's merge and trim) works unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

MIN_SLACK_SLOTS = 32
SLACK_FRACTION = 0.25


class SlackLayer(DynamicLayer):  # type: ignore[misc]
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._buffers: tuple[Tensor, Tensor] | None = None
        self._views: tuple[Tensor, Tensor] | None = None

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        new = key_states.shape[-2]
        mine = self._views is not None and self.keys is self._views[0] and self.values is self._views[1]
        if mine and self._buffers is not None and self.keys.shape[-2] + new <= self._buffers[0].shape[-2]:
            keys_buffer, values_buffer = self._buffers
            length = self.keys.shape[-2]
        else:
            keys_buffer, values_buffer, length = self._grow(key_states, value_states, new)
        keys_buffer[:, :, length:length + new].copy_(key_states)
        values_buffer[:, :, length:length + new].copy_(value_states)
        self.keys, self.values = keys_buffer[:, :, :length + new], values_buffer[:, :, :length + new]
        self._views = (self.keys, self.values)
        return self.keys, self.values

    def _grow(self, key_states: Tensor, value_states: Tensor, new: int) -> tuple[Tensor, Tensor, int]:
        """New buffers holding the current keys and values with room for ``new`` slots and the slack."""
        assert self.keys is not None and self.values is not None
        old_k = self.keys if self.keys.numel() else None
        old_v = self.values if self.values.numel() else None
        length = old_k.shape[-2] if old_k is not None else 0
        capacity = length + new + max(MIN_SLACK_SLOTS, int(SLACK_FRACTION * (length + new)))
        batch, heads, _, dim = key_states.shape
        keys = key_states.new_empty(batch, heads, capacity, dim)
        values = value_states.new_empty(batch, heads, capacity, value_states.shape[-1])
        if old_k is not None and old_v is not None:
            keys[:, :, :length].copy_(old_k)
            values[:, :, :length].copy_(old_v)
        self._buffers = (keys, values)
        return keys, values, length

    def reserved_bytes(self) -> int:
        """Bytes held, the room to grow included."""
        if self._buffers is not None and self._views is not None and self.keys is self._views[0]:
            return sum(t.numel() * t.element_size() for t in self._buffers)
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)


class SlackCache(DynamicCache):  # type: ignore[misc]
    """``DynamicCache`` made of ``SlackLayer``s (optionally filled with ``ddp_cache_data``, as ``DynamicCache``)."""

    def __init__(self, ddp_cache_data: Iterable[tuple[Tensor, Tensor]] | None = None) -> None:
        layers: list[Any] = []
        for keys, values in ddp_cache_data or ():
            layer = SlackLayer()
            layer.update(keys, values)
            layers.append(layer)
        if layers:
            Cache.__init__(self, layers=layers)
        else:
            Cache.__init__(self, layer_class_to_replicate=SlackLayer)


def reserved_bytes(cache: Any) -> int:
    return sum(layer.reserved_bytes() if isinstance(layer, SlackLayer) else
               sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None)
               for layer in cache.layers)

