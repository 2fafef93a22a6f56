"""Each training step's metrics, written through one interface to JSONL, TensorBoard and W&B.

``StepLogger`` is what the reference trainer holds: it opens one ``MetricLogger`` per
backend of ``TrainerConfig.log`` (``--log-to jsonl,tensorboard,wandb``; jsonl always),
turns what a step measured into a ``StepRecord`` (``step_record``: the names below) and
hands it to every backend. Under ``log.dir``, for the run ``<run name>-<policy>``:

- jsonl: ``<dir>/<run>.jsonl``, one JSON object per step (``StepRecord.to_json``);
- tensorboard: ``<dir>/tensorboard/<run>/`` (``torch.utils.tensorboard``; extra ``[tensorboard]``),
  the scalars by name and the staleness histogram as ``staleness``;
- wandb: ``<dir>/wandb/`` (extra ``[wandb]``), run id and name ``<run>``, grouped by the run
  name, the trainer config as its config. Offline unless ``WANDB_MODE`` or ``WANDB_API_KEY``
  says otherwise (``wandb sync`` uploads an offline run later).

A restarted trainer appends to the same JSONL file and TensorBoard run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rollout_bus.events.schema import STALENESS_PREFIX
from rollout_bus.trainer.config import BACKEND_EXTRAS, ConfigError, TrainerConfig

log = logging.getLogger(__name__)

STEP_SCALARS: dict[str, str] = {
    "reward/mean": "mean raw reward of the trained samples",
    "reward/std": "standard deviation of that reward",
    "loss/total": "the loss minimised: policy-gradient term plus entropy term",
    "loss/policy_gradient": "GRPO surrogate with truncated importance sampling (and the PPO clip)",
    "loss/entropy": "entropy bonus, -entropy_coef x policy/entropy (0 with the default coefficient)",
    "policy/entropy": "mean entropy (nats) of the policy's next-token distribution on the response tokens",
    "offpolicy/tis_truncated_frac": "share of response tokens whose importance weight hit the TIS cap",
    "offpolicy/is_masked_frac": "share of response tokens masked by --off-policy mis (ratio outside [1/C, C])",
    "offpolicy/ppo_clipped_frac": "share of response tokens the PPO clip bounded",
    "offpolicy/is_weight_mean": "mean importance weight (trainer over rollout policy) before truncation",
    "offpolicy/rollout_kl": "mean of rollout log-prob minus trainer log-prob on the response tokens",
    "optim/grad_norm": "gradient norm before clipping (last optimiser step)",
    "optim/skipped_no_signal": "1 when the batch had no signal (every advantage 0): no optimiser step, no new version",
    "throughput/samples_per_s": "samples trained per second since the previous step",
    "throughput/tokens_per_s": "response tokens trained per second since the previous step",
    "staleness/mean": "mean versions behind of the trained samples",
    "staleness/max": "most versions behind of a trained sample",
    "time/batch_wait_s": "waiting for the step's batch",
    "time/update_s": "the GRPO update (forward, backward, optimiser)",
    "time/serving_wait_s": "waiting until the engines served the new version (0 when the step does not wait)",
    "time/weight_publish_s": "writing the new version's weights file and announcing it (WeightsPublished)",
    "batch/samples": "samples trained",
    "batch/tokens": "response tokens trained",
}
"""Every scalar of every step, by name, with what it means."""

STALENESS_HISTOGRAM = "staleness"
"""The per-step histogram: trained samples by versions behind."""

_FROM_METRICS: dict[str, str] = {
    "reward/mean": "reward_mean", "reward/std": "reward_std", "loss/total": "loss",
    "loss/policy_gradient": "pg_loss", "loss/entropy": "entropy_loss", "policy/entropy": "entropy",
    "offpolicy/tis_truncated_frac": "is_truncated_frac", "offpolicy/is_masked_frac": "is_masked_frac",
    "offpolicy/ppo_clipped_frac": "ppo_clipped_frac",
    "offpolicy/is_weight_mean": "is_weight_mean", "offpolicy/rollout_kl": "rollout_kl",
    "optim/grad_norm": "grad_norm", "optim/skipped_no_signal": "skipped_no_signal", "staleness/mean": "staleness_mean", "staleness/max": "staleness_max",
    "batch/samples": "n_samples", "batch/tokens": "response_tokens",
}
_MS_FROM_METRICS: dict[str, tuple[str, ...]] = {
    "time/batch_wait_s": ("wait_ms",), "time/update_s": ("train_ms",), "time/serving_wait_s": ("serving_wait_ms",),
    "time/weight_publish_s": ("weights_save_ms", "publish_ms"),
}


@dataclass
class StepRecord:
    """One step's metrics, as every backend writes them."""

    step: int
    weight_version: int
    time_s: float
    """Wall-clock time (Unix seconds) the step was done."""
    scalars: dict[str, float]
    staleness: dict[int, int] = field(default_factory=dict)
    """Trained samples by versions behind."""

    def to_json(self, run: str, policy: str) -> dict[str, Any]:
        return {"run": run, "policy": policy, "step": self.step, "weight_version": self.weight_version,
                "time": self.time_s, "metrics": {k: _finite(v) for k, v in self.scalars.items()},
                "staleness_hist": {str(k): n for k, n in sorted(self.staleness.items())}}


