"""The GRPO loss with off-policy correction from the rollout log-probs.

Per response token: ``w = min(exp(old_logp - rollout_logp), C)`` (truncated importance
sampling: the behaviour policy is whatever engine version produced the token, the
trainer's policy at the start of the step is ``old_logp``), times the policy-gradient
surrogate ``r * A`` with ``r = exp(logp - old_logp)``, optionally PPO-clipped. With one
optimiser step per batch ``r`` is 1 with gradient ``grad logp``; with several
mini-batches or epochs the PPO clip bounds how far the policy moves.

Given the per-token entropy of the policy, the loss has a second term, the entropy bonus
``-entropy_coef * mean(H)`` (0 with the default coefficient); ``metrics`` reports both
terms, their sum, the mean entropy and the TIS and clip fractions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossConfig:
    tis_cap: float = 2.0
    """C: the cap of the truncated importance weight (0 disables the correction)."""
    ppo_clip: float | None = 0.2
    """epsilon of the PPO clip; None for the plain surrogate."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (needs the per-token entropy); 0 leaves the loss the PG term alone."""


def has_signal(advantages: torch.Tensor, mask: torch.Tensor, config: LossConfig) -> bool:
    """Whether a GRPO step on these samples would move the policy at all.

    Every term of the policy-gradient loss is ``-w * r * A``: with every advantage 0 on the trained
    tokens (every group all right or all wrong) the loss is 0 and so is its gradient, but an
    optimiser with momentum (Adam) would still move the weights along its running averages. Only
    an entropy bonus (``entropy_coef``) gives such a batch a gradient of its own.
    """
    if config.entropy_coef:
        return bool(mask.sum() > 0)
    trained = mask.reshape(mask.shape[0], -1).sum(dim=1) > 0 if mask.numel() else torch.zeros(0, dtype=torch.bool)
    return bool((advantages[trained] != 0).any())


NO_SIGNAL_METRICS: dict[str, float] = {
    "loss": 0.0, "pg_loss": 0.0, "entropy_loss": 0.0, "grad_norm": 0.0, "ppo_clipped_frac": 0.0,
    "is_weight_mean": float("nan"), "is_truncated_frac": float("nan"), "rollout_kl": float("nan"),
    "entropy": float("nan"), "optimizer_steps": 0.0, "skipped_no_signal": 1.0,
}
"""A learner's metrics for a batch without signal (``has_signal`` False): the loss is exactly 0, no
optimiser step is taken, and what only a forward pass would tell (entropy, importance weights) is unknown."""


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, rollout_logp: torch.Tensor,
              advantages: torch.Tensor, mask: torch.Tensor, config: LossConfig,
              entropy: torch.Tensor | None = None) -> LossOutput:
    """Token-mean GRPO loss over the masked response tokens.

    ``logp``, ``old_logp``, ``rollout_logp``, ``mask`` and ``entropy`` (the policy's entropy
    at each token, optional) are ``(B, T)``; ``advantages`` is ``(B,)`` (one per sample,
    broadcast over its tokens).
    """
    mask = mask.to(logp.dtype)
    n_tokens = mask.sum().clamp(min=1.0)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    log_is = (old_logp - rollout_logp).detach()
    is_weight = torch.exp(log_is).clamp(max=config.tis_cap) if config.tis_cap > 0 else torch.ones_like(log_is)
    ratio = torch.exp(logp - old_logp.detach())
    surr = ratio * adv
    clipped_frac = torch.zeros((), dtype=logp.dtype)
    if config.ppo_clip is not None:
        eps = config.ppo_clip
        surr_clipped = torch.clamp(ratio, 1.0 - eps, 1.0 + eps) * adv
        clipped_frac = ((surr_clipped < surr).to(logp.dtype) * mask).sum() / n_tokens
        surr = torch.minimum(surr, surr_clipped)
    per_token = -(is_weight * surr)
    pg_loss = (per_token * mask).sum() / n_tokens
    mean_entropy = (entropy * mask).sum() / n_tokens if entropy is not None else None
    entropy_loss = torch.zeros((), dtype=logp.dtype)
    if config.entropy_coef:
        if mean_entropy is None:
            raise ValueError("entropy_coef is set: grpo_loss needs the per-token entropy")
        entropy_loss = -config.entropy_coef * mean_entropy
    loss = pg_loss + entropy_loss
    with torch.no_grad():
        raw_is = torch.exp(log_is)
        metrics = {
            "loss": float(loss.detach()),
            "pg_loss": float(pg_loss.detach()),
            "entropy_loss": float(entropy_loss.detach()),
            "is_weight_mean": float((raw_is * mask).sum() / n_tokens),
            "is_truncated_frac": float(((raw_is > config.tis_cap).to(logp.dtype) * mask).sum() / n_tokens)
            if config.tis_cap > 0 else 0.0,
            "ppo_clipped_frac": float(clipped_frac),
            "rollout_kl": float(((rollout_logp - old_logp).detach() * mask).sum() / n_tokens),
        }
        if mean_entropy is not None:
            metrics["entropy"] = float(mean_entropy.detach())
    return LossOutput(loss, metrics)
