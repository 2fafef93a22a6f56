"""The engine's own Llama decode step (``engine.hf_decode``) against ``LlamaForCausalLM.forward``: the
same logits, step after step, on a left-padded batch, and the same cache contents."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from rollout_bus.engine.hf_cache import SlackCache
from rollout_bus.engine.hf_decode import LlamaDecodeStep
from rollout_bus.lm import hf


def test_decode_steps_give_the_logits_of_the_models_own_forward() -> None:
    lm = hf.random_llama(300, hidden_size=64, layers=3, heads=4, kv_heads=2, seed=0)
    step = LlamaDecodeStep.build(lm)
    assert step is not None
    ids = torch.randint(3, 300, (3, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :3] = 0
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    mine, theirs = SlackCache(), DynamicCache()
    with torch.inference_mode():
        for cache in (mine, theirs):
            lm(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        nxt, pos = torch.tensor([5, 6, 7]), positions[:, -1] + 1
        for _ in range(5):
            mask = torch.cat([mask, mask.new_ones(3, 1)], dim=1)
            got = step(nxt, pos, mask, mine)
            expected = lm(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos[:, None], cache=theirs,
                          use_cache=True).logits[:, -1]
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            nxt, pos = expected.argmax(-1), pos + 1
    for a, b in zip(mine.layers, theirs.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)


def test_a_model_that_is_not_a_plain_llama_is_left_to_transformers() -> None:
    lm = hf.random_llama(300, hidden_size=64, layers=1, heads=4, kv_heads=2, seed=0)
    lm.config.mlp_bias = True
    assert LlamaDecodeStep.build(lm) is None