OPTIONAL_SCALARS: dict[str, str] = {"answers/correct_frac": "correct_frac", "answers/formatted_frac": "formatted_frac",
                                    "rollout/groups_filtered": "groups_filtered", "time/checkpoint_s": "checkpoint_s"}
"""Logged when the batch's reward judges answers (the executors' counts, e.g. ``tasks.math_reward``), when
the executors' dynamic filter ran: the prompt groups it left out of the batch (all rewards equal), and when the
trainer checkpoints: the seconds its checkpoint (model, optimiser, state) took after the step."""

NEEDED_METRICS: tuple[str, ...] = (*_FROM_METRICS.values(), *(k for ks in _MS_FROM_METRICS.values() for k in ks))
"""The keys of the trainer's metrics dict a ``StepRecord`` is made of."""


def step_record(step: int, weight_version: int, metrics: dict[str, float], interval_s: float,
                time_s: float | None = None) -> StepRecord:
    """The ``StepRecord`` of a trainer step from its metrics dict (``Trainer``'s keys) and its duration."""
    missing = [key for key in NEEDED_METRICS if key not in metrics]
    if missing:
        raise KeyError(f"step {step}: the trainer's metrics lack {missing}")
    scalars = {name: float(metrics[key]) for name, key in _FROM_METRICS.items()}
    scalars.update({name: sum(float(metrics[k]) for k in keys) / 1000 for name, keys in _MS_FROM_METRICS.items()})
    per_s = 1 / interval_s if interval_s > 0 else math.nan
    scalars["throughput/samples_per_s"] = scalars["batch/samples"] * per_s
    scalars["throughput/tokens_per_s"] = scalars["batch/tokens"] * per_s
    staleness = {int(k[len(STALENESS_PREFIX):]): int(v) for k, v in metrics.items() if k.startswith(STALENESS_PREFIX)}
    record = {name: scalars[name] for name in STEP_SCALARS}
    record.update({name: float(metrics[key]) for name, key in OPTIONAL_SCALARS.items() if key in metrics})
    return StepRecord(step, weight_version, time.time() if time_s is None else time_s, record, staleness)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


# --- backends ----------------------------------------------------------------------------------

class MetricLogger(Protocol):
    """A place step records go."""

    backend: str
    location: Path
    """Where this backend's output is (a file or a directory)."""

    def log(self, record: StepRecord) -> None: ...

    def close(self) -> None: ...


