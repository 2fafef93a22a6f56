"""Off-policy corrections (``--off-policy tis|mis|decoupled``) against values computed by hand.

Every tensor is one sample of a few tokens; ``old`` is the trainer's (proximal) log-prob, ``behav`` the
engine's. Ratios are written as their logs so that a ratio at a bound is exactly there.
"""

from __future__ import annotations

import copy
import math
import random
from pathlib import Path

import fakeredis
import pytest
import torch

from rollout_bus.events.names import Keys
from rollout_bus.events.schema import BatchConsumed, TrainStepDone, WeightsPublished
from rollout_bus.events.train_data import TrainData
from rollout_bus.lm.model import ModelConfig, build_model, token_logprobs
from rollout_bus.trainer.config import ConfigError, LossSettings, OptimConfig, PublishConfig, TrainerConfig
from rollout_bus.trainer.grpo import LossConfig, grpo_loss
from rollout_bus.trainer.learner import Learner, to_padded
from rollout_bus.trainer.service import Trainer
from tests.support.fake_rollouts import FakeRollouts, fake_batch
from tests.unit.test_trainer_service import events_of, make_config, model_path  # noqa: F401 (fixture)

LN2 = math.log(2.0)


def row(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float32)


def loss_of(log_ratio: torch.Tensor, config: LossConfig, *, advantage: float = 1.0,
            logp: torch.Tensor | None = None) -> tuple[float, dict[str, float], bool]:
    """The loss with ``old - behav = log_ratio`` (``behav`` 0) and, unless given, ``logp = old`` (r = 1)."""
    old = log_ratio
    out = grpo_loss(old if logp is None else logp, old, torch.zeros_like(old), torch.tensor([advantage]),
                    torch.ones_like(old), config)
    return float(out.loss), out.metrics, out.has_gradient


# --- tis -------------------------------------------------------------------------------------------------

def test_tis_truncates_the_weight_at_the_cap_and_a_ratio_at_the_cap_is_not_truncated() -> None:
    # ratios 0.5, 2 (at C), 3 (truncated to 2), 1; A = 1, r = 1: loss = -(0.5 + 2 + 2 + 1) / 4
    loss, m, _ = loss_of(row(-LN2, LN2, math.log(3.0), 0.0), LossConfig(tis_cap=2.0))
    assert loss == pytest.approx(-5.5 / 4, abs=1e-6)
    assert m["is_truncated_frac"] == 0.25 and m["is_masked_frac"] == 0.0
    assert m["is_weight_mean"] == pytest.approx((0.5 + 2 + 3 + 1) / 4, abs=1e-6)


# --- mis -------------------------------------------------------------------------------------------------

def test_mis_keeps_ratios_inside_the_band_bounds_included_and_masks_the_rest() -> None:
    # ratios 2 (= C, kept), 0.5 (= 1/C, kept), 3 (masked), 0.25 (masked), 1.5 (kept); A = 1, r = 1:
    # loss = -(2 + 0.5 + 0 + 0 + 1.5) / 5 = -0.8
    loss, m, grad = loss_of(row(LN2, -LN2, math.log(3.0), math.log(0.25), math.log(1.5)),
                            LossConfig(tis_cap=2.0, off_policy="mis"))
    assert loss == pytest.approx(-0.8, abs=1e-6)
    assert m["is_masked_frac"] == pytest.approx(0.4) and m["is_truncated_frac"] == 0.0 and grad


def test_mis_masks_a_ratio_one_step_past_the_bound_on_either_side() -> None:
    up = torch.nextafter(torch.tensor(LN2), torch.tensor(1.0)).item()
    down = torch.nextafter(torch.tensor(-LN2), torch.tensor(-1.0)).item()
    loss, m, _ = loss_of(row(up, down, 0.0), LossConfig(tis_cap=2.0, off_policy="mis"))
    assert m["is_masked_frac"] == pytest.approx(2 / 3)
    assert loss == pytest.approx(-1.0 / 3, abs=1e-6)  # only the ratio-1 token counts


