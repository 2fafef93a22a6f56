"""The Hugging Face learner on a small random Llama: log-probs, accumulated gradients, learning, LoRA."""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import Any

import pytest
import torch

from rollout_bus.events.errors import InvalidRequest
from rollout_bus.events.train_data import TrainData
from rollout_bus.executor.convert import to_train_data
from rollout_bus.executor.sample import Sample, Status
from rollout_bus.trainer.config import LossSettings, OptimConfig
from rollout_bus.trainer.hf_config import HFSettings, LoraSettings
from rollout_bus.trainer.hf_learner import HFLearner, layout
from tests.support.tiny_hf import tiny_llama

VOCAB = 259


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def batch(model: Any, *, groups: int = 2, per_group: int = 4, seed: int = 0, temperature: float = 1.0,
          off_policy: float = 0.0) -> TrainData:
    """Samples of varied prompt and response lengths; the rewards favour responses that start with token 10.

    Rollout log-probs are the model's own (``off_policy`` adds noise, as a stale engine would).
    """
    rng = random.Random(seed)
    samples: list[Sample] = []
    for g in range(groups):
        prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 9))]
        for j in range(per_group):
            response = [10 if j % 2 == 0 else 11] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 7))]
            s = Sample(group_index=g, index=g * per_group + j, prompt="", prompt_ids=prompt,
                       response_ids=response, loss_mask=[1] * len(response), status=Status.COMPLETED)
            s.reward = 1.0 if j % 2 == 0 else 0.0
            samples.append(s)
    for s, logp in zip(samples, direct_logprobs(model, samples, temperature), strict=True):
        s.rollout_log_probs = [v + rng.uniform(-off_policy, off_policy) for v in logp.tolist()]
    return to_train_data(samples, rollout_id=0)


@torch.no_grad()
def direct_logprobs(model: Any, samples: list[Sample], temperature: float) -> list[torch.Tensor]:
    """One unpadded full forward per sample: ``log_softmax(logits / T)`` at each response token."""
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float() / temperature, dim=-1)
        p = len(s.prompt_ids)
        out.append(logp[p - 1:-1].gather(-1, ids[0, p:, None]).squeeze(-1))
    return out


def samples_of(data: TrainData) -> list[Sample]:
    views = list(data.samples())
    return [Sample(group_index=v.group_index, index=v.sample_index, prompt="",
                   prompt_ids=v.tokens[:v.prompt_length].tolist(), response_ids=v.tokens[v.prompt_length:].tolist())
            for v in views]


def learner(model: Any, *, micro: int = 4, lr: float = 1e-3, lora: LoraSettings | None = None,
            temperature: float = 1.0, **optim: Any) -> HFLearner:
    return HFLearner(model, OptimConfig(lr=lr, **optim), LossSettings(),
                     HFSettings(micro_batch_size=micro, temperature=temperature, device="cpu", lora=lora))


def test_the_learners_logprobs_match_a_direct_forward_of_each_sample_at_the_rollout_temperature() -> None:
    model = tiny_llama(VOCAB, seed=1)
    data = batch(model, groups=3, temperature=0.7)
    want = direct_logprobs(model, samples_of(data), 0.7)
    got = learner(model, micro=3, temperature=0.7).logprobs(data)
    assert [len(g) for g in got] == data.response_lengths.tolist()
    assert max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)) < 1e-5
    at_one = learner(model, micro=3).logprobs(data)
    assert max(float((g - w).abs().max()) for g, w in zip(at_one, want, strict=True)) > 1e-2, \
        "the temperature should change the log-probs"


