"""The trainer's configuration: validated dataclasses, no heavy imports.

``rollout-bus trainer`` (``trainer.cli``) builds a ``TrainerConfig`` from its flags before it imports torch
or anything that talks to Redis, so ``--help`` and config errors are instant. ``validate``
reports every problem at once.
"""

from __future__ import annotations

import importlib.util
import socket
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from rollout_bus.events.errors import InvalidRequest
from rollout_bus.events.names import DEFAULT_NAMESPACE, check_name
from rollout_bus.trainer.hf_config import HFSettings

Mode = Literal["sync", "one-step", "async"]
StalePolicy = Literal["drop", "requeue"]
DataParallel = Literal["shared-group", "shards"]
LogBackend = Literal["jsonl", "tensorboard", "wandb"]
OffPolicy = Literal["tis", "mis", "decoupled"]
MODES: tuple[str, ...] = get_args(Mode)
STALE_POLICIES: tuple[str, ...] = get_args(StalePolicy)
DP_STRATEGIES: tuple[str, ...] = get_args(DataParallel)
LOG_BACKENDS: tuple[str, ...] = get_args(LogBackend)
OFF_POLICIES: tuple[str, ...] = get_args(OffPolicy)
OFF_POLICY_HELP: dict[str, str] = {
    "tis": "truncated importance sampling: each token weighted by min(trainer/behaviour ratio, C) (the default)",
    "mis": "masked importance sampling: tokens whose trainer/behaviour ratio leaves [1/C, C] get weight 0 "
           "(the share masked is logged per step)",
    "decoupled": "AReaL's decoupled PPO: the clip is taken against the proximal policy (the previous version, "
                 "recomputed at train time), weighted by min(proximal/behaviour ratio, C)",
}
"""What each ``--off-policy`` choice does, in one line (``C`` is ``--tis-cap``)."""
BACKEND_EXTRAS: dict[str, tuple[str, str]] = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}
"""Backend -> (the module it needs, the extra of this package that installs it)."""


class ConfigError(InvalidRequest):
    """The trainer configuration is invalid; the message lists every problem."""


@dataclass
class RolloutConfig:
    """What each rollout request asks the executors for."""

    n_groups: int = 16
    n_samples_per_group: int = 8
    max_new_tokens: int = 6
    temperature: float = 1.0
    std_normalise: bool = False
    """Divide each group's advantages by its reward std (GRPO's normalisation). Off by default, as
    everywhere in the project (``RolloutRequest``, ``to_train_data``): the division erases the reward's
    scale, so a shaped ``[0.2, 0, 0, 0]`` would get the same advantages as ``[1, 0, 0, 0]``."""
    over_sample_groups: int | None = None
    """Prompt groups the executors draw per sampling round (>= ``n_groups``; with a dynamic filter, extra ones
    replace the groups it leaves out); None: ``n_groups``."""
    timeout_s: float = 120.0
    """A request without a batch after this long is asked again under a new request id."""
    data: dict[str, Any] = field(default_factory=dict)
    stop_token_ids: tuple[int, ...] = ()
    """Ids that end a response; empty: the tiny LM's EOS (a HF model's trainer sets its tokenizer's)."""
    """Options for the executors' data source."""


@dataclass
class ScheduleConfig:
    """How requests and training steps interleave (see DESIGN.md section 2)."""

    mode: str = "async"
    in_flight: int = 2
    """Fully async: requests kept in flight."""
    max_staleness: int = 1
    """Fully async: samples whose oldest weight version is more than this behind the trainer are not trained."""
    stale_policy: str = "drop"
    """``drop`` stale groups, or ``requeue`` their prompts (they come back in a later rollout)."""
    colocate: bool = False
    """Sync mode only: the policy's engines release their weights and KV cache while the trainer steps, and
    get them back (weights, then KV cache) before the next rollout (``trainer.colocate``)."""


WEIGHT_SYNCS = ("disk", "broadcast")
"""Where full weights travel from the trainer to the engines (``PublishConfig.weight_sync``)."""


@dataclass
class PublishConfig:
    """Where new weights go and whether a step waits until the engines serve them."""

    weights_root: str = ""
    wait_serving: bool | None = None
    """None: wait in sync and one-step mode, go on in async mode."""
    serving_timeout_s: float = 60.0
    keep_versions: int = 4
    """Published weight directories kept on disk (older ones are deleted); 0 keeps all."""
    weight_sync: str = "disk"
    """``disk``: engines load each version from its directory. ``broadcast``: the trainer also offers full
    weights by collective (``trainer.broadcast``: rank 0 of the engines' weight-update group); the directory is
    still written, as the fallback. LoRA adapters always travel by disk."""
    group_host: str = "127.0.0.1"
    """broadcast: the address the engines reach the trainer's rendezvous store at (it listens there)."""
    group_port: int = 0
    """broadcast: the store's port; 0 picks a free one."""
    bucket_mb: float = 64.0
    """broadcast: tensors per ``/update_weights_from_distributed`` call, by size."""
    group_timeout_s: float = 60.0
    """broadcast: how long the sender waits for a group to form, or for a rank in a broadcast."""
    group_keep: int = 3
    """broadcast: versions the sender holds in memory for the controller's requests (the newest ones)."""


