"""The engine's fused decode step (``engine.hf_decode`` on ``engine.hf_packed``'s stacked, transposed linear
layers) against ``LlamaForCausalLM.forward``: the same logits step after step on a left-padded batch, on one
thread and on two (where the narrow layers run packed), and still after a weight update, a release and a
resume. The stacked weights are the modules' own storage (views), so they cost no memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from rollout_bus.engine import hf_packed
from rollout_bus.engine.hf_cache import SlackCache
from rollout_bus.engine.hf_decode import LlamaDecodeStep
from rollout_bus.engine.hf_model import HFServed
from rollout_bus.engine.served import LoraLimits, WeightUpdate
from rollout_bus.lm import hf
from tests.support.models import llama_dir

pytestmark = pytest.mark.skipif(not hf_packed.available(), reason="this torch has no oneDNN")

WIDE = {"hidden_size": 512, "heads": 8, "kv_heads": 4, "layers": 2}


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def steps_match(lm: torch.nn.Module, step: LlamaDecodeStep, count: int = 5) -> None:
    """Prefill a left-padded batch through transformers on two caches, then ``count`` decode steps: ``step``
    on one, the model's own forward on the other; logits and caches agree to float32 rounding."""
    ids = torch.randint(3, 200, (3, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :1] = 0
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    mine, theirs = SlackCache(), DynamicCache()
    with torch.inference_mode():
        for cache in (mine, theirs):
            lm(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        nxt, pos = torch.tensor([5, 6, 7]), positions[:, -1] + 1
        for _ in range(count):
            mask = torch.cat([mask, mask.new_ones(3, 1)], dim=1)
            got = step(nxt, pos, mask, mine)
            expected = lm(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos[:, None], cache=theirs,
                          use_cache=True).logits[:, -1]
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            assert got.is_contiguous()
            nxt, pos = expected.argmax(-1), pos + 1
    for a, b in zip(mine.layers, theirs.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)


def test_the_fused_step_gives_the_logits_of_the_models_own_forward(threads: int) -> None:
    lm = hf.random_llama(300, seed=0, **WIDE)
    before = {name: t.clone() for name, t in lm.state_dict().items()}
    step = LlamaDecodeStep.build(lm, fused=True)
    assert step is not None and step.fused is not None
    for name, tensor in lm.state_dict().items():  # stacking moved the weights, changed none
        assert torch.equal(tensor, before[name]), name
    layer = lm.model.layers[0]
    qkv, gate_up = step.fused[0]
    assert layer.self_attn.k_proj.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()
    steps_match(lm, step)


def test_a_weight_replaced_by_storage_of_its_own_sends_the_step_back_to_the_plain_path() -> None:
    lm = hf.random_llama(300, seed=0, **WIDE)
    step = LlamaDecodeStep.build(lm, fused=True)
    assert step is not None and step.fused is not None
    proj = lm.model.layers[1].mlp.gate_proj
    proj.weight.data = proj.weight.detach().clone()
    assert not step._intact()
    steps_match(lm, step, count=2)  # the plain step, on the modules as they are
    step.refresh()
    assert step.fused is not None and step._intact()
    steps_match(lm, step, count=2)


def served(path: Path) -> HFServed:
    return HFServed(str(path), torch.device("cpu"), "0", LoraLimits(), tokenizer=False)


def test_the_served_models_step_follows_an_update_a_release_and_a_resume(tmp_path: Path) -> None:
    first, second = llama_dir(tmp_path / "a", seed=0, **WIDE), llama_dir(tmp_path / "b", seed=1, **WIDE)
    model = served(first)
    step = model.decode_step
    assert step is not None and step.fused is not None
    steps_match(hf.load_model(first), step, count=2)
    model.apply_update(WeightUpdate(model.read_update(str(second)), "1", str(second)))
    assert step._intact()  # copied into the views: the stacked weights are the new ones
    reference = hf.load_model(second)
    steps_match_on(model, reference)
    model.release()
    assert step.fused is None
    assert all(p.numel() == 0 for p in model.base.parameters())
    model.resume()
    assert step.fused is not None and step._intact()
    steps_match_on(model, reference)


def steps_match_on(model: HFServed, reference: torch.nn.Module) -> None:
    """The served model's step against ``reference``'s forward (the served model's own forward, packed,
    prefills both caches: so load ``reference``'s weights' logits through it)."""
    step = model.decode_step
    assert step is not None
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    mask = torch.ones_like(ids)
    mine, theirs = SlackCache(), DynamicCache()
    with torch.inference_mode():
        model.base(input_ids=ids, attention_mask=mask, cache=mine, use_cache=True)
        reference(input_ids=ids, attention_mask=mask, cache=theirs, use_cache=True)
        mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)
        got = step(torch.tensor([7]), torch.tensor([5]), mask, mine)
        expected = reference(input_ids=torch.tensor([[7]]), attention_mask=mask, position_ids=torch.tensor([[5]]),
                             cache=theirs, use_cache=True).logits[:, -1]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_plain_mode_stacks_nothing() -> None:
    lm = hf.random_llama(300, seed=0, **WIDE)
    step = LlamaDecodeStep.build(lm)
    assert step is not None and step.fused is None
    pointers = {n: p.data_ptr() for n, p in lm.named_parameters()}
    steps_match(lm, step, count=2)
    assert pointers == {n: p.data_ptr() for n, p in lm.named_parameters()}


def prefill_both(lm: torch.nn.Module, step: LlamaDecodeStep, ids: torch.Tensor, mask: torch.Tensor,
                 positions: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
    """``step.prefill`` and the model's forward (``logits_to_keep=1``) on the same rows: the same last
    logits, and the same keys and values in every slot the mask lets attention see."""
    mine = SlackCache(ddp_cache_data=past) if past else SlackCache()
    theirs = DynamicCache(ddp_cache_data=past) if past else DynamicCache()
    with torch.inference_mode():
        got = step.prefill(ids, positions, mask, mine)
        expected = lm(input_ids=ids, attention_mask=mask, position_ids=positions, cache=theirs, use_cache=True,
                      logits_to_keep=1).logits[:, -1]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    seen = mask.bool()
    for a, b in zip(mine.layers, theirs.layers, strict=True):
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert x.shape == y.shape
            torch.testing.assert_close(x.transpose(1, 2)[seen], y.transpose(1, 2)[seen], atol=1e-5, rtol=1e-5)


def test_the_prefill_on_real_tokens_only_gives_the_logits_and_cache_of_the_models_forward(threads: int) -> None:
    lm = hf.random_llama(300, seed=0, **WIDE)
    step = LlamaDecodeStep.build(lm, fused=True)
    assert step is not None
    ids = torch.randint(3, 200, (3, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :5] = 0
    mask[2, :2] = 0
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    prefill_both(lm, step, ids, mask, positions, None)


def test_the_prefill_after_cached_prefixes_with_holes_matches_too() -> None:
    """Rows ``[padding, prefix, padding, new tokens]``, as ``HFBatch.prefill`` builds them after the prefix cache."""
    lm = hf.random_llama(300, seed=0, **WIDE)
    step = LlamaDecodeStep.build(lm, fused=True)
    assert step is not None
    generator = torch.Generator().manual_seed(5)
    kv_heads, dim, layers = WIDE["kv_heads"], WIDE["hidden_size"] // WIDE["heads"], WIDE["layers"]
    past = [(torch.randn(3, kv_heads, 4, dim, generator=generator), torch.randn(3, kv_heads, 4, dim, generator=generator))
            for _ in range(layers)]
    past_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]])
    new_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])
    ids = torch.randint(3, 200, (3, 3), generator=generator)
    positions = (past_mask.sum(dim=1, keepdim=True) + new_mask.cumsum(dim=1) - 1).clamp(min=0)
    prefill_both(lm, step, ids, torch.cat([past_mask, new_mask], dim=1), positions, past)
