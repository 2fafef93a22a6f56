"""The engine's in-place KV cache (``engine.hf_cache``) against transformers' own ``DynamicCache`` on a
small random Llama: the same logits step by step, through the batch operations the engine makes, and
no copy of the cache in a decode step that fits its room."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from rollout_bus.engine.hf_cache import MIN_SLACK_SLOTS, SlackCache, SlackLayer
from rollout_bus.lm import hf


def model() -> Any:
    return hf.random_llama(300, hidden_size=64, layers=2, heads=4, kv_heads=2, seed=0)


def run(lm: Any, cache: Any, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Prefill ``ids`` (left-padded by ``mask``) then ``steps`` greedy decode steps; the logits of each."""
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    out = []
    with torch.inference_mode():
        logits = lm(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                    use_cache=True).logits[:, -1]
        out.append(logits)
        nxt, pos = logits.argmax(-1, keepdim=True), positions[:, -1:] + 1
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            logits = lm(input_ids=nxt, attention_mask=mask, position_ids=pos, cache=cache,
                        use_cache=True).logits[:, -1]
            out.append(logits)
            nxt, pos = logits.argmax(-1, keepdim=True), pos + 1
    return out


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 300, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :4] = 0
    mask[2, :2] = 0
    return ids, mask


def test_decoding_through_the_room_and_past_it_gives_the_dynamic_caches_logits() -> None:
    lm = model()
    ids, mask = batch()
    steps = MIN_SLACK_SLOTS + 10  # past the first buffer's room: one regrowth on the way
    expected = run(lm, DynamicCache(), ids, mask, steps)
    got = run(lm, SlackCache(), ids, mask, steps)
    assert len(got) == len(expected) == steps + 1
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_a_decode_step_writes_into_the_buffer_it_already_has() -> None:
    lm = model()
    ids, mask = batch()
    cache = SlackCache()
    run(lm, cache, ids, mask, 2)
    layer = cache.layers[0]
    assert isinstance(layer, SlackLayer)
    before = layer.keys.untyped_storage().data_ptr()
    length = layer.keys.shape[-2]
    run_more = torch.randn(3, 2, 1, 16)
    with torch.inference_mode():  # as the engine's scheduler runs the model
        layer.update(run_more, run_more.clone())
    assert layer.keys.shape[-2] == length + 1
    assert layer.keys.untyped_storage().data_ptr() == before
    assert torch.equal(layer.keys[:, :, -1:], run_more)


def test_rows_dropped_and_slots_cut_from_the_left_start_a_new_buffer_with_the_same_contents() -> None:
    lm = model()
    ids, mask = batch()
    cache, reference = SlackCache(), DynamicCache()
    run(lm, cache, ids, mask, 3)
    run(lm, reference, ids, mask, 3)
    keep = torch.tensor([0, 2])
    for c in (cache, reference):
        c.batch_select_indices(keep)
        for layer in c.layers:
            layer.keys, layer.values = layer.keys[:, :, 2:], layer.values[:, :, 2:]
    slack = cache.layers[0]
    before = slack.keys.untyped_storage().data_ptr()
    step = torch.randn(2, 2, 1, 16)
    with torch.inference_mode():
        for c in (cache, reference):
            c.layers[0].update(step, step.clone())
    assert slack.keys.untyped_storage().data_ptr() != before
    assert torch.equal(slack.keys, reference.layers[0].keys)
    assert torch.equal(slack.values, reference.layers[0].values)
