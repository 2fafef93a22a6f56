"""Offline retraining: the reference learner over the batches of an exported log, deterministically.

``run_offline(config)`` loads the initial weights (the tiny LM's, or a Hugging Face model directory,
trained whole or through a LoRA adapter by ``trainer.hf_learner``), then trains one step per recorded batch
of ``config.policy`` in the log's stream order (``replay.feed.feed_batches``), with no
engines and no Redis. The same log, initial weights, seed and settings give the same batch
ids in the same order and bit-identical weights (``weights_sha256``), on one torch thread
(the default). Like the live trainer, the version starts at ``initial_version`` and goes up
by one per step; with ``max_staleness`` the groups whose oldest sample lags more than that
are left out (a batch left with nothing is skipped), and ``trained_only`` feeds only the
batches a trainer of the log accepted. ``write_outputs`` writes ``batch_ids.txt`` (one id a
line, in training order), ``result.json`` (ids, per-step and final metrics, the weights'
hash) and the final weights under ``model/``. A batch with bad values (``TrainData``'s checks, ids
outside the model's vocabulary) raises ``DecodeError`` and a step the learner refuses raises
``NonFiniteStep``, both naming the batch: an offline run never goes on to write poisoned weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from rollout_bus.events.errors import DecodeError, InvalidRequest
from rollout_bus.events.train_data import TrainData
from rollout_bus.lm.hf import is_hf_dir, save_version
from rollout_bus.lm.model import TinyLM, load_model, save_weights
from rollout_bus.replay.feed import feed_batches, trained_batch_ids
from rollout_bus.trainer.config import ConfigError, LossSettings, OptimConfig
from rollout_bus.trainer.finite import NonFiniteStep
from rollout_bus.trainer.hf_config import HFSettings
from rollout_bus.trainer.hf_learner import HFLearner, load_causal_lm
from rollout_bus.trainer.learner import Learner
from rollout_bus.trainer.staleness import split_stale

log = logging.getLogger(__name__)

RESULT_FILE = "result.json"
BATCH_IDS_FILE = "batch_ids.txt"
MODEL_DIR = "model"
WALL_CLOCK_METRICS = frozenset({"train_ms"})
"""Per-step metrics that measure time, so differ from run to run (everything else is reproducible)."""


@dataclass
class OfflineConfig:
    log: str
    model_path: str
    policy: str | None = None
    """Only this policy's batches; None: every batch of the log."""
    steps: int = 0
    """Stop after this many training steps; 0: every batch."""
    seed: int = 0
    initial_version: int = 0
    max_staleness: int | None = None
    """Leave out groups whose oldest sample is more than this behind the version (None: train every sample)."""
    trained_only: bool = False
    """Only the batches a trainer of the log accepted (its ``BatchConsumed`` events)."""
    torch_threads: int = 1
    verify_checksums: bool = True
    allow_truncated: bool = False
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossSettings = field(default_factory=LossSettings)
    temperature: float = 1.0
    """The rollouts' sampling temperature: log-probs are recomputed at it, as the live trainer does."""
    hf: HFSettings = field(default_factory=lambda: HFSettings(device="cpu"))
    """The learner of a Hugging Face model (``model_path`` a HF directory): micro-batches, LoRA."""

    def validate(self) -> OfflineConfig:
        problems: list[str] = []
        if not Path(self.log).is_file():
            problems.append(f"log {self.log!r} is not a file")
        if not self.model_path:
            problems.append("model_path (the initial weights) is required")
        if self.steps < 0:
            problems.append(f"steps must be >= 0, got {self.steps}")
        if self.initial_version < 0:
            problems.append(f"initial_version must be >= 0, got {self.initial_version}")
        if self.max_staleness is not None and self.max_staleness < 0:
            problems.append(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.torch_threads < 1:
            problems.append(f"torch_threads must be >= 1, got {self.torch_threads}")
        if self.optim.lr <= 0 or self.optim.epochs < 1 or self.optim.minibatches < 1:
            problems.append("optim: lr must be > 0, epochs and minibatches >= 1")
        if not self.temperature > 0:
            problems.append(f"temperature must be > 0, got {self.temperature}")
        try:
            self.hf.validate()
        except InvalidRequest as exc:
            problems.append(str(exc))
        if problems:
            raise ConfigError("invalid offline config:\n  - " + "\n  - ".join(problems))
        return self


@dataclass
class OfflineStep:
    step: int
    batch_id: str
    entry_id: str
    rollout_id: int
    version: int
    """The version after this step."""
    metrics: dict[str, float]


@dataclass
class OfflineResult:
    log: str
    policy: str | None
    seed: int
    batch_ids: list[str]
    """Trained batches, in training order."""
    steps: list[OfflineStep]
    skipped: list[str]
    """Batches fed but not trained (every group too stale)."""
    version: int
    weights_sha256: str
    final_metrics: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return _finite(asdict(self))


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer: name, dtype, shape and raw bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


StepHook = Callable[[OfflineStep], None]


def run_offline(config: OfflineConfig, *, on_step: StepHook | None = None) -> tuple[OfflineResult, Any]:
    """Train on the log's batches; returns the result and the trained model (a ``TinyLM``, a Hugging Face
    model, or a ``PeftModel`` with ``hf.lora``)."""
    cfg = config.validate()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.torch_threads)
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
            torch.manual_seed(cfg.seed)
            return _train(cfg, on_step)
    finally:
        torch.set_num_threads(threads)