def test_mis_with_every_token_masked_gives_a_zero_loss_no_gradient_and_no_nan() -> None:
    logp = row(-1.0, -2.0, -0.5).requires_grad_()
    old = row(3.0, -10.0, 50.0)  # ratios e^3, e^-10, e^50 against behav 0
    out = grpo_loss(logp, old, torch.zeros_like(old), torch.tensor([1.0]), torch.ones_like(old),
                    LossConfig(tis_cap=2.0, off_policy="mis"))
    assert float(out.loss.detach()) == 0.0 and not out.has_gradient
    assert out.metrics["is_masked_frac"] == 1.0
    assert all(math.isfinite(v) for k, v in out.metrics.items() if k != "is_weight_mean")
    out.loss.backward()
    assert logp.grad is not None and torch.equal(logp.grad, torch.zeros_like(logp))


def test_mis_with_an_entropy_bonus_still_has_a_gradient_when_every_token_is_masked() -> None:
    old = row(5.0)
    out = grpo_loss(old, old, torch.zeros_like(old), torch.tensor([1.0]), torch.ones_like(old),
                    LossConfig(tis_cap=2.0, off_policy="mis", entropy_coef=0.1), entropy=row(0.7))
    assert out.has_gradient and float(out.loss) == pytest.approx(-0.07)


# --- decoupled -------------------------------------------------------------------------------------------

def test_decoupled_clips_against_the_proximal_policy_and_weights_by_proximal_over_behaviour() -> None:
    # token 0: A = 1, r = 1.5 (clipped to 1.2), w = min(3, 2) = 2 -> -2.4
    # token 1: A = -1, r = 0.5: min(-0.5, -0.8) = -0.8 (the clip), w = 1 (behaviour == proximal) -> +0.8
    # token 2: A = 1, r = 0.9 (inside), w = 0.5 -> -0.45
    prox = torch.log(torch.tensor([[0.3, 0.4, 0.5]]))
    behav = torch.log(torch.tensor([[0.1, 0.4, 1.0]]))
    logp = (prox + torch.log(torch.tensor([[1.5, 0.5, 0.9]]))).requires_grad_()
    out = grpo_loss(logp, prox, behav, torch.tensor([1.0]), torch.ones(1, 3), LossConfig(tis_cap=2.0, ppo_clip=0.2,
                                                                                         off_policy="decoupled"))
    # one advantage per sample: give each token its own through three samples of one token
    per_token = grpo_loss(logp.detach().reshape(3, 1), prox.reshape(3, 1), behav.reshape(3, 1),
                          torch.tensor([1.0, -1.0, 1.0]), torch.ones(3, 1),
                          LossConfig(tis_cap=2.0, ppo_clip=0.2, off_policy="decoupled"))
    assert float(per_token.loss) == pytest.approx((-2.4 + 0.8 - 0.45) / 3, abs=1e-6)
    assert per_token.metrics["ppo_clipped_frac"] == pytest.approx(2 / 3)
    assert per_token.metrics["is_truncated_frac"] == pytest.approx(1 / 3)
    # all A = 1: token 1 is now r = 0.5 inside the clip's effect (min(0.5, 0.8) = 0.5): -(2.4 + 0.5 + 0.45) / 3
    assert float(out.loss.detach()) == pytest.approx(-(2.4 + 0.5 + 0.45) / 3, abs=1e-6)
    out.loss.backward()
    # d/dlogp of -w r A / 3 where unclipped: token 0 clipped (0), token 1: -1 * 0.5 / 3, token 2: -0.5 * 0.9 / 3
    assert logp.grad is not None
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 3, -0.45 / 3], abs=1e-6)


def test_decoupled_with_a_version_gap_of_zero_has_weight_one() -> None:
    prox = torch.log(torch.tensor([[0.2, 0.7]]))
    logp = prox + torch.log(torch.tensor([[1.1, 0.95]]))
    out = grpo_loss(logp, prox, prox.clone(), torch.tensor([2.0]), torch.ones(1, 2),
                    LossConfig(tis_cap=2.0, off_policy="decoupled"))
    assert out.metrics["is_weight_mean"] == 1.0 and out.metrics["is_truncated_frac"] == 0.0
    assert float(out.loss) == pytest.approx(-(1.1 * 2 + 0.95 * 2) / 2, abs=1e-6)  # w = 1, r * A