@dataclass
class OptimConfig:
    lr: float = 5e-4
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    epochs: int = 1
    """Passes over each batch."""
    minibatches: int = 1
    """Optimiser steps per pass (the PPO clip matters once there is more than one step per batch)."""


@dataclass
class LossSettings:
    tis_cap: float = 2.0
    ppo_clip: float | None = 0.2
    entropy_coef: float = 0.0
    """Weight of the entropy bonus in the loss (0: the policy-gradient term alone)."""
    off_policy: str = "tis"
    """The off-policy correction, of ``OFF_POLICIES`` (``trainer.grpo``)."""

    def problems(self) -> list[str]:
        out = []
        if self.tis_cap < 0:
            out.append(f"loss.tis_cap must be >= 0 (0 disables it), got {self.tis_cap}")
        if self.off_policy not in OFF_POLICIES:
            out.append(f"loss.off_policy {self.off_policy!r} is not one of {list(OFF_POLICIES)}")
        elif self.off_policy == "mis" and not self.tis_cap > 1:
            out.append(f"off-policy mis keeps the ratios in [1/C, C]: the cap C (--tis-cap) must be > 1, "
                       f"got {self.tis_cap}")
        elif self.off_policy == "decoupled":
            if not self.tis_cap > 0:
                out.append(f"off-policy decoupled weights each token by min(proximal/behaviour, C): the cap C "
                           f"(--tis-cap) must be > 0, got {self.tis_cap}")
            if self.ppo_clip is None:
                out.append("off-policy decoupled clips against the proximal policy: it needs the PPO clip "
                           "(--ppo-clip > 0)")
        return out


@dataclass
class LogConfig:
    """Where each step's training metrics go (``trainer.metric_loggers``)."""

    to: list[str] = field(default_factory=lambda: ["jsonl"])
    """Backends, from ``LOG_BACKENDS``; jsonl is always among them."""
    dir: str = ""
    """Root of the metric logs; empty: none are written (``rollout-bus trainer`` defaults to ``runs``)."""
    run_name: str = ""
    """Name of the run; the policy is appended (``<run_name>-<policy>``). Empty: the namespace."""
    wandb_project: str = "rollout-bus"


def parse_log_to(spec: str) -> list[str]:
    """``"tensorboard,wandb"`` -> ``["jsonl", "tensorboard", "wandb"]``: jsonl always, each backend once."""
    chosen = ["jsonl"]
    for name in (part.strip() for part in spec.split(",")):
        if name and name not in chosen:
            chosen.append(name)
    return chosen


def log_problems(log: LogConfig) -> list[str]:
    """What is wrong with ``log``: unknown backends, and backends whose package is not installed."""
    problems = []
    for backend in log.to:
        if backend not in LOG_BACKENDS:
            problems.append(f"log backend {backend!r} is not one of {list(LOG_BACKENDS)}")
        elif backend in BACKEND_EXTRAS and importlib.util.find_spec(BACKEND_EXTRAS[backend][0]) is None:
            module, extra = BACKEND_EXTRAS[backend]
            problems.append(f"--log-to {backend} needs the {module!r} package: pip install 'rollout-bus[{extra}]'")
    if log.run_name:
        try:
            check_name("run name", log.run_name)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


