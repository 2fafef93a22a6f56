"""The served model's linear layers on oneDNN, each weight reordered once into oneDNN's blocked layout.

In float32 on a CPU, ``F.linear`` goes to MKL's sgemm. At decode shapes (a batch of 16 rows against
SmolLM2-135M's weights) on this machine's AMD EPYC that ran at about half the speed of oneDNN's
matmul on a weight packed beforehand (BENCHMARKS.md, "CPU engine near the machine's limit"), and the
linear layers are nearly all of a decode step. So every plain ``nn.Linear`` of the base model (big enough to pay
for a packed call's overhead: ``MIN_PACKED_ELEMENTS``) becomes a ``PackedLinear``: the same module (same parameters, names and ``state_dict``, still an
``nn.Linear`` for peft, which wraps it as the base layer of a LoRA layer), whose forward runs on the
packed copy when it can and on ``F.linear`` otherwise (autograd wanted, another device or dtype, or
weights changed since the pack).

The packed copies are extra memory, as much again as the packed weights (540 MB on SmolLM2-135M).
They are rebuilt after every change of the base weights (``repack``) and dropped when the weights are
released (``unpack``), so that releasing memory still frees it. The results differ from ``F.linear``'s
in float32 rounding only (another summation order).

The decode step (``engine.hf_decode``) uses the packs only where they win; its wide layers run
``linear_t``, the same oneDNN matmul with the operands swapped, on the plain weights, which
``fuse_rows`` stacks (q/k/v, gate/up) in place: the modules' weights become views of the stack.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Linear):
    _packed: Tensor | None = None
    _packed_from: int = 0  # data_ptr of the weight the pack was made from

    def forward(self, x: Tensor) -> Tensor:
        packed = self._packed
        if (packed is None or x.device.type != "cpu" or x.dtype != torch.float32
                or self.weight.data_ptr() != self._packed_from
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")

    def pack(self, rows_hint: int) -> None:
        weight = self.weight.detach()
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.numel() == 0:
            self.unpack()
            return
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
        self._packed_from = weight.data_ptr()

    def unpack(self) -> None:
        self._packed, self._packed_from = None, 0


MIN_PACKED_ELEMENTS = 1 << 17
"""Smaller weights stay on ``F.linear``: a packed call costs ~15 us more, which a 64 x 64 layer never
earns back (4.8 against 15.7 us at 16 rows); at 192 x 576 the two were even, at 576 x 576 and up the
packed one is faster (123 against 154 us; 1536 x 576 and the 49152-row lm_head up to 2x)."""


def pack_linears(model: nn.Module, rows_hint: int) -> int:
    """Turn every plain ``nn.Linear`` of ``model`` with at least ``MIN_PACKED_ELEMENTS`` weights into a
    ``PackedLinear`` and pack it; their number."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.numel() >= MIN_PACKED_ELEMENTS:
            module.__class__ = PackedLinear
        if isinstance(module, PackedLinear):
            module.pack(rows_hint)
            count += 1
    return count


def repack(model: nn.Module, rows_hint: int) -> None:
    for module in _packed(model):
        module.pack(rows_hint)


def unpack(model: nn.Module) -> None:
    for module in _packed(model):
        module.unpack()


def packed_bytes(model: nn.Module) -> int:
    return sum(m._packed.numel() * m._packed.element_size() for m in _packed(model) if m._packed is not None)


def _packed(model: nn.Module) -> list[Any]:
    return [m for m in model.modules() if isinstance(m, PackedLinear)]


# --- a decode step's linear layers: transposed, on the weights as they are --------------------------------

def linear_t(weight: Tensor, x: Tensor) -> Tensor:
    """``F.linear(x, weight).t()`` (``[out, rows]``) for a few rows ``x`` (``[rows, in]``, any strides), on
    oneDNN with the weight as the streamed operand and the rows as the small one.

    At decode shapes the packed call (``PackedLinear``) vectorises over the weight's rows and broadcasts
    the 16 activations, one load per multiply-add: on AVX2 the loads, not the FMA units, bound it. Swapped,
    the 16 rows are two vector registers reused across six weight rows at a time, so the same product runs
    20-35% faster on one thread (BENCHMARKS.md, "CPU engine near the machine's limit"), on the plain
    weight: no packed copy, nothing to redo after an update. The result is transposed; callers take it
    as it comes (a ``.t()`` view) or fold the transposition into their next operation."""
    return torch.ops.mkldnn._linear_pointwise(weight, x, None, "none", [], "")


def fuse_rows(linears: list[nn.Module]) -> Tensor | None:
    """One tensor holding the weights of ``linears`` stacked by output row (q, k, v; gate, up), whose
    weights become views of it: same values and parameters, no extra memory, updates copied into the
    views land in it. None (nothing changed) unless they are float32 CPU weights with one input width
    and every view starts on ``ALIGNMENT`` bytes."""
    weights = [_weight(m) for m in linears]
    first = weights[0]
    if (any(w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] != first.shape[1]
            or w.numel() == 0 for w in weights)
            or any(w.shape[1] * w.element_size() % ALIGNMENT for w in weights)):
        return None
    fused = torch.cat([w.detach() for w in weights])
    start = 0
    for weight in weights:
        rows = weight.shape[0]
        weight.data = fused[start:start + rows]
        start += rows
    return fused


def fused_intact(fused: Tensor, linears: list[nn.Module]) -> bool:
    """Every weight of ``linears`` still a view of ``fused``, where ``fuse_rows`` put it (a release, a
    resume or anything that replaced a weight's storage breaks this)."""
    base, start = fused.data_ptr(), 0
    for module in linears:
        weight = _weight(module)
        if weight.data_ptr() != base + start * fused.stride(0) * fused.element_size() or weight.shape[1] != fused.shape[1]:
            return False
        start += weight.shape[0]
    return start == fused.shape[0]


def _weight(module: nn.Module) -> Tensor:
    weight = module.weight
    assert isinstance(weight, Tensor)
    return weight


ALIGNMENT = 64
"""Bytes each fused view starts on (``engine.served.WEIGHT_ALIGNMENT``: unaligned weights round differently)."""
