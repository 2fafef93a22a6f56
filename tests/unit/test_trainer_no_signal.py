"""A batch without signal (every advantage 0: each group all right or all wrong) moves nothing.

The GRPO loss of such a batch is exactly 0, and so is its gradient; an Adam step on it would still
move the weights along the optimiser's running averages. The learners take no optimiser step, and
the trainer makes it a step that publishes nothing: the version stays, no weights are written, the
batch is acked unused, and ``TrainStepDone`` says ``skipped_no_signal``. Every mode copes with it.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import fakeredis
import pytest
import torch

from rollout_bus.events.names import Keys
from rollout_bus.events.schema import BatchConsumed, TrainStepDone, WeightsPublished
from rollout_bus.events.train_data import TrainData
from rollout_bus.launch.report import RunLog
from rollout_bus.lm.model import ModelConfig, build_model
from rollout_bus.trainer.checkpoint import CheckpointStore
from rollout_bus.trainer.config import LossSettings, OptimConfig
from rollout_bus.trainer.grpo import LossConfig, has_signal
from rollout_bus.trainer.learner import Learner
from rollout_bus.trainer.service import Trainer
from tests.support.fake_rollouts import FakeRollouts, fake_batch
from tests.unit.test_trainer_service import events_of, make_config, model_path  # noqa: F401 (fixture)


def flatten(data: TrainData) -> None:
    """Every group all right: raw rewards 1, advantages 0."""
    data.raw_reward[:] = 1.0
    data.rewards[:] = 0.0


def flat_batch(seed: int = 2) -> TrainData:
    data = fake_batch(2, 4, rollout_id=1, version=0, rng=random.Random(seed))
    flatten(data)
    return data


def test_has_signal_needs_a_nonzero_advantage_on_a_trained_token() -> None:
    cfg = LossConfig()
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert not has_signal(torch.tensor([0.0, 0.0]), mask, cfg)
    assert not has_signal(torch.tensor([0.0, 0.5]), mask, cfg)  # the only advantage sits on an untrained sample
    assert has_signal(torch.tensor([-0.5, 0.0]), mask, cfg)
    assert has_signal(torch.tensor([0.0, 0.0]), mask, LossConfig(entropy_coef=0.01))  # the entropy bonus moves it


def test_the_learner_takes_no_optimiser_step_on_a_batch_without_signal() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=32), seed=0)
    learner = Learner(model, OptimConfig(lr=1e-2), LossSettings())
    first = learner.train_step(fake_batch(2, 4, rollout_id=0, version=0, rng=random.Random(1)))
    assert first["skipped_no_signal"] == 0.0 and first["optimizer_steps"] == 1.0  # Adam now has momentum
    weights = copy.deepcopy(model.state_dict())
    optimiser = copy.deepcopy(learner.optimizer.state_dict())
    metrics = learner.train_step(flat_batch())
    assert metrics["skipped_no_signal"] == 1.0 and metrics["optimizer_steps"] == 0.0 and metrics["loss"] == 0.0
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name  # momentum alone would have moved every weight
    assert learner.optimizer.state_dict()["state"][0]["step"] == optimiser["state"][0]["step"]


def test_the_hf_learner_takes_no_optimiser_step_on_a_batch_without_signal() -> None:
    from rollout_bus.trainer.hf_learner import HFLearner
    from tests.support.tiny_hf import tiny_llama
    from tests.unit.test_trainer_hf_learner import VOCAB, batch

    torch.set_num_threads(1)
    model = tiny_llama(VOCAB, seed=0)
    learner = HFLearner(model, OptimConfig(lr=1e-2), LossSettings())
    assert learner.train_step(batch(model, seed=1))["skipped_no_signal"] == 0.0
    weights = {k: v.clone() for k, v in learner.model.state_dict().items()}
    data = batch(model, seed=2)
    flatten(data)
    metrics = learner.train_step(data)
    assert metrics["skipped_no_signal"] == 1.0 and metrics["optimizer_steps"] == 0.0
    for name, tensor in learner.model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


@pytest.mark.parametrize("mode", ["sync", "one-step", "async"])
def test_a_step_without_signal_publishes_nothing_and_every_mode_goes_on(
        mode: str, tmp_path: Path, model_path: str, keys: Keys) -> None:  # noqa: F811
    client = fakeredis.FakeRedis()
    with FakeRollouts(client, keys, poison={1: flatten}) as fake:
        config = make_config(tmp_path, model_path, keys, mode, 4, **({"in_flight": 2} if mode == "async" else {}))
        trainer = Trainer(config, client, keys)
        trainer.start()
        trainer.run()
        trainer.stop()
    flat = fake.poisoned[0]
    state = trainer.state
    assert state is not None and state.step == 4 and state.version == 3  # four steps, three versions
    assert state.counters["skipped_no_signal"] == 1 and flat in state.dropped
    assert flat not in {b for _, b in state.trained}
    published = [e.version for e in events_of(client, keys.weight_stream("default"), WeightsPublished)]
    assert published == [1, 2, 3]
    steps = events_of(client, keys.trainer_stream, TrainStepDone)
    assert [s.step for s in steps] == [1, 2, 3, 4]
    skipped = [s for s in steps if s.metrics["skipped_no_signal"]]
    assert len(skipped) == 1 and skipped[0].metrics["optimizer_steps"] == 0.0
    assert skipped[0].weight_version == next(s.weight_version for s in steps if s.step == skipped[0].step - 1) \
        if skipped[0].step > 1 else skipped[0].weight_version == 0
    consumed = {c.batch_id: c for c in events_of(client, keys.trainer_stream, BatchConsumed)}
    assert not consumed[flat].accepted and consumed[flat].reason.startswith("no signal")
    assert not (Path(config.publish.weights_root) / "default" / "v000004").exists()
    saved = CheckpointStore(config.checkpoint_dir).load()
    assert saved is not None and saved.state.step == 4 and saved.state.version == 3
    assert flat in saved.state.done_batch_ids()  # a restart skips it and does not take the step again
    runlog = RunLog()
    runlog.add_all(steps)
    summary = runlog.policy("default")
    assert (summary.steps, summary.version, summary.skipped_no_signal) == (4, 3, 1)
