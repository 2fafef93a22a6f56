"""Checkpoints: one file, replaced atomically, holding model, optimiser and the trained batch ids."""

from __future__ import annotations

from pathlib import Path

import torch

from rollout_bus.lm.model import ModelConfig, build_model
from rollout_bus.trainer.checkpoint import CheckpointStore, TrainerState


def test_a_checkpoint_round_trips_state_model_and_optimizer(tmp_path: Path) -> None:
    model = build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    state = TrainerState(version=7, step=3, next_rollout_id=5, in_flight={4: "t-r4"}, attempts={4: 2},
                         trained=[(1, "b1"), (2, "b2"), (3, "b3")], dropped=["b0"], staleness_hist={0: 3, 1: 5})
    store = CheckpointStore(tmp_path / "ckpt")
    store.save(state, model, optimizer)
    loaded = store.load()
    assert loaded is not None
    assert loaded.state == state
    assert loaded.state.done_batch_ids() == {"b0", "b1", "b2", "b3"}
    assert loaded.model_config == model.config.to_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.model[name], tensor)
    assert loaded.optimizer["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["trainer.pt"]  # no temporary files left


def test_no_checkpoint_loads_as_none(tmp_path: Path) -> None:
    assert CheckpointStore(tmp_path).load() is None