@dataclass
class TrainerConfig:
    """Everything one trainer (one policy, one consumer group) needs."""

    policy: str = "default"
    trainer_id: str = "trainer-0"
    namespace: str = DEFAULT_NAMESPACE
    redis_url: str | None = None
    shards: list[str] = field(default_factory=list)
    """Every Redis primary this trainer spreads its rollouts over, each a whole bus of its own (controller, engines,
    executors: ``trainer.redis_shards``); empty: the one at ``redis_url``."""
    instance: str = field(default_factory=socket.gethostname)
    steps: int = 40
    seed: int = 0
    model_path: str = ""
    """Initial weights: the tiny LM's (config.json + model.safetensors) or a Hugging Face model directory
    (with its tokenizer). A tiny LM resumes from its checkpoint alone; a HF model loads this directory and
    the checkpoint's trained parameters over it."""
    initial_version: int = 0
    checkpoint_dir: str = ""
    """Where the trainer checkpoints after every step; empty: no checkpoints (no resume)."""
    dp_rank: int = 0
    dp_size: int = 1
    dp_strategy: str = "shared-group"
    get_timeout_s: float = 600.0
    """A step that gets no batch for this long fails the run."""
    torch_threads: int = 1
    lease_ttl_s: float = 30.0
    """The policy lease (``trainer.lease``) lapses this long after the trainer stopped renewing it: a trainer
    paused longer than this is deposed, and another may take the policy over."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossSettings = field(default_factory=LossSettings)
    log: LogConfig = field(default_factory=LogConfig)
    hf: HFSettings = field(default_factory=HFSettings)
    """The learner of a Hugging Face model (``model_path`` a HF directory): micro-batches, device, LoRA.
    Its temperature is always the rollouts' (``rollout.temperature``)."""

    @property
    def run_name(self) -> str:
        """The name of this trainer's run in every metric log: ``<run name or namespace>-<policy>``."""
        return f"{self.log.run_name or self.namespace}-{self.policy}"

    @property
    def group(self) -> str:
        """The consumer group: one per trainer, or one per rank when ranks take shards."""
        if self.dp_strategy == "shards" and self.dp_size > 1:
            return f"{self.trainer_id}-rank{self.dp_rank}"
        return self.trainer_id

    @property
    def wait_serving(self) -> bool:
        if self.publish.wait_serving is not None:
            return self.publish.wait_serving
        return self.schedule.mode != "async"

    def validate(self) -> TrainerConfig:
        """Return ``self`` or raise ``ConfigError`` naming every invalid setting."""
        problems: list[str] = []
        for kind, value in (("policy", self.policy), ("trainer_id", self.trainer_id),
                            ("namespace", self.namespace)):
            try:
                check_name(kind, value)
            except ValueError as exc:
                problems.append(str(exc))
        s = self.schedule
        if s.mode not in MODES:
            problems.append(f"mode {s.mode!r} is not one of {list(MODES)}")
        if s.stale_policy not in STALE_POLICIES:
            problems.append(f"stale_policy {s.stale_policy!r} is not one of {list(STALE_POLICIES)}")
        if s.colocate and s.mode != "sync":
            problems.append(f"colocate needs mode 'sync' (rollouts cannot run while the engines are offloaded), "
                            f"got {s.mode!r}")
        if s.in_flight < 1:
            problems.append(f"in_flight must be >= 1, got {s.in_flight}")
        if s.max_staleness < 0:
            problems.append(f"max_staleness must be >= 0, got {s.max_staleness}")
        if self.dp_strategy not in DP_STRATEGIES:
            problems.append(f"dp_strategy {self.dp_strategy!r} is not one of {list(DP_STRATEGIES)}")
        if self.dp_size < 1 or not 0 <= self.dp_rank < self.dp_size:
            problems.append(f"dp_rank must be in [0, dp_size), got rank {self.dp_rank} of {self.dp_size}")
        r = self.rollout
        for name in ("n_groups", "n_samples_per_group", "max_new_tokens"):
            if getattr(r, name) < 1:
                problems.append(f"rollout.{name} must be >= 1, got {getattr(r, name)}")
        if r.over_sample_groups is not None and r.over_sample_groups < r.n_groups:
            problems.append(f"rollout.over_sample_groups must be >= n_groups ({r.n_groups}), got {r.over_sample_groups}")
        if self.steps < 0:
            problems.append(f"steps must be >= 0, got {self.steps}")
        if not self.publish.weights_root:
            problems.append("publish.weights_root is required (the controller refuses weights outside its root)")
        p = self.publish
        if p.weight_sync not in WEIGHT_SYNCS:
            problems.append(f"publish.weight_sync must be one of {list(WEIGHT_SYNCS)}, got {p.weight_sync!r}")
        if p.weight_sync == "broadcast" and self.schedule.colocate:
            problems.append("publish.weight_sync broadcast does not go with schedule.colocate: released weights are "
                            "read back from their files, which weights received by collective do not update")
        if p.bucket_mb <= 0 or p.group_timeout_s <= 0 or not 0 <= p.group_port < 65536 or p.group_keep < 1:
            problems.append("publish: bucket_mb and group_timeout_s must be > 0, group_keep >= 1, group_port a port "
                            "(0: any free one)")
        if self.shards:
            if len(self.shards) < 2 or len(set(self.shards)) != len(self.shards):
                problems.append(f"shards: name two or more different Redis urls, got {self.shards}")
            if p.weight_sync != "disk" or self.schedule.colocate or self.dp_size != 1:
                problems.append("shards: weights go by disk (weight_sync disk), without colocation and with one "
                                "data-parallel rank (every shard's engines read the same version directory)")
        if self.optim.lr <= 0 or self.optim.epochs < 1 or self.optim.minibatches < 1:
            problems.append("optim: lr must be > 0, epochs and minibatches >= 1")
        problems += self.loss.problems()
        if self.initial_version < 0:
            problems.append(f"initial_version must be >= 0, got {self.initial_version}")
        if self.lease_ttl_s <= 0:
            problems.append(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if self.get_timeout_s <= 0 or r.timeout_s <= 0 or self.publish.serving_timeout_s <= 0:
            problems.append("timeouts must be > 0")
        problems += log_problems(self.log)
        try:
            self.hf.validate()
        except InvalidRequest as exc:
            problems.append(str(exc))
        if problems:
            raise ConfigError("invalid trainer config:\n  - " + "\n  - ".join(problems))
        return self
