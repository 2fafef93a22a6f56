"""The learner: ragged batches to aligned padded tensors, and a GRPO step that moves the policy."""

from __future__ import annotations

import random

import torch

from rollout_bus.lm.model import ModelConfig, build_model, pad_batch, token_logprobs
from rollout_bus.trainer.config import LossSettings, OptimConfig
from rollout_bus.trainer.learner import Learner, to_padded
from tests.support.fake_rollouts import fake_batch


def test_padded_columns_line_up_with_token_logprobs() -> None:
    data = fake_batch(2, 2, rollout_id=0, version=0, rng=random.Random(3))
    padded = to_padded(data)
    for i in range(len(data)):
        p, r = int(data.prompt_lengths[i]), int(data.response_lengths[i])
        row = padded.loss_mask[i]
        assert row.nonzero().squeeze(1).tolist() == list(range(p - 1, p - 1 + r))
        # column t scores token t + 1: the masked columns' targets are exactly the response
        targets = padded.input_ids[i, 1:][row.bool()]
        assert targets.tolist() == data.tokens[i][p:].tolist()
        assert padded.rollout_logp[i][row.bool()].tolist() == data.rollout_log_probs[i].tolist()
    assert torch.equal(padded.advantages, data.rewards)


def test_a_train_step_makes_rewarded_responses_more_likely() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=32), seed=0)
    data = fake_batch(4, 4, rollout_id=0, version=0, rng=random.Random(1))
    learner = Learner(model, OptimConfig(lr=1e-2), LossSettings())
    padded = to_padded(data)

    def advantage_weighted_logp() -> float:
        with torch.no_grad():
            logp = token_logprobs(model, padded.input_ids, padded.attention_mask)
        per_sample = (logp * padded.loss_mask).sum(1)
        return float((per_sample * padded.advantages).sum())

    before = advantage_weighted_logp()
    for _ in range(5):
        metrics = learner.train_step(data)
    assert advantage_weighted_logp() > before
    assert metrics["optimizer_steps"] == 1.0 and metrics["response_tokens"] == float(data.response_lengths.sum())


def test_several_minibatches_and_epochs_make_that_many_optimizer_steps() -> None:
    model = build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=32), seed=0)
    learner = Learner(model, OptimConfig(epochs=2, minibatches=2), LossSettings())
    metrics = learner.train_step(fake_batch(2, 4, rollout_id=0, version=0))
    assert metrics["optimizer_steps"] == 4.0


def test_pad_batch_and_to_padded_agree_on_right_padding() -> None:
    data = fake_batch(1, 3, rollout_id=0, version=0)
    ids, mask = pad_batch([data.tokens[i].tolist() for i in range(len(data))], side="right")
    padded = to_padded(data)
    assert torch.equal(ids, padded.input_ids) and torch.equal(mask, padded.attention_mask)


def test_the_learner_recomputes_log_probs_at_the_rollouts_temperature() -> None:
    """Rollout log-probs sampled at T=0.5 from the same weights: the learner at T=0.5 sees no off-policy gap
    (rollout KL 0, importance weights 1); one that ignored the temperature would see a large one."""
    config = ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=32)
    data = fake_batch(2, 4, rollout_id=0, version=0, rng=random.Random(5))
    padded = to_padded(data)
    with torch.no_grad():
        at_half = token_logprobs(build_model(config, seed=0), padded.input_ids, padded.attention_mask, 0.5)
    data.rollout_log_probs.values.copy_(at_half[padded.loss_mask.bool()])
    assert torch.equal(to_padded(data).rollout_logp, at_half * padded.loss_mask)

    same = Learner(build_model(config, seed=0), OptimConfig(), LossSettings(), temperature=0.5).train_step(data)
    assert abs(same["rollout_kl"]) < 1e-5 and abs(same["is_weight_mean"] - 1.0) < 1e-5
    ignored = Learner(build_model(config, seed=0), OptimConfig(), LossSettings()).train_step(data)
    assert abs(ignored["rollout_kl"]) > 1e-2
