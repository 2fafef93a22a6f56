"""The served HF model's linear layers on oneDNN with packed weights (``engine.hf_packed``): the logits
of ``transformers`` itself to float32 rounding, through a weight update, a release and a resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout_bus.engine import hf_packed
from rollout_bus.engine.hf_model import HFServed
from rollout_bus.engine.served import LoraLimits, WeightUpdate
from rollout_bus.lm import hf
from tests.support.models import llama_dir

pytestmark = pytest.mark.skipif(not hf_packed.available(), reason="this torch has no oneDNN")

IDS = torch.tensor([[1, 40, 41, 42, 43, 44]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=IDS).logits


WIDE = {"hidden_size": 512, "heads": 8, "kv_heads": 4}
"""Every linear layer at least ``MIN_PACKED_ELEMENTS`` (k and v: 256 x 512)."""


def served(path: Path) -> HFServed:
    return HFServed(str(path), torch.device("cpu"), "0", LoraLimits(), tokenizer=False)


def test_every_linear_layer_runs_packed_and_gives_the_logits_of_transformers(tmp_path: Path) -> None:
    path = llama_dir(tmp_path / "m", seed=0, **WIDE)
    model = served(path)
    linears = [m for m in model.base.modules() if isinstance(m, torch.nn.Linear)]
    assert min(m.weight.numel() for m in linears) >= hf_packed.MIN_PACKED_ELEMENTS
    assert all(isinstance(m, hf_packed.PackedLinear) and m._packed is not None for m in linears)
    expected = logits(hf.load_model(path))
    torch.testing.assert_close(logits(model.base), expected, atol=1e-5, rtol=1e-5)
    head = model.base.get_output_embeddings()
    head._packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros_like(head.weight), 16)
    assert torch.equal(logits(model.base), torch.zeros_like(expected))  # the forward read the pack


def test_packs_follow_a_weight_update_and_are_freed_with_a_release(tmp_path: Path) -> None:
    first, second = llama_dir(tmp_path / "a", seed=0, **WIDE), llama_dir(tmp_path / "b", seed=1, **WIDE)
    model = served(first)
    before = hf_packed.packed_bytes(model.base)
    assert before > 0
    model.apply_update(WeightUpdate(model.read_update(str(second)), "1", str(second)))
    torch.testing.assert_close(logits(model.base), logits(hf.load_model(second)), atol=1e-5, rtol=1e-5)
    model.release()
    assert hf_packed.packed_bytes(model.base) == 0
    model.resume()
    assert hf_packed.packed_bytes(model.base) == before
    torch.testing.assert_close(logits(model.base), logits(hf.load_model(second)), atol=1e-5, rtol=1e-5)


def test_small_layers_stay_on_f_linear(tmp_path: Path) -> None:
    model = served(llama_dir(tmp_path / "m", seed=0))  # hidden 64: every weight under the threshold
    assert not any(isinstance(m, hf_packed.PackedLinear) for m in model.base.modules())
    assert hf_packed.packed_bytes(model.base) == 0