# --- the settings ----------------------------------------------------------------------------------------

def test_the_trainer_settings_refuse_an_unknown_correction_and_caps_that_cannot_work(tmp_path: Path) -> None:
    def config(**loss: object) -> TrainerConfig:
        return TrainerConfig(publish=PublishConfig(weights_root=str(tmp_path)), loss=LossSettings(**loss))  # type: ignore[arg-type]

    for bad, words in (({"off_policy": "ppo"}, "not one of ['tis', 'mis', 'decoupled']"),
                       ({"off_policy": "mis", "tis_cap": 1.0}, "must be > 1"),
                       ({"off_policy": "decoupled", "tis_cap": 0.0}, "must be > 0"),
                       ({"off_policy": "decoupled", "ppo_clip": None}, "needs the PPO clip")):
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            config(**bad).validate()
    for good in ("tis", "mis", "decoupled"):
        assert config(off_policy=good).validate().loss.off_policy == good


def test_rollout_bus_trainer_takes_off_policy_from_its_flag(tmp_path: Path) -> None:
    from rollout_bus.trainer.cli import parse, trainer_config

    ns = parse(["--weights-root", str(tmp_path), "--off-policy", "mis", "--tis-cap", "3", "--namespace", "t"])
    cfg = trainer_config(ns)
    assert (cfg.loss.off_policy, cfg.loss.tis_cap) == ("mis", 3.0)
    assert trainer_config(parse(["--weights-root", str(tmp_path), "--namespace", "t"])).loss.off_policy == "tis"


# --- the learners: the proximal policy is the weights before the step ------------------------------------

def tiny_model() -> torch.nn.Module:
    return build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=32), seed=0)


def with_own_logprobs(model: torch.nn.Module, data: TrainData, shift: float = 0.0) -> TrainData:
    """``data`` whose rollout log-probs are ``model``'s own (plus ``shift``): behaviour == the current weights."""
    padded = to_padded(data)
    with torch.no_grad():
        own = token_logprobs(model, padded.input_ids, padded.attention_mask, 1.0)  # type: ignore[arg-type]
    offsets = data.rollout_log_probs.offsets.tolist()
    for i, p in enumerate(data.prompt_lengths.tolist()):
        n = offsets[i + 1] - offsets[i]
        data.rollout_log_probs.values[offsets[i]:offsets[i + 1]] = own[i, p - 1:p - 1 + n] + shift
    return data


@pytest.mark.parametrize("off_policy", ["tis", "decoupled"])
def test_the_proximal_log_probs_stay_those_before_the_step_over_several_minibatches_and_epochs(
        off_policy: str) -> None:
    torch.manual_seed(0)
    model = tiny_model()
    learner = Learner(model, OptimConfig(lr=5e-2, epochs=2, minibatches=2),  # four optimiser steps per version
                      LossSettings(off_policy=off_policy))
    data = with_own_logprobs(model, fake_batch(4, 4, rollout_id=0, version=0, rng=random.Random(3)))
    metrics = learner.train_step(data)
    assert metrics["optimizer_steps"] == 4.0
    # had the proximal log-probs been taken again after an optimiser step, w = pi_new / pi_behav != 1 there
    assert metrics["is_weight_mean"] == 1.0 and metrics["is_truncated_frac"] == 0.0
    assert metrics["ppo_clipped_frac"] > 0.0  # the later steps moved the policy away from the proximal one


