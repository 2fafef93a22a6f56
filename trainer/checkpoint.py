"""The trainer's checkpoint: model, optimiser, trained batch ids, step and version, saved atomically.

One file, written to a temporary name, fsynced and renamed over the previous one, so a
trainer killed at any instant finds either the old checkpoint or the new one, never a
mix. Batches are acked only after the checkpoint that records them, so a restarted
trainer skips-and-acks every batch the checkpoint lists and trains every other one. The
rename waits for ``before_replace`` (the trainer's lease check), so a deposed trainer never
puts its checkpoint in place of its successor's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "trainer.pt"


@dataclass
class TrainerState:
    """What a trainer must remember across restarts (besides model and optimiser)."""

    version: int
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    step: int = 0
    next_rollout_id: int = 0
    in_flight: dict[int, str] = field(default_factory=dict)
    """rollout id -> request id of requests whose batch was not consumed yet."""
    attempts: dict[int, int] = field(default_factory=dict)
    """rollout id -> how many times it was requested (a timed-out request is asked again)."""
    trained: list[tuple[int, str]] = field(default_factory=list)
    """(step, batch id) of every trained batch, in order."""
    dropped: list[str] = field(default_factory=list)
    """Batch ids consumed without training (all stale, or not ours)."""
    returned: list[dict[str, Any]] = field(default_factory=list)
    """Data-source items of stale groups, given back with the next rollout request."""
    counters: dict[str, float] = field(default_factory=dict)
    staleness_hist: dict[int, int] = field(default_factory=dict)
    """staleness -> trained samples."""
    rewards: list[float] = field(default_factory=list)
    """Mean raw reward of the samples of each trained step."""
    last_metrics: dict[str, float] = field(default_factory=dict)
    """The metrics of the last step (its ``TrainStepDone`` is repeated after a restart)."""

    def done_batch_ids(self) -> set[str]:
        return {b for _, b in self.trained} | set(self.dropped)

    def count(self, name: str, by: float = 1.0) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + by

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerState:
        known = {f.name for f in dataclasses.fields(cls)}
        state = cls(**{k: v for k, v in data.items() if k in known})
        state.in_flight = {int(k): str(v) for k, v in state.in_flight.items()}
        state.attempts = {int(k): int(v) for k, v in state.attempts.items()}
        state.trained = [(int(s), str(b)) for s, b in state.trained]
        state.staleness_hist = {int(k): int(v) for k, v in state.staleness_hist.items()}
        return state


@dataclass
class Checkpoint:
    state: TrainerState
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    model_config: dict[str, Any]


class CheckpointStore:
    """Saves and loads the one checkpoint file of a trainer (per data-parallel rank)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    @property
    def path(self) -> Path:
        return self.directory / CHECKPOINT_FILE

    def exists(self) -> bool:
        return self.path.is_file()

    def save(self, state: TrainerState, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
             model_state: dict[str, torch.Tensor] | None = None,
             before_replace: Callable[[], object] | None = None) -> Path:
        """``model_state``: the tensors to keep instead of the whole ``state_dict`` (a LoRA adapter's).
        ``before_replace`` runs right before the new file is renamed in; what it raises leaves the old one."""
        self.directory.mkdir(parents=True, exist_ok=True)
        config = getattr(model, "config", None)
        payload = {"state": state.to_dict(), "model": model.state_dict() if model_state is None else model_state, "optimizer": optimizer.state_dict(),
                   "model_config": config.to_dict() if config is not None else {}}
        fd, tmp_name = tempfile.mkstemp(prefix=f".{CHECKPOINT_FILE}.", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            if before_replace is not None:
                before_replace()
            os.replace(tmp_name, self.path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        _fsync_dir(self.directory)
        return self.path

    def load(self) -> Checkpoint | None:
        if not self.exists():
            return None
        payload = torch.load(self.path, map_location="cpu", weights_only=True)
        state = TrainerState.from_dict(payload["state"])
        log.info("loaded checkpoint %s: step %d, version %d, %d trained batches", self.path, state.step,
                 state.version, len(state.trained))
        return Checkpoint(state, payload["model"], payload["optimizer"], payload.get("model_config", {}))


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