def _learner(cfg: OfflineConfig) -> tuple[Any, Learner | HFLearner]:
    if is_hf_dir(cfg.model_path):
        settings = replace(cfg.hf, temperature=cfg.temperature)
        hf_learner = HFLearner(load_causal_lm(cfg.model_path), cfg.optim, cfg.loss, settings)
        return hf_learner.model, hf_learner
    model = load_model(cfg.model_path)
    return model, Learner(model, cfg.optim, cfg.loss, temperature=cfg.temperature)


def _train(cfg: OfflineConfig, on_step: StepHook | None) -> tuple[OfflineResult, Any]:
    model, learner = _learner(cfg)
    vocab = int(model.get_input_embeddings().num_embeddings if hasattr(model, "get_input_embeddings")
                else model.tok_emb.num_embeddings)
    only = set(trained_batch_ids(cfg.log, policy=cfg.policy, allow_truncated=cfg.allow_truncated)) \
        if cfg.trained_only else None
    version = cfg.initial_version
    steps: list[OfflineStep] = []
    skipped: list[str] = []
    feed = feed_batches(cfg.log, policy=cfg.policy, verify=cfg.verify_checksums,
                        allow_truncated=cfg.allow_truncated, only=only)
    try:
        for batch_id, fields, meta in feed:
            ready = meta.pop("batch_ready")
            try:
                data = TrainData.from_tensors(fields, meta)
                data.check_vocab(vocab)
            except DecodeError as exc:
                raise DecodeError(f"batch {batch_id}: {exc.reason}") from None
            split = split_stale(data, version, cfg.max_staleness)
            if split.fresh is None:
                log.info("batch %s is entirely stale at version %d: skipped", batch_id, version)
                skipped.append(batch_id)
                continue
            fresh = split.fresh
            staleness = version - fresh.weight_versions
            try:
                metrics = learner.train_step(fresh)
            except NonFiniteStep as exc:
                raise NonFiniteStep(f"batch {batch_id}: {exc}") from None
            if not metrics.get("skipped_no_signal"):  # no signal: no optimiser step, no new version (as live)
                version += 1
            metrics.update(
                reward_mean=float(fresh.raw_reward.mean()), n_samples=float(len(fresh)),
                n_samples_batch=float(len(data)), stale_samples=float(split.stale_samples),
                staleness_max=float(staleness.max()), staleness_mean=float(staleness.float().mean()))
            step = OfflineStep(len(steps) + 1, batch_id, str(ready["entry_id"]), int(ready["rollout_id"]),
                               version, metrics)
            steps.append(step)
            log.info("step %d: batch %s, %d samples, reward %.3f, loss %.4f", step.step, batch_id,
                     len(fresh), metrics["reward_mean"], metrics.get("loss", 0.0))
            if on_step is not None:
                on_step(step)
            if cfg.steps and len(steps) >= cfg.steps:
                break
    finally:
        feed.close()  # closes the log file when the loop stops early
    result = OfflineResult(
        log=str(cfg.log), policy=cfg.policy, seed=cfg.seed, batch_ids=[s.batch_id for s in steps], steps=steps,
        skipped=skipped, version=version, weights_sha256=weights_sha256(model),
        final_metrics=_final_metrics(steps))
    return result, model


def _final_metrics(steps: list[OfflineStep]) -> dict[str, float]:
    if not steps:
        return {"steps": 0.0, "samples": 0.0}
    last = dict(steps[-1].metrics)
    rewards = [s.metrics["reward_mean"] for s in steps]
    return {**last, "steps": float(len(steps)), "samples": sum(s.metrics["n_samples"] for s in steps),
            "reward_first": rewards[0], "reward_last": rewards[-1], "reward_mean_all": sum(rewards) / len(rewards)}


def write_outputs(result: OfflineResult, model: Any, out: str | Path, *, tokenizer: Any = None) -> Path:
    """``batch_ids.txt``, ``result.json`` and ``model/`` under ``out`` (a HF model's ``save_pretrained``,
    with ``tokenizer``; a LoRA adapter alone); returns the directory."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / BATCH_IDS_FILE).write_text("".join(f"{b}\n" for b in result.batch_ids))
    if isinstance(model, TinyLM):
        save_weights(model, directory / MODEL_DIR)
    else:
        save_version(directory / MODEL_DIR, model, tokenizer, replace=True)
    (directory / RESULT_FILE).write_text(json.dumps(result.to_dict(), indent=2, sort_keys=True) + "\n")
    return directory


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
