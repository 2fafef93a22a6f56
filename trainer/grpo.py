"""The GRPO loss with off-policy correction from the rollout log-probs.

Per response token the loss is ``-w * min(r * A, clip(r, 1 - eps, 1 + eps) * A)`` with
``r = exp(logp - old_logp)`` and an importance weight ``w`` from the ratio
``rho = exp(old_logp - rollout_logp)``: the behaviour policy is whatever engine version
produced the token (``rollout_logp``, the engine's own log-probs), ``old_logp`` the
trainer's policy before the step's first optimiser step. With one optimiser step per batch
``r`` is 1 with gradient ``grad logp``; with several mini-batches or epochs the PPO clip
bounds how far the policy moves. ``LossConfig.off_policy`` picks ``w`` (``C`` is ``tis_cap``):

- ``tis``: truncated importance sampling, ``w = min(rho, C)`` (``C`` 0: ``w = 1``, no correction);
- ``mis``: masked importance sampling, ``w = rho`` where ``1/C <= rho <= C`` and 0 elsewhere;
  ``is_masked_frac`` is the share of response tokens masked;
- ``decoupled``: AReaL's decoupled PPO objective: ``old_logp`` is the proximal policy (the
  previous weight version, recomputed by the learner at train time), the clip is taken against
  it and ``w = min(pi_prox / pi_behav, C)``. The formula is ``tis``'s; what makes it decoupled is
  where ``old_logp`` comes from (the learners: always recomputed once under no_grad before the
  first optimiser step, for the whole batch). AReaL's own ``behav_imp_weight_cap`` drops the
  tokens above the cap instead of truncating them (``mis``, upper side only).

A ratio exactly at a bound is inside it: kept by ``mis``, not counted as truncated by ``tis``.
The comparison is made in log space (``log rho`` against ``+-log C``, in the log-probs' dtype), so a
ratio whose log is ``log C`` as that dtype writes it is at the bound, whatever ``exp`` rounds it to.

Given the per-token entropy of the policy, the loss has a second term, the entropy bonus
``-entropy_coef * mean(H)`` (0 with the default coefficient); ``metrics`` reports both
terms, their sum, the mean entropy and the TIS and clip fractions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rollout_bus.trainer.config import LossSettings


@dataclass
class LossConfig:
    tis_cap: float = 2.0
    """C: the cap of the truncated importance weight (0 disables the correction), or the band ``[1/C, C]`` of
    ``mis``."""
    ppo_clip: float | None = 0.2
    """epsilon of the PPO clip; None for the plain surrogate."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (needs the per-token entropy); 0 leaves the loss the PG term alone."""
    off_policy: str = "tis"
    """The off-policy correction: ``tis``, ``mis`` or ``decoupled`` (see the module's docstring)."""

    @classmethod
    def of(cls, settings: LossSettings) -> LossConfig:
        """The loss of a trainer's ``LossSettings``."""
        return cls(tis_cap=settings.tis_cap, ppo_clip=settings.ppo_clip, entropy_coef=settings.entropy_coef,
                   off_policy=settings.off_policy)

    @property
    def recomputes_proximal(self) -> bool:
        """Whether a learner must recompute ``old_logp`` before the step even for one optimiser step."""
        return self.off_policy == "decoupled"


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
    "is_weight_mean": float("nan"), "is_truncated_frac": float("nan"), "is_masked_frac": float("nan"),
    "rollout_kl": float("nan"),
    "entropy": float("nan"), "optimizer_steps": 0.0, "skipped_no_signal": 1.0,
}
"""A learner's metrics for a batch without signal (``has_signal`` False): the loss is exactly 0, no
optimiser step is taken, and what only a forward pass would tell (entropy, importance weights) is unknown."""


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]
    has_gradient: bool = True
    """False when no trained token has a weight (``mis`` masked them all) and there is no entropy bonus: the
    loss is 0 and so is its gradient, and a learner takes no optimiser step for it (Adam's momentum would move
    the weights anyway, as for a batch without signal)."""


def importance_weights(log_is: torch.Tensor, config: LossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w, truncated, masked)`` for the log importance ratios ``log_is`` (no gradient): the weight of each
    token under ``config.off_policy``, and where the weight was truncated or masked (bool)."""
    none = torch.zeros_like(log_is, dtype=torch.bool)
    cap = config.tis_cap
    if config.off_policy == "mis":
        bound = math.log(cap)
        keep = (log_is <= bound) & (log_is >= -bound)
        return torch.where(keep, torch.exp(log_is), torch.zeros_like(log_is)), none, ~keep
    if cap <= 0:  # tis with the correction off
        return torch.ones_like(log_is), none, none
    return torch.exp(log_is).clamp(max=cap), log_is > math.log(cap), none


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
    is_weight, truncated, masked = importance_weights(log_is, config)
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
            "is_truncated_frac": float((truncated.to(logp.dtype) * mask).sum() / n_tokens),
            "is_masked_frac": float((masked.to(logp.dtype) * mask).sum() / n_tokens),
            "ppo_clipped_frac": float(clipped_frac),
            "rollout_kl": float(((rollout_logp - old_logp).detach() * mask).sum() / n_tokens),
        }
        if mean_entropy is not None:
            metrics["entropy"] = float(mean_entropy.detach())
        weighted = bool(((is_weight != 0) & (mask > 0)).any())
    return LossOutput(loss, metrics, has_gradient=weighted or bool(config.entropy_coef))
