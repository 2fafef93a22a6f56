"""Nothing poisons training: bad values are refused before a step, a non-finite step is refused and
leaves the weights as they were, and the trainer dead-letters the batch and goes on."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from pathlib import Path

import fakeredis
import pytest
import torch

from rollout_bus import cli as rollout_bus_cli
from rollout_bus.events import schema as s
from rollout_bus.events.batch import encode
from rollout_bus.events.errors import DecodeError
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.train_data import TrainData, ragged
from rollout_bus.lm.model import ModelConfig, TinyLM, build_model, load_model, save_weights
from rollout_bus.lm.tokenizer import VOCAB_SIZE
from rollout_bus.replay.logfile import Header, LogEntry, LogWriter, Payload, StreamRange
from rollout_bus.trainer.checkpoint import CheckpointStore
from rollout_bus.trainer.config import (
    LossSettings,
    OptimConfig,
    PublishConfig,
    RolloutConfig,
    ScheduleConfig,
    TrainerConfig,
)
from rollout_bus.trainer.finite import NonFiniteStep
from rollout_bus.trainer.hf_config import HFSettings
from rollout_bus.trainer.hf_learner import HFLearner
from rollout_bus.trainer.learner import Learner
from rollout_bus.trainer.service import Trainer
from tests.support.fake_rollouts import FakeRollouts, fake_batch
from tests.support.tiny_hf import tiny_llama

Poison = Callable[[TrainData], None]


def nan_reward(data: TrainData) -> None:
    data.rewards[0] = math.nan


def inf_log_prob(data: TrainData) -> None:
    data.rollout_log_probs.values[0] = -math.inf


def out_of_vocab(data: TrainData) -> None:
    data.tokens.values[-1] = VOCAB_SIZE + 5


def huge_advantage(data: TrainData) -> None:
    """Finite, so it passes the value checks; the loss overflows and the step must be refused."""
    data.rewards[:] = 3e38


def tiny_model() -> TinyLM:
    return build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=32), seed=0)


def finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in model.state_dict().values())


# --- the train-data check ----------------------------------------------------------------------

@pytest.mark.parametrize(("poison", "field"), [
    (nan_reward, "rewards"), (inf_log_prob, "rollout_log_probs"),
    (lambda d: d.raw_reward.fill_(math.inf), "raw_reward"),
    (lambda d: d.loss_masks.values.fill_(7), "loss_masks"),
    (lambda d: d.tokens.values.__setitem__(0, -3), "tokens"),
])
def test_train_data_with_a_non_finite_or_impossible_value_is_a_decode_error_naming_it(poison: Poison,
                                                                                      field: str) -> None:
    data = fake_batch(2, 2, rollout_id=0, version=0, rng=random.Random(0))
    poison(data)
    fields, meta = data.to_tensors()
    with pytest.raises(DecodeError, match=field):
        TrainData.from_tensors(fields, meta)


@pytest.mark.parametrize("prompt", [0, -1])
def test_empty_or_negative_prompt_lengths_are_refused(prompt: int) -> None:
    fields, meta = fake_batch(1, 1, rollout_id=0, version=0, rng=random.Random(0)).to_tensors()
    total = int(fields["tokens"].lengths[0])  # type: ignore[union-attr]
    response = total - prompt  # consistent row lengths: only the value is wrong
    fields.update(prompt_lengths=torch.tensor([prompt]), response_lengths=torch.tensor([response]),
                  loss_masks=ragged([[1] * response], torch.int32),
                  rollout_log_probs=ragged([[-1.0] * response], torch.float32))
    with pytest.raises(DecodeError, match="prompt_lengths must be >= 1"):
        TrainData.from_tensors(fields, meta)


def test_ids_outside_the_vocabulary_are_refused_by_check_vocab() -> None:
    data = fake_batch(1, 2, rollout_id=0, version=0, rng=random.Random(0))
    data.check_vocab(VOCAB_SIZE)
    out_of_vocab(data)
    with pytest.raises(DecodeError, match=f"outside the model's vocabulary of {VOCAB_SIZE}"):
        data.check_vocab(VOCAB_SIZE)


# --- the learners ------------------------------------------------------------------------------

@pytest.mark.parametrize("optim", [OptimConfig(lr=1e-2), OptimConfig(lr=1e-2, epochs=2, minibatches=2)])
def test_the_tiny_learner_refuses_a_non_finite_step_and_keeps_its_weights_and_optimiser(optim: OptimConfig) -> None:
    torch.manual_seed(0)
    model = tiny_model()
    learner = Learner(model, optim, LossSettings())
    learner.train_step(fake_batch(2, 2, rollout_id=0, version=0, rng=random.Random(1)))  # optimiser state exists
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in learner.optimizer.state_dict()["state"][0].items()}
    data = fake_batch(2, 2, rollout_id=1, version=0, rng=random.Random(2))
    huge_advantage(data)
    with pytest.raises(NonFiniteStep, match="refused"):
        learner.train_step(data)
    assert finite(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    after = learner.optimizer.state_dict()["state"][0]
    assert all(torch.equal(moments[k], after[k]) for k in moments)
    learner.train_step(fake_batch(2, 2, rollout_id=2, version=0, rng=random.Random(3)))  # and it trains on
    assert finite(model) and not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_hf_learner_refuses_a_non_finite_step_and_keeps_its_weights() -> None:
    torch.manual_seed(0)
    model = tiny_llama(VOCAB_SIZE)
    learner = HFLearner(model, OptimConfig(lr=1e-3), LossSettings(), HFSettings(micro_batch_size=2, device="cpu"))
    data = fake_batch(2, 2, rollout_id=0, version=0, rng=random.Random(1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    huge_advantage(data)
    with pytest.raises(NonFiniteStep):
        learner.train_step(data)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_refused_step_restores_the_weights_and_optimiser_state_on_the_device() -> None:
    torch.manual_seed(0)
    model = tiny_llama(VOCAB_SIZE)
    learner = HFLearner(model, OptimConfig(lr=1e-3), LossSettings(), HFSettings(micro_batch_size=2, device="cuda"))
    learner.train_step(fake_batch(2, 2, rollout_id=0, version=0, rng=random.Random(1)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {i: {k: v.clone() for k, v in per.items()} for i, per in learner.optimizer.state_dict()["state"].items()}
    data = fake_batch(2, 2, rollout_id=1, version=0, rng=random.Random(2))
    huge_advantage(data)
    with pytest.raises(NonFiniteStep):
        learner.train_step(data)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    after = learner.optimizer.state_dict()["state"]
    assert all(torch.equal(state[i][k].cpu(), after[i][k].cpu()) for i in state for k in state[i])
    assert all(v.device.type == "cuda" for per in after.values() for k, v in per.items() if k != "step")
    learner.train_step(fake_batch(2, 2, rollout_id=2, version=0, rng=random.Random(3)))


# --- the trainer service -----------------------------------------------------------------------

@pytest.fixture()
def model_path(tmp_path: Path) -> str:
    save_weights(tiny_model(), tmp_path / "init")
    return str(tmp_path / "init")


@pytest.mark.parametrize("poison", [nan_reward, inf_log_prob, out_of_vocab, huge_advantage])
def test_a_poisoned_batch_is_dead_lettered_with_its_reason_and_the_trainer_goes_on(
        tmp_path: Path, model_path: str, keys: Keys, poison: Poison) -> None:
    client = fakeredis.FakeRedis()
    config = TrainerConfig(
        policy="default", trainer_id="t0", namespace=keys.namespace, model_path=model_path,
        checkpoint_dir=str(tmp_path / "ckpt"), steps=3,
        rollout=RolloutConfig(n_groups=2, n_samples_per_group=2, timeout_s=60.0),
        schedule=ScheduleConfig(mode="sync"),
        publish=PublishConfig(weights_root=str(tmp_path / "weights"), serving_timeout_s=5.0),
        optim=OptimConfig(lr=1e-2), get_timeout_s=20.0)
    with FakeRollouts(client, keys, poison={1: poison}) as fake:
        trainer = Trainer(config, client, keys)
        trainer.start()
        trainer.run()
        trainer.stop()
    assert fake.poisoned, "the poisoned batch was published"
    state = trainer.state
    assert state is not None and state.step == 3 and state.version == 3
    assert fake.poisoned[0] not in [b for _, b in state.trained]
    assert finite(trainer.model)
    letters = [fields for _, fields in page(client, keys.dead_letters)]
    assert len(letters) == 1
    reason = letters[0][b"reason"].decode()
    assert fake.poisoned[0] in reason and ("not finite" in reason or "vocabulary" in reason or "step refused" in reason), reason
    asked = [e for e in fake.requests if e.rollout_id == 1]
    assert len(asked) == 2 and asked[1].request_id.endswith("-a2")  # its rollout was asked for again
    published = [s.decode(f) for _, f in page(client, keys.weight_stream("default"))]
    assert [e.version for e in published if isinstance(e, s.WeightsPublished)] == [1, 2, 3]
    kept = sorted((Path(config.publish.weights_root) / "default").glob("v*"))
    assert kept and all(finite(load_model(str(d))) for d in kept)  # every version on disk holds finite weights
    checkpoint = CheckpointStore(config.checkpoint_dir).load()
    assert checkpoint is not None and checkpoint.state.step == 3
    assert all(bool(torch.isfinite(t).all()) for t in checkpoint.model.values())


# --- replay offline ----------------------------------------------------------------------------

def log_with(path: Path, poison: Poison | None) -> Path:
    stream = "batches/p0"
    with path.open("wb") as fh:
        writer = LogWriter(fh, Header("poison-test", 0, [StreamRange(stream)]))
        producer = s.Producer("executor", "x-0")
        for rid in range(3):
            data = fake_batch(2, 2, rollout_id=rid, version=0, rng=random.Random(rid))
            if rid == 1 and poison is not None:
                poison(data)
            fields, meta = data.to_tensors()
            encoded = encode(fields, meta).tobytes()
            bid = f"b{rid}"
            event = s.BatchReady(producer=producer, policy="p0", batch_id=bid, rollout_id=rid, request_id=f"q{rid}",
                                 n_samples=len(data), min_weight_version=0, max_weight_version=0,
                                 bytes=len(encoded), payload={"store": "redis", "ref": f"p0:{bid}"})
            entry = LogEntry(stream, f"{1000 + rid}-0", s.encode(event))  # type: ignore[arg-type]
            writer.payload(Payload(stream, entry.id, bid, event.payload, encoded))
            writer.entry(entry)
        writer.close()
    return path


@pytest.mark.parametrize("poison", [nan_reward, out_of_vocab, huge_advantage])
def test_replay_offline_exits_non_zero_on_a_poisoned_batch_and_writes_no_weights(
        tmp_path: Path, model_path: str, poison: Poison, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "offline", "--log", str(log_with(tmp_path / "run.rblog", poison)), "--policy", "p0",
            "--model-path", model_path, "--out", str(tmp_path / "out")]
    assert rollout_bus_cli.main(argv) != 0
    assert "batch b1" in capsys.readouterr().err
    assert not (tmp_path / "out" / "model").exists()
    clean = ["replay", "offline", "--log", str(log_with(tmp_path / "clean.rblog", None)), "--policy", "p0",
             "--model-path", model_path]
    assert rollout_bus_cli.main(clean) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 3
