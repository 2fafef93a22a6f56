"""The trainer on a Hugging Face model resumes from its checkpoint: a LoRA one keeps the adapter alone and
loads it over the base from ``model_path``; a checkpoint that does not fit the model is refused."""

from __future__ import annotations

from pathlib import Path

import fakeredis
import pytest
import torch

from rollout_bus.lm import hf
from rollout_bus.trainer.config import ConfigError, PublishConfig, RolloutConfig, TrainerConfig
from rollout_bus.trainer.hf_config import HFSettings, LoraSettings
from rollout_bus.trainer.service import Trainer, _trainable_state


def config(tmp_path: Path, model: Path, lora: LoraSettings | None) -> TrainerConfig:
    return TrainerConfig(model_path=str(model), checkpoint_dir=str(tmp_path / "ckpt"),
                         publish=PublishConfig(weights_root=str(tmp_path / "w")), rollout=RolloutConfig(temperature=0.7),
                         hf=HFSettings(device="cpu", lora=lora))


def test_a_lora_checkpoint_holds_the_adapter_and_resumes_over_the_base(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model = hf.write_random_llama(tmp_path / "m", seed=0)
    cfg = config(tmp_path, model, LoraSettings(r=4, alpha=8))
    first = Trainer(cfg, fakeredis.FakeRedis())
    first._start_hf(None)
    assert first.learner is not None and first.learner.settings.temperature == 0.7  # the rollouts' temperature
    assert cfg.rollout.stop_token_ids == (2,)  # the model's EOS (<|im_end|>)
    with torch.no_grad():
        for name, p in first.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.01)
    assert first.store is not None and first.state is not None
    first.state.step, first.state.version = 3, 3
    first.store.save(first.state, first.model, first.learner.optimizer, model_state=_trainable_state(first.model))
    saved = torch.load(tmp_path / "ckpt" / "trainer.pt", weights_only=True)["model"]
    assert saved and all("lora_" in name for name in saved)

    again = Trainer(cfg, fakeredis.FakeRedis())
    again._start_hf(again.store.load() if again.store else None)
    assert again.state is not None and again.state.version == 3
    before, after = first.model.state_dict(), again.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

    full = Trainer(config(tmp_path, model, None), fakeredis.FakeRedis())
    with pytest.raises(ConfigError, match="does not fit .* it lacks"):
        full._start_hf(full.store.load() if full.store else None)
