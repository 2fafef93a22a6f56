"""Refusing a training step that would leave non-finite weights.

One non-finite loss or gradient, applied, turns every parameter into NaN, and a checkpoint or a
published version then carries them for good. ``StepGuard`` makes a learner's step all or
nothing: it keeps a copy of the trainable parameters and the optimiser state (on the CPU) when
the step begins; ``check_update`` refuses an optimiser update whose loss or gradient norm is
not finite before it is applied, ``check_weights`` refuses a step that left a non-finite
parameter, and either way the copy is put back and ``NonFiniteStep`` raised, so the model and
its optimiser are exactly as they were before the step. The copy costs one host-memory copy of
what trains (a LoRA adapter's weights alone), less than the weights file and checkpoint a
trainer writes after every step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from rollout_bus.events.errors import Failure


class NonFiniteStep(Failure):
    """A training step was refused: its loss, gradient or resulting weights are not finite."""


def nonfinite_parameters(params: Iterable[torch.Tensor]) -> int:
    """How many of ``params`` hold a NaN or an infinity."""
    return sum(1 for p in params if not bool(torch.isfinite(p.detach()).all()))


class StepGuard:
    """A learner's step, all or nothing (see the module docstring)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        self._weights = [p.detach().to("cpu", copy=True) for p in self.params]
        self._optim: dict[str, Any] = _to_cpu(optimizer.state_dict())

    def check_update(self, loss: float, grad_norm: float) -> None:
        """Before ``optimizer.step()``: refuse an update from a non-finite loss or gradient."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.refuse(f"loss {loss!r}, gradient norm {grad_norm!r}")

    def check_weights(self) -> None:
        """After the step's last update: refuse weights that are not all finite."""
        bad = nonfinite_parameters(self.params)
        if bad:
            self.refuse(f"{bad} parameter tensor(s) not finite after the update")

    def refuse(self, why: str) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, saved in zip(self.params, self._weights, strict=True):
                p.copy_(saved.to(p.device))
        self.optimizer.load_state_dict(self._optim)  # moves the state back to each parameter's device
        raise NonFiniteStep(f"training step refused, weights left as they were: {why}")


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
