"""The reference learner: GRPO with truncated importance sampling on ``lm.TinyLM``.

``to_padded`` turns a ``TrainData`` batch (ragged, wire layout) into right-padded
``(B, T)`` tensors aligned with ``lm.model.token_logprobs``: column ``t`` holds the
log-prob of token ``t + 1``, so response token ``j`` of a sample with a prompt of
``p`` tokens sits in column ``p + j - 1``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from rollout_bus.events.train_data import TrainData
from rollout_bus.lm.model import TinyLM, token_logprobs, token_logprobs_and_entropy
from rollout_bus.lm.tokenizer import PAD_ID
from rollout_bus.trainer.config import LossSettings, OptimConfig
from rollout_bus.trainer.finite import StepGuard
from rollout_bus.trainer.grpo import NO_SIGNAL_METRICS, LossConfig, grpo_loss, has_signal

log = logging.getLogger(__name__)


@dataclass
class Padded:
    input_ids: Tensor  # (B, T) long
    attention_mask: Tensor  # (B, T) long
    loss_mask: Tensor  # (B, T - 1) float: 1 on trained response tokens
    rollout_logp: Tensor  # (B, T - 1) float
    advantages: Tensor  # (B,)


def to_padded(data: TrainData) -> Padded:
    n = len(data)
    lengths = data.tokens.lengths
    width = int(lengths.max()) if n else 1
    ids = torch.full((n, width), PAD_ID, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, max(width - 1, 1)), dtype=torch.float32)
    rollout_logp = torch.zeros((n, max(width - 1, 1)), dtype=torch.float32)
    tok_off = data.tokens.offsets.tolist()
    resp_off = data.loss_masks.offsets.tolist()
    prompt_lengths = data.prompt_lengths.tolist()
    for i in range(n):
        length = tok_off[i + 1] - tok_off[i]
        ids[i, :length] = data.tokens.values[tok_off[i]:tok_off[i + 1]]
        attn[i, :length] = 1
        r0, r1 = resp_off[i], resp_off[i + 1]
        if r1 > r0:
            start = prompt_lengths[i] - 1
            loss_mask[i, start:start + r1 - r0] = data.loss_masks.values[r0:r1]
            rollout_logp[i, start:start + r1 - r0] = data.rollout_log_probs.values[r0:r1]
    return Padded(ids, attn, loss_mask, rollout_logp, data.rewards.to(torch.float32))


class Learner:
    """A model, its optimiser and the GRPO step."""

    def __init__(self, model: TinyLM, optim: OptimConfig, loss: LossSettings, temperature: float = 1.0) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 to recompute sampling log-probs, got {temperature!r}")
        self.model = model
        self.temperature = float(temperature)
        """The rollouts' sampling temperature: log-probs are ``log_softmax(logits / temperature)``, as the
        engine reports them."""
        self.optim_config = optim
        self.loss_config = LossConfig.of(loss)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2),
                                           weight_decay=optim.weight_decay)

    def train_step(self, data: TrainData) -> dict[str, float]:
        """One GRPO update on ``data`` (``epochs`` x ``minibatches`` optimiser steps).

        The metrics are means over the optimiser steps of ``grpo_loss``'s (loss terms, policy
        entropy on the response tokens, TIS and clip fractions), the last gradient norm, the
        response tokens trained and the wall time. A step with a non-finite loss, gradient or
        result is refused (``trainer.finite.NonFiniteStep``) and leaves model and optimiser as they were.
        A batch without signal (every advantage 0 on its trained tokens: ``grpo.has_signal``) takes no
        optimiser step at all (Adam's momentum would move the weights anyway): the metrics say
        ``skipped_no_signal`` 1 and the model and optimiser are untouched. A mini-batch whose every token
        ``mis`` masked has no gradient either and takes no optimiser step; when none of the batch's did,
        the step is reported as one without signal (``is_masked_frac`` 1).

        ``old_logp`` (``grpo_loss``'s) is the batch's log-probs under the weights before the first optimiser
        step, computed once under no_grad for every mini-batch and epoch: with ``decoupled`` it is AReaL's
        proximal policy, the previous weight version. That holds because the trainer publishes one version
        per ``train_step`` (``TrainerService._train``): the weights before this step are the version the
        engines were last given, however many optimiser steps the step then takes. With one optimiser step
        and ``tis`` or ``mis`` the training forward's own log-probs (detached) stand in for it.
        """
        started = time.perf_counter()
        batch = to_padded(data)
        if not has_signal(batch.advantages, batch.loss_mask, self.loss_config):
            return {**NO_SIGNAL_METRICS, "response_tokens": float(batch.loss_mask.sum()),
                    "train_ms": (time.perf_counter() - started) * 1000}
        guard = StepGuard(self.model.parameters(), self.optimizer)
        self.model.train()
        n = batch.input_ids.shape[0]
        single = self.optim_config.epochs == 1 and self.optim_config.minibatches == 1
        old_logp: Tensor | None = None
        if not single or self.loss_config.recomputes_proximal:
            with torch.no_grad():  # before any optimiser step: the previous version (see the docstring)
                old_logp = token_logprobs(self.model, batch.input_ids, batch.attention_mask, self.temperature)
        sums: dict[str, float] = {}
        updates = passes = 0
        grad_norm = 0.0
        for _ in range(self.optim_config.epochs):
            order = torch.randperm(n) if self.optim_config.minibatches > 1 else torch.arange(n)
            size = math.ceil(n / self.optim_config.minibatches)
            for start in range(0, n, size):
                idx = order[start:start + size]
                logp, entropy = token_logprobs_and_entropy(self.model, batch.input_ids[idx],
                                                           batch.attention_mask[idx], self.temperature)
                old = logp.detach() if old_logp is None else old_logp[idx]
                out = grpo_loss(logp, old, batch.rollout_logp[idx], batch.advantages[idx],
                                batch.loss_mask[idx], self.loss_config, entropy=entropy)
                passes += 1
                for k, v in out.metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                if not out.has_gradient:  # every token masked: no gradient, no optimiser step
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                out.loss.backward()
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                                 self.optim_config.grad_clip))
                guard.check_update(float(out.loss.detach()), grad_norm)
                self.optimizer.step()
                updates += 1
        guard.check_weights()
        metrics = {k: v / max(passes, 1) for k, v in sums.items()}
        metrics.update(grad_norm=grad_norm, optimizer_steps=float(updates), skipped_no_signal=float(updates == 0),
                       response_tokens=float(batch.loss_mask.sum()),
                       train_ms=(time.perf_counter() - started) * 1000)
        return metrics
