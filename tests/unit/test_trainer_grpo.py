"""The GRPO loss: truncated importance weights, the PPO clip, and the direction of the gradient."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_bus.trainer.grpo import LossConfig, grpo_loss


def test_on_policy_loss_is_minus_the_token_mean_advantage() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.5]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    out = grpo_loss(logp, logp, logp, torch.tensor([1.0, -2.0]), mask, LossConfig())
    assert math.isclose(float(out.loss), -(1.0 + 1.0 - 2.0) / 3, abs_tol=1e-6)
    assert out.metrics["is_weight_mean"] == 1.0 and out.metrics["is_truncated_frac"] == 0.0


def test_importance_weights_are_truncated_at_the_cap() -> None:
    old = torch.log(torch.tensor([[0.9, 0.5]]))
    rollout = torch.log(torch.tensor([[0.1, 0.5]]))  # token 0: ratio 9 -> capped at 2
    out = grpo_loss(old, old, rollout, torch.tensor([1.0]), torch.ones(1, 2), LossConfig(tis_cap=2.0))
    assert math.isclose(float(out.loss), -(2.0 + 1.0) / 2, rel_tol=1e-5)
    assert out.metrics["is_truncated_frac"] == 0.5
    uncapped = grpo_loss(old, old, rollout, torch.tensor([1.0]), torch.ones(1, 2), LossConfig(tis_cap=0.0))
    assert math.isclose(float(uncapped.loss), -1.0, rel_tol=1e-6)  # 0 turns the correction off


def test_the_gradient_raises_the_log_prob_of_positive_advantage_tokens() -> None:
    logits = torch.zeros(2, 3, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[:, :1]
    out = grpo_loss(logp, logp.detach(), logp.detach(), torch.tensor([1.0, -1.0]), torch.ones(2, 1), LossConfig())
    out.loss.backward()
    assert logits.grad is not None
    assert logits.grad[0, 0] < 0 < logits.grad[1, 0]  # descent raises row 0's token, lowers row 1's


def test_the_ppo_clip_stops_the_gradient_beyond_the_trust_region() -> None:
    logp = torch.log(torch.tensor([[0.9]])).requires_grad_()
    old = torch.log(torch.tensor([[0.5]]))  # ratio 1.8 > 1 + 0.2
    out = grpo_loss(logp, old, old, torch.tensor([1.0]), torch.ones(1, 1), LossConfig(ppo_clip=0.2))
    out.loss.backward()
    assert logp.grad is not None and float(logp.grad.abs().sum()) == 0.0
    assert out.metrics["ppo_clipped_frac"] == 1.0


def test_the_entropy_term_is_minus_the_coefficient_times_the_mean_entropy_and_raises_the_entropy() -> None:
    logits = torch.tensor([[2.0, 0.0, -1.0]], requires_grad=True)
    log_probs = torch.log_softmax(logits, -1)
    logp = log_probs[:, :1]
    entropy = -(log_probs.exp() * log_probs).sum(-1, keepdim=True)
    plain = grpo_loss(logp, logp.detach(), logp.detach(), torch.tensor([0.0]), torch.ones(1, 1), LossConfig(),
                      entropy=entropy)
    assert plain.metrics["entropy_loss"] == 0.0 and plain.metrics["loss"] == plain.metrics["pg_loss"]
    assert math.isclose(plain.metrics["entropy"], float(entropy.detach()), rel_tol=1e-6)
    out = grpo_loss(logp, logp.detach(), logp.detach(), torch.tensor([0.0]), torch.ones(1, 1),
                    LossConfig(entropy_coef=0.1), entropy=entropy)
    assert math.isclose(out.metrics["entropy_loss"], -0.1 * float(entropy.detach()), rel_tol=1e-6)
    assert math.isclose(out.metrics["loss"], out.metrics["pg_loss"] + out.metrics["entropy_loss"], rel_tol=1e-6)
    out.loss.backward()
    assert logits.grad is not None
    assert logits.grad[0, 0] > 0  # descent lowers the top logit: a flatter, higher-entropy distribution
    with pytest.raises(ValueError, match="needs the per-token entropy"):
        grpo_loss(logp, logp.detach(), logp.detach(), torch.tensor([0.0]), torch.ones(1, 1),
                  LossConfig(entropy_coef=0.1))