class JsonlLogger:
    """``<dir>/<run>.jsonl``: one line per step, appended and flushed at once."""

    backend = "jsonl"

    def __init__(self, directory: Path, run: str, policy: str) -> None:
        self.location = directory / f"{run}.jsonl"
        self.run, self.policy = run, policy
        self.location.parent.mkdir(parents=True, exist_ok=True)
        self.last_step = last_logged_step(self.location)
        """The last step the file holds (0: none), so a restarted trainer knows what it logged."""
        cut = _ends_mid_line(self.location)
        self._file = self.location.open("a", encoding="utf-8")
        if cut:
            self._file.write("\n")  # a line cut by a crash stays on its own

    def log(self, record: StepRecord) -> None:
        self._file.write(json.dumps(record.to_json(self.run, self.policy), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardLogger:
    """``<dir>/tensorboard/<run>/``: scalars by name, the staleness histogram, the config as text."""

    backend = "tensorboard"

    def __init__(self, directory: Path, run: str, config: dict[str, Any]) -> None:
        writer_cls = _import_backend("tensorboard", "torch.utils.tensorboard").SummaryWriter
        self.location = directory / "tensorboard" / run
        self._writer = writer_cls(log_dir=str(self.location))
        self._writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")

    def log(self, record: StepRecord) -> None:
        import numpy as np

        for name, value in record.scalars.items():
            self._writer.add_scalar(name, value, record.step, walltime=record.time_s)
        if record.staleness:
            values = np.repeat(np.array(list(record.staleness), dtype=np.float64),
                               np.array(list(record.staleness.values())))
            bins = np.arange(-0.5, max(record.staleness) + 1.0, 1.0)
            self._writer.add_histogram(STALENESS_HISTOGRAM, values, record.step, bins=bins,
                                       walltime=record.time_s)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A W&B run under ``<dir>/wandb/``: id and name ``<run>``, grouped by the run name."""

    backend = "wandb"

    def __init__(self, directory: Path, run: str, group: str, project: str, config: dict[str, Any]) -> None:
        wandb = _import_backend("wandb", "wandb")
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        if not os.environ.get("WANDB_MODE") and mode == "offline":
            log.info("W&B logs offline (set WANDB_MODE=online or WANDB_API_KEY to sync as it goes; "
                     "`wandb sync` uploads it later)")
        directory.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self._run = wandb.init(project=project, name=run, id=wandb_run_id(run), group=group, dir=str(directory),
                               config=config, mode=mode)
        self.location = Path(self._run.dir).parent if self._run.dir else directory / "wandb"

    def log(self, record: StepRecord) -> None:
        import numpy as np

        data: dict[str, Any] = dict(record.scalars)
        data["weight_version"] = record.weight_version
        if record.staleness:
            top = max(record.staleness)
            counts = np.array([record.staleness.get(s, 0) for s in range(top + 1)], dtype=np.float64)
            data[STALENESS_HISTOGRAM] = self._wandb.Histogram(np_histogram=(counts, np.arange(-0.5, top + 1.0, 1.0)))
        self._run.log(data, step=record.step)

    def close(self) -> None:
        self._run.finish()


def _ends_mid_line(path: Path) -> bool:
    if not path.exists() or path.stat().st_size == 0:
        return False
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) != b"\n"


def last_logged_step(path: Path, tail_bytes: int = 1 << 16) -> int:
    """The step of the last complete line of a JSONL metric log (0 when there is none)."""
    if not path.exists():
        return 0
    with path.open("rb") as f:
        f.seek(max(0, f.seek(0, 2) - tail_bytes))
        lines = f.read().splitlines()
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def wandb_run_id(run: str) -> str:
    """The W&B run id of ``run`` (W&B ids take letters, digits, '-' and '_')."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", run)


def _import_backend(backend: str, module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        needed, extra = BACKEND_EXTRAS[backend]
        raise ConfigError(f"--log-to {backend} needs the {needed!r} package: pip install 'rollout-bus[{extra}]' "
                          f"({exc})") from None


def logged_config(config: TrainerConfig) -> dict[str, Any]:
    """The trainer config as TensorBoard and W&B record it: without the Redis URL (it may hold a password)."""
    settings = dataclasses.asdict(config)
    settings.pop("redis_url", None)
    return settings


def open_loggers(config: TrainerConfig) -> list[MetricLogger]:
    """One logger per backend of ``config.log``; none when ``config.log.dir`` is empty."""
    if not config.log.dir:
        return []
    directory, run = Path(config.log.dir), config.run_name
    settings = logged_config(config)
    loggers: list[MetricLogger] = []
    try:
        for backend in config.log.to:
            if backend == "jsonl":
                loggers.append(JsonlLogger(directory, run, config.policy))
            elif backend == "tensorboard":
                loggers.append(TensorBoardLogger(directory, run, settings))
            elif backend == "wandb":
                loggers.append(WandbLogger(directory, run, config.log.run_name or config.namespace,
                                           config.log.wandb_project, settings))
            else:
                raise ConfigError(f"log backend {backend!r} is unknown")
    except BaseException:
        for opened in loggers:
            opened.close()
        raise
    return loggers


class StepLogger:
    """The trainer's side: one ``StepRecord`` per step to every backend; the step's duration for throughput."""

    def __init__(self, config: TrainerConfig) -> None:
        self.loggers = open_loggers(config)
        self._since = time.monotonic()
        self.last_step = max((lg.last_step for lg in self.loggers if isinstance(lg, JsonlLogger)), default=0)
        """The last step logged before this process (from the JSONL file)."""
        for logger in self.loggers:
            log.info("metrics of %s: %s -> %s", config.run_name, logger.backend, logger.location)

    @property
    def outputs(self) -> dict[str, str]:
        return {logger.backend: str(logger.location) for logger in self.loggers}

    def step(self, step: int, weight_version: int, metrics: dict[str, float],
             interval_s: float | None = None) -> StepRecord | None:
        """Log one step; its duration is the time since the last one unless ``interval_s`` says it."""
        if not self.loggers:
            return None
        now = time.monotonic()
        record = step_record(step, weight_version, metrics, now - self._since if interval_s is None else interval_s)
        self._since = now
        for logger in self.loggers:
            logger.log(record)
        self.last_step = max(self.last_step, step)
        return record

    def close(self) -> None:
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            try:
                logger.close()
            except Exception as exc:  # the other backends still get closed
                log.warning("closing the %s metric log failed: %s", logger.backend, exc)


def output_paths(log_dir: str | Path, run: str, backends: list[str]) -> dict[str, Path]:
    """Where each backend of ``run`` writes under ``log_dir`` (W&B: its run directory once it exists)."""
    directory = Path(log_dir)
    out: dict[str, Path] = {}
    for backend in backends:
        if backend == "jsonl":
            out[backend] = directory / f"{run}.jsonl"
        elif backend == "tensorboard":
            out[backend] = directory / "tensorboard" / run
        elif backend == "wandb":
            found = sorted((directory / "wandb").glob(f"*run-*-{wandb_run_id(run)}"))
            out[backend] = found[-1] if found else directory / "wandb"
    return out