def test_decoupled_recomputes_the_proximal_policy_for_a_single_step_and_a_gap_of_zero_weighs_one() -> None:
    torch.manual_seed(0)
    model = tiny_model()
    learner = Learner(model, OptimConfig(lr=5e-2), LossSettings(off_policy="decoupled"))
    data = with_own_logprobs(model, fake_batch(2, 4, rollout_id=0, version=0, rng=random.Random(4)))
    metrics = learner.train_step(data)
    assert metrics["is_weight_mean"] == 1.0 and metrics["optimizer_steps"] == 1.0
    # the next batch came from the weights before that step: its weight is pi_now / pi_then, not 1
    stale = fake_batch(2, 4, rollout_id=1, version=0, rng=random.Random(4))
    stale.rollout_log_probs.values[:] = data.rollout_log_probs.values
    assert learner.train_step(stale)["is_weight_mean"] != 1.0


def test_the_hf_learner_keeps_the_proximal_log_probs_over_micro_batches_and_steps() -> None:
    from rollout_bus.trainer.hf_config import HFSettings, LoraSettings
    from rollout_bus.trainer.hf_learner import HFLearner
    from tests.support.tiny_hf import tiny_llama
    from tests.unit.test_trainer_hf_learner import VOCAB, batch

    torch.set_num_threads(1)
    for lora in (None, LoraSettings(r=4, alpha=8)):
        model = tiny_llama(VOCAB, seed=0)
        learner = HFLearner(model, OptimConfig(lr=5e-2, epochs=2, minibatches=2), LossSettings(off_policy="decoupled"),
                            HFSettings(micro_batch_size=2, lora=lora, device="cpu"))
        data = batch(learner.model, seed=1)
        own = learner.logprobs(data)  # the same micro-batched eval-mode forward the learner uses for the proximal
        data.rollout_log_probs.values[:] = torch.cat(own)
        metrics = learner.train_step(data)
        assert metrics["optimizer_steps"] == 4.0 and metrics["micro_batches"] > 4
        assert metrics["is_weight_mean"] == 1.0, lora


# --- mis: a batch with every token masked ----------------------------------------------------------------

def test_the_learner_takes_no_step_when_mis_masks_every_token_and_reports_it() -> None:
    torch.manual_seed(0)
    model = tiny_model()
    learner = Learner(model, OptimConfig(lr=1e-2), LossSettings(off_policy="mis"))
    weights = copy.deepcopy(model.state_dict())
    data = with_own_logprobs(model, fake_batch(2, 4, rollout_id=0, version=0, rng=random.Random(5)), shift=-3.0)
    metrics = learner.train_step(data)  # every ratio e^3 > C = 2
    assert metrics["is_masked_frac"] == 1.0 and metrics["loss"] == 0.0
    assert metrics["optimizer_steps"] == 0.0 and metrics["skipped_no_signal"] == 1.0
    assert all(not math.isnan(v) for k, v in metrics.items() if k != "is_weight_mean")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


def mask_all(data: TrainData) -> None:
    """Rollout log-probs far above any the model gives: every ratio old/behaviour is ~e^-100."""
    data.rollout_log_probs.values[:] = 100.0


def test_a_trainer_reports_a_step_mis_masked_whole_and_publishes_no_version_for_it(
        tmp_path: Path, model_path: str, keys: Keys) -> None:  # noqa: F811
    client = fakeredis.FakeRedis()
    with FakeRollouts(client, keys, poison={1: mask_all}) as fake:
        config = make_config(tmp_path, model_path, keys, "sync", 3)
        config.loss = LossSettings(off_policy="mis", tis_cap=1e6)  # the fake batches' other ratios stay inside
        trainer = Trainer(config, client, keys)
        trainer.start()
        trainer.run()
        trainer.stop()
    masked = fake.poisoned[0]
    steps = events_of(client, keys.trainer_stream, TrainStepDone)
    assert [s.metrics["is_masked_frac"] for s in steps] == [0.0, 1.0, 0.0]
    assert [s.metrics["skipped_no_signal"] for s in steps] == [0.0, 1.0, 0.0]
    assert [e.version for e in events_of(client, keys.weight_stream(config.policy), WeightsPublished)] == [1, 2]
    consumed = {c.batch_id: c for c in events_of(client, keys.trainer_stream, BatchConsumed)}
    assert not consumed[masked].accepted and "mis masked them all" in consumed[masked].reason