def test_micro_batched_gradients_equal_the_full_batch_gradient() -> None:
    model = tiny_llama(VOCAB, seed=2)
    data = batch(model, groups=3, off_policy=0.5)
    lay = layout(data)
    rows = torch.arange(len(data))
    grads = []
    metrics = []
    for micro in (len(data), 5, 1):
        lr = learner(copy.deepcopy(model), micro=micro)
        lr.model.train()
        metrics.append(lr.accumulate(lay, rows, 1.0))
        grads.append({n: p.grad.clone() for n, p in lr.model.named_parameters() if p.grad is not None})
    assert metrics[0]["micro_batches"] == 1 and metrics[2]["micro_batches"] == len(data)
    for other in grads[1:]:
        assert other.keys() == grads[0].keys()
        for name, g in grads[0].items():
            torch.testing.assert_close(other[name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert metrics[1]["loss"] == pytest.approx(metrics[0]["loss"], rel=1e-5)
    assert 0.5 < metrics[0]["is_weight_mean"] < 2.0 and metrics[0]["is_weight_mean"] != 1.0


def test_training_on_a_toy_batch_lowers_the_loss_and_favours_the_rewarded_responses() -> None:
    model = tiny_llama(VOCAB, seed=3)
    data = batch(model, groups=2)
    lr = learner(model, micro=3, lr=1e-2)
    rewarded = data.raw_reward > 0
    before = torch.stack([lp.mean() for lp in lr.logprobs(data)])
    losses = [lr.train_step(data)["loss"] for _ in range(6)]
    after = torch.stack([lp.mean() for lp in lr.logprobs(data)])
    assert losses[-1] < losses[0] - 0.1, losses
    assert bool((after - before)[rewarded].min() > 0) and bool((after - before)[~rewarded].max() < 0)


def test_several_minibatches_and_epochs_step_the_optimiser_with_the_ppo_clip() -> None:
    model = tiny_llama(VOCAB, seed=4)
    data = batch(model, groups=2)
    metrics = learner(model, micro=2, lr=5e-2, epochs=2, minibatches=2).train_step(data)
    assert metrics["optimizer_steps"] == 4 and metrics["micro_batches"] == 8
    assert metrics["ppo_clipped_frac"] > 0, "a large learning rate should move some ratios past the clip"
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


def test_lora_training_changes_only_the_adapter_weights() -> None:
    model = tiny_llama(VOCAB, seed=5)
    data = batch(model, groups=2)
    lr = learner(model, lr=1e-2, lora=LoraSettings(r=4, alpha=8))
    before = {n: p.detach().clone() for n, p in lr.model.named_parameters()}
    trainable = {n for n, p in lr.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    for _ in range(2):
        lr.train_step(data)
    for name, p in lr.model.named_parameters():
        if name in trainable:
            continue
        assert torch.equal(p, before[name]), f"{name} is not an adapter weight but changed"
    assert any(not torch.equal(p, before[n]) for n, p in lr.model.named_parameters() if "lora_B" in n)
    assert lr.is_lora


def test_bad_settings_are_refused_with_what_to_fix() -> None:
    with pytest.raises(InvalidRequest, match="micro_batch_size must be a positive integer.*device must be one of"):
        HFSettings(micro_batch_size=0, device="tpu").validate()
    model = tiny_llama(VOCAB, seed=6)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        learner(model).logprobs(batch(model, groups=1), temperature=0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_learner_gives_the_cpu_logprobs_and_trains() -> None:
    model = tiny_llama(VOCAB, seed=7)
    data = batch(model, groups=2, temperature=0.8)
    want = direct_logprobs(model, samples_of(data), 0.8)
    cuda = HFLearner(copy.deepcopy(model), OptimConfig(lr=1e-2), LossSettings(),
                     HFSettings(micro_batch_size=3, temperature=0.8, device="cuda"))
    assert next(cuda.model.parameters()).is_cuda
    got = cuda.logprobs(data)
    assert max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)) < 1e-4
    assert torch.isfinite(torch.tensor(cuda.train_step(data)["loss"]))


@torch.no_grad()
def direct_entropy(model: Any, samples: list[Sample], temperature: float) -> float:
    """Token-mean entropy of ``softmax(logits / T)`` over every response token, one full forward per sample."""
    total, count = 0.0, 0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float() / temperature, dim=-1)
        p = len(s.prompt_ids)
        h = -(logp.exp() * logp).sum(-1)[p - 1:-1]
        total += float(h.sum())
        count += len(h)
    return total / count


def test_a_step_reports_the_policys_entropy_and_an_entropy_bonus_trains() -> None:
    model = tiny_llama(VOCAB, seed=5)
    data = batch(model, groups=2, temperature=0.8)
    want = direct_entropy(model, samples_of(data), 0.8)
    metrics = learner(model, micro=3, temperature=0.8).train_step(data)  # measured before the update
    assert metrics["entropy"] == pytest.approx(want, rel=1e-4)
    assert 0.0 < metrics["entropy"] <= torch.log(torch.tensor(float(VOCAB))).item()

    flat = copy.deepcopy(model)
    bonus = HFLearner(flat, OptimConfig(lr=1e-3), LossSettings(entropy_coef=1.0),
                      HFSettings(micro_batch_size=3, temperature=0.8, device="cpu"))
    no_adv = dataclasses.replace(data, rewards=torch.zeros_like(data.rewards))  # advantages 0: the bonus alone
    before = direct_entropy(flat, samples_of(no_adv), 0.8)
    for _ in range(5):
        out = bonus.train_step(no_adv)
    assert out["entropy_loss"] < 0
    assert direct_entropy(flat, samples_of(no_adv), 0.8) > before  # the bonus alone raised the entropy
