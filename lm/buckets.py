"""The bucket plan of a weights broadcast: which tensors travel together, in which order (no torch here).

A plan is a list of buckets, each a list of tensor names; the sender broadcasts the tensors in that
order, one ``/update_weights_from_distributed`` call per bucket on the receivers. Names are taken in
sorted order and a bucket closes once it holds ``bucket_bytes`` (a tensor larger than that travels
alone), so the sender and the receivers agree on the order from the plan alone.
"""

from __future__ import annotations

from collections import Counter
from math import prod

from rollout_bus.lm.files import Shapes

ELEMENT_BYTES: dict[str, int] = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E5M2": 1, "F8_E4M3": 1, "I64": 8,
                                 "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
"""Bytes per element of each safetensors dtype."""

TORCH_DTYPE_NAMES: dict[str, str] = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                                     "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn", "I64": "int64",
                                     "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
"""safetensors dtype -> the torch dtype's name, as SGLang's ``dtypes`` field takes it (``getattr(torch, name)``)."""

DEFAULT_BUCKET_BYTES = 64 << 20


def tensor_bytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    return ELEMENT_BYTES.get(dtype, 4) * prod(shape)


def bucket_plan(shapes: Shapes, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[str]]:
    """Every tensor of ``shapes`` in buckets of at most ``bucket_bytes`` (one larger tensor alone)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    plan: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name in sorted(shapes):
        nbytes = tensor_bytes(*shapes[name])
        if current and size + nbytes > bucket_bytes:
            plan.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        plan.append(current)
    return plan


def plan_problems(plan: list[list[str]], shapes: Shapes) -> list[str]:
    """How ``plan`` fails to send every tensor of ``shapes`` exactly once (none when it does)."""
    named = [name for bucket in plan for name in bucket]
    problems = []
    if any(not bucket for bucket in plan):
        problems.append("a bucket is empty")
    twice = sorted(n for n, count in Counter(named).items() if count > 1)
    if twice:
        problems.append(f"tensors listed twice: {twice[:4]}")
    missing, unknown = sorted(set(shapes) - set(named)), sorted(set(named) - set(shapes))
    if missing:
        problems.append(f"tensors left out: {missing[:4]}")
    if unknown:
        problems.append(f"tensors not in the version: {unknown[:4]}")
    return problems
