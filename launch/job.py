"""The main job: a private Redis (unless one is given), the warm start, then every role as a process.

``run_job`` starts the controller (which launches the engines), the executors and one
trainer per policy, each as ``python -m rollout_bus <role>`` under supervision (a dead one
is started again, with backoff, within a restart budget; engines are the controller's
job), follows the trainers' events with a progress bar, writes ``<out>/summary.json`` and
``<out>/reward.png``, exports the event log when asked (``log_events``: payloads held from
the start, written before Redis stops), and stops everything it started, by pid, on exit,
on error and on Ctrl-C.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rollout_bus.launch.config import RunConfig, RunFailed, RunResult, metrics_ports

log = logging.getLogger(__name__)

ROLE = ["-m", "rollout_bus"]
"""How a child process runs a role: ``python -m rollout_bus <role> ...``."""


@dataclass
class RunHandle:
    """What ``run_job``'s ``on_start`` hook sees once every role is started (for tests and tools)."""

    procs: Any
    """The run's ``launch.procs.ProcessSet``."""
    keys: Any
    url: str
    fleet: Any = None
    """The run's ``launch.fleet.ExecutorFleet`` (``--executors auto``), else None."""


def run_job(config: RunConfig, *, on_start: Callable[[RunHandle], None] | None = None,
            place: Callable[[str], list[str]] | None = None) -> RunResult:
    """Run the whole system for ``config``; stops everything it started before it returns or raises.

    ``place``: a command prefix per role name (``controller``, ``executor-0``, ``trainer-p0``...) that
    runs it on another host or in a network namespace (see ``launch.procs.ProcessSet.place``)."""
    from rollout_bus.events.connection import connect, redis_url
    from rollout_bus.events.embedded import private_redis
    from rollout_bus.events.epoch import check_interval_s, create_epoch
    from rollout_bus.events.errors import InvalidRequest
    from rollout_bus.events.names import Keys
    from rollout_bus.events.publish import dedupe_ttl_from_env
    from rollout_bus.launch.placement import PlacementError, PlacementRecord, pin_process, plan
    from rollout_bus.launch.procs import ProcessSet, RestartPolicy, signals_deferred
    from rollout_bus.launch.report import format_outputs, format_summary, plot_rewards, run_faults
    from rollout_bus.launch.shards import ShardWatch, shard_problems, split_urls
    from rollout_bus.tasks.warmstart import WarmStartConfig, warm_start_cached
    from rollout_bus.trainer.config import parse_log_to
    from rollout_bus.trainer.metric_loggers import output_paths

    try:  # settings every role reads from the environment it inherits: a bad one fails the run before it starts
        check_interval_s()
        dedupe_ttl_from_env()
    except InvalidRequest as exc:
        raise RunFailed(f"bad environment: {exc}") from None
    url = config.redis_url or os.environ.get("REDIS_URL")
    try:
        given = split_urls(url) if url else []
    except ValueError as exc:
        raise RunFailed(str(exc)) from None
    if len(given) > 1 and config.shards not in (1, len(given)):
        raise RunFailed(f"--shards {config.shards} with {len(given)} Redis urls: give as many urls as shards, or none "
                        "(each shard then gets a private redis-server)")
    if len(given) == 1 and config.shards > 1:
        raise RunFailed(f"--shards {config.shards} with one Redis url: give {config.shards} urls (A,B,...), or none "
                        "(each shard then gets a private redis-server)")
    n_shards = max(config.shards, len(given))
    problems = shard_problems(config, n_shards)
    if problems:
        raise RunFailed("; ".join(problems))
    try:
        placement = plan(config.placement, engine_cpus=config.engine_cpus, trainer_cpus=config.trainer_cpus,
                         engines=_engine_count(config) * n_shards, trainers=config.trainers,
                         light_cpus=config.light_cpus)
    except PlacementError as exc:
        raise RunFailed(str(exc)) from None
    placed = PlacementRecord(placement)
    started = time.monotonic()
    out = Path(config.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("checkpoints", "weights", "logs", "recording", "metrics", "redis"):  # a run starts afresh
        shutil.rmtree(out / stale, ignore_errors=True)
    namespace = config.namespace or f"run-{uuid.uuid4().hex[:8]}"
    keys = Keys(namespace)
    servers: list[Any] = []
    if not given:  # its append-only file lives in the run directory: a crash of the server loses at most ~1 s
        for shard in range(n_shards):
            data = out / ("redis" if shard == 0 else f"redis-s{shard}")
            if config.redis_aof:
                data.mkdir()
            servers.append(private_redis(data if config.redis_aof else None, appendonly=config.redis_aof))
            redis_proc = getattr(servers[-1], "proc", None)  # a fakeredis fallback runs in this process
            if redis_proc is not None:
                redis_cpus = placement.cpus("redis-server")
                if redis_cpus is not None:
                    pin_process(redis_proc.pid, redis_cpus)
                placed.observe("redis-server" if shard == 0 else f"redis-server-s{shard}", redis_proc.pid)
        given = [s.url for s in servers]
    url, shard_urls = redis_url(given[0]), [redis_url(u) for u in given[1:]]
    watch = ShardWatch([url, *shard_urls], None) if shard_urls else None
    procs = ProcessSet(out / "logs", env={"ROLLOUT_BUS_NAMESPACE": namespace, "REDIS_URL": url}, place=place,
                       placement=placement)
    if watch is not None:
        watch.procs = procs
    service = RestartPolicy(budget=config.restart_budget)
    client = connect(url)
    policies = config.policies()
    holding = False
    tracker = None
    try:
        epoch = create_epoch(client, keys)  # before any role: each checks it, and so does _follow
        if config.agent is not None:
            init, task = _agent_setup(config, out)
        elif config.model is not None:
            init = resolve_model(config.model)
            task = task_options(config, init)
            check_context(init, task, config.max_new_tokens)
        else:
            warm = WarmStartConfig(steps=config.warm_steps, keep=config.warm_keep, digits=config.digits,
                                   seed=config.seed)
            init = warm_start_cached(Path(config.init_dir) if config.init_dir else out / "init", warm)
            task = {"digits": config.digits, "seed": config.seed}
        weights_root = out / "weights"
        weights_root.mkdir(exist_ok=True)
        ports = metrics_ports(config)
        if config.log_events:  # before any batch exists: every payload waits for the export
            from rollout_bus.replay.exporter import hold_payloads

            hold_payloads(client, keys, policies)
            holding = True
        if placement.disaggregated and placement.light_cpus is not None:
            print(f"placement disaggregated: engines and controller on CPUs {list(placement.engine_cpus)}, "
                  f"executors and redis on CPUs {list(placement.light_cpus)}, trainers on CPUs "
                  f"{list(placement.trainer_cpus)}", flush=True)
        elif placement.disaggregated:
            print(f"placement disaggregated: engines, controller, executors and redis on CPUs "
                  f"{list(placement.engine_cpus)}, trainers on CPUs {list(placement.trainer_cpus)}"
                  + (f" (GPUs {placement.engine_gpus} / {placement.trainer_gpus})" if placement.trainer_gpus else ""),
                  flush=True)
        if ports:
            procs.start("bus-metrics", [*ROLE, "status", "--redis-url", url, "--namespace", namespace,
                                        "--serve-metrics", str(ports["bus-metrics"])], restart=service)
            print("metrics:\n" + "\n".join(f"  {name:<12} http://127.0.0.1:{port}/metrics"
                                            for name, port in ports.items()), flush=True)

        def start_controller(name: str, at: str, metrics: list[str], logs: Path) -> Any:  # its engines log there too
            return procs.start(name, [
                *ROLE, "controller", "--redis-url", at, "--namespace", namespace,
                "--num-engines", str(config.engines), "--model-path", str(init), "--weights-root", str(weights_root),
                "--base-policy", config.base_policy(), "--seed", str(config.seed), "--log-dir", str(logs),
                *_pool_args(config), "--token-delay-ms", str(config.token_delay_ms), "--log-level", "INFO",
                *(["--eval-engines", str(config.eval_engines)] if config.eval_engines else []),
                "--engine-arg=--max-batch-size", f"--engine-arg={config.engine_max_batch}",
                *_janitor_args(config), *_health_args(config), *(["--colocate"] if config.colocate else []),
                *(["--engine-arg=--torch-threads", f"--engine-arg={placement.engine_threads}"]
                  if placement.disaggregated else []),
                "--weight-sync", config.weight_sync, *config.controller_args, *metrics],
                restart=service)

        start_controller("controller", url, _metrics_args(ports, "controller"), out / "logs")
        evals_on = config.eval_problems() > 0
        tracker = None

        def start_executor(i: int) -> Any:  # with evals, these serve training rollouts alone
            return procs.start(f"executor-{i}", [*ROLE, "executor", "--redis-url", url, "--namespace", namespace,
                                                 "--index", str(i), *_task_args(config, init, task),
                                                 *_filter_args(config), *(["--queues", "rollout"] if evals_on else []),
                                                 *config.executor_args, *_metrics_args(ports, f"executor-{i}")],
                               restart=service)

        for shard, at in enumerate(shard_urls, start=1):  # each further shard: a controller and executors of its own
            assert watch is not None
            create_epoch(watch.client(shard), keys)
            # a log directory of its own: a controller's record of the engines it launched lives there
            watch.add(shard, start_controller(f"controller-s{shard}", at, [], out / "logs" / f"shard-{shard}"))
            for i in range(config.executors):
                watch.add(shard, procs.start(
                    f"executor-s{shard}-{i}", [*ROLE, "executor", "--redis-url", at, "--namespace", namespace,
                                               "--index", str(i), *_task_args(config, init, task),
                                               *_filter_args(config), *(["--queues", "rollout"] if evals_on else []),
                                               *config.executor_args], restart=service))
        fleet = None
        if config.autoscale is not None:
            fleet = executor_fleet(config, client, keys, procs, start_executor)
            fleet.start_initial()
        else:
            for i in range(config.executors):
                start_executor(i)
        before = None
        if evals_on:  # an executor of their own: a training rollout never waits behind an eval job
            procs.start("executor-eval", [*ROLE, "executor", "--redis-url", url, "--namespace", namespace,
                                          "--index", str(config.executor_slots()), *_task_args(config, init, task),
                                          "--queues", "eval", *config.executor_args], restart=service)
            tracker = _tracker(config, client, keys, task, namespace, out / "metrics")
            # the initial weights, before any trainer starts (one eval: every policy starts from them)
            if _wait_policy(client, keys, procs, config.base_policy(), 0, 300.0) < 0:
                raise RunFailed(f"policy {config.base_policy()} was not served within 300s: no eval before training")
            before = tracker.ask(config.base_policy(), "before", 0)
            _wait_evals(tracker, [before], procs)
        recorder = None
        if config.recorder:
            recorder = procs.start("recorder", [*ROLE, "trainer", "record", "--redis-url", url, "--namespace",
                                                namespace, "--policy", policies[0], "--out",
                                                str(out / "recording"), "--start", "0"], restart=service)
            _wait_group(client, keys, policies[0], "recorder", recorder)
        # trainers wait for their policy to be served before they ask for rollouts: no need to wait here
        trainer_policy = RestartPolicy(budget=config.restart_budget, may_finish=True)
        threads = ["--torch-threads", str(placement.trainer_threads)] if placement.disaggregated else []
        spread = [arg for at in shard_urls for arg in ("--shard-url", at)]
        trainers = [procs.start(f"trainer-{p}", [*_trainer_args(config, p, url, namespace, init, weights_root,
                                                                out / "checkpoints" / p, out / "metrics", task,
                                                                threads), *spread,
                                                 *_metrics_args(ports, f"trainer-{p}")], restart=trainer_policy)
                    for p in policies]
        if on_start is not None:
            on_start(RunHandle(procs, keys, url, fleet))
        runlog = _follow(config, client, keys, procs, trainers, started, epoch, fleet, tracker, placed, watch)
        if tracker is not None and before is not None:  # each policy's last version, on the same problems
            afters = {}
            for p in policies:
                summary = runlog.policy(p)
                if _wait_policy(client, keys, procs, p, summary.version, 300.0) < summary.version:
                    raise RunFailed(f"policy {p} was not served at v{summary.version} within 300s: no after eval")
                afters[p] = tracker.ask(p, "after", summary.steps)
            _wait_evals(tracker, [*tracker.pending(), *afters.values()], procs)
            for p in policies:
                _fold_evals(runlog.policy(p), tracker, before, afters[p])
        if recorder is not None:
            time.sleep(1.0)  # let the recorder catch up with the last batches
        wall_s = time.monotonic() - started
        summaries = [runlog.policy(p) for p in policies]
        outputs = {p: output_paths(out / "metrics", f"{namespace}-{p}", parse_log_to(config.log_to))
                   for p in policies}
        if tracker is not None:
            for p in policies:
                outputs[p].update({f"eval-{k}": v for k, v in tracker.logs[p].outputs.items()})
        faults = run_faults(client, keys, procs.restarts(), summaries)
        if watch is not None:
            _shard_faults(faults, watch, keys)
        text = (format_summary(summaries, mode=config.mode, wall_s=wall_s, faults=faults) + "\n"
                + f"weight sync: {config.weight_sync}\n" + format_outputs(outputs) + "\n" + placed.text())
        log.info("%s", placed.text())
        result = {"config": asdict(config), "namespace": namespace, "wall_s": wall_s,
                  "weight_sync": config.weight_sync,
                  "policies": {s.policy: s.to_dict() for s in summaries}, "faults": faults.to_dict(),
                  "metric_logs": {p: {k: str(v) for k, v in o.items()} for p, o in outputs.items()},
                  "placement": placed.to_dict()}
        if fleet is not None:
            result["executors"] = fleet.record.to_dict()
            text += (f"\nexecutors: auto {fleet.policy.min}-{fleet.policy.max}, peak {fleet.record.peak}, "
                     f"{len(fleet.record.decisions)} change(s) (ExecutorsScaled on the scaling stream)")
        (out / "summary.json").write_text(json.dumps(_finite(result), indent=2, default=str) + "\n")
        if config.plot:
            plot_rewards(summaries, out / "reward.png",
                         title=f"{Path(config.model).name if config.model else 'tiny LM'}, {config.mode} mode, "
                               f"{config.trainers} trainer(s), seed {config.seed}")
        return RunResult(config, {s.policy: s.to_dict() for s in summaries}, wall_s, out, namespace, text,
                         faults.to_dict())
    finally:
        if tracker is not None:
            tracker.close()  # the eval logs (a W&B run is finished)
        with signals_deferred():  # a second signal must not leave the run's processes behind
            _adopt_engines_quietly(client, keys, procs)
            if watch is not None:
                for shard in range(1, len(watch.urls)):
                    if shard not in watch.lost:
                        _adopt_engines_quietly(watch.client(shard), keys, procs, quick=True)
            procs.stop_all()
        try:
            if config.log_events:
                _export_quietly(client, keys, Path(config.log_events), policies if holding else [])
        finally:
            with signals_deferred():
                client.close()
                if watch is not None:
                    watch.close()
                for each in servers:
                    each.stop()


def _janitor_args(config: RunConfig) -> list[str]:
    """A run exported at the end keeps its whole log: no trimming, payloads kept past the run."""
    if not config.log_events:
        return []
    return ["--retention-max-len", "0", "--retention-max-age-s", "0",
            "--payload-max-age-s", str(max(24 * 3600.0, 2 * config.timeout_s))]


def _export_quietly(client: Any, keys: Any, path: Path, held: list[str]) -> None:
    """Export the namespace's event log with its payloads, then let the held payloads go."""
    from rollout_bus.events.errors import BusError
    from rollout_bus.replay.exporter import export_log, release_payloads
    from rollout_bus.replay.payloads import payload_store

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        store = payload_store(client, keys)
        try:
            stats = export_log(client, keys, path, payloads=store)
        finally:
            store.close()
        print(f"event log: {path} ({sum(stats.entries.values())} entries, {stats.payloads} payloads"
              f"{', ' + str(len(stats.missing_payloads)) + ' missing' if stats.missing_payloads else ''})", flush=True)
        if held:
            release_payloads(client, keys, held)
    except (BusError, OSError) as exc:  # the run's own outcome stands; say why there is no log
        log.error("could not export the event log to %s: %s", path, exc)


def resolve_model(spec: str) -> Path:
    """``smollm2`` (converted once from the installed package, cached) or a HF model directory with a
    chat tokenizer; ``RunFailed`` saying what to do otherwise."""
    from rollout_bus.lm import hf_tokenizer
    from rollout_bus.lm.hf import is_hf_dir
    from rollout_bus.lm.prepare import MODELS, PrepareError, prepare

    if spec in MODELS:
        try:
            return prepare(spec)
        except PrepareError as exc:
            raise RunFailed(str(exc)) from None
    path = Path(spec).expanduser().resolve()
    if not is_hf_dir(path):
        raise RunFailed(f"--model {spec!r} is neither a known model ({', '.join(sorted(MODELS))}) nor a Hugging Face "
                        "model directory (a config.json with a model_type)")
    try:
        hf_tokenizer.ChatTokenizer(path)  # not the cached one: the directory is checked as it is now
    except hf_tokenizer.TokenizerError as exc:
        raise RunFailed(f"--model {spec}: {exc}") from None
    return path


def task_options(config: RunConfig, model_dir: Path) -> dict[str, Any]:
    """The word-problem task of a HF-model run: what every request carries to every executor."""
    from rollout_bus.launch.config import MODEL_TASK

    return {**MODEL_TASK, **config.task, "tokenizer": str(model_dir), "seed": config.seed}


def check_context(model_dir: Path, task: dict[str, Any], max_new_tokens: int, probe: int = 32) -> int:
    """The longest prompt of the task's first ``probe`` train and eval problems, in tokens; ``RunFailed``
    when it and ``max_new_tokens`` do not fit in the model's context (``max_position_embeddings``)."""
    from rollout_bus.tasks.math_words import MathWordsSource

    context = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    try:
        sources = [MathWordsSource(**{**task, "split": split}) for split in ("train", "eval")]
    except (TypeError, ValueError) as exc:
        raise RunFailed(f"--task: {exc}") from None
    longest = max(len(s.item(i)["prompt_ids"]) for s in sources for i in range(probe))
    if isinstance(context, int) and longest + max_new_tokens > context:
        raise RunFailed(f"the task's prompts take up to {longest} tokens and --max-new-tokens is {max_new_tokens}: "
                        f"{longest + max_new_tokens} tokens do not fit in the context of {model_dir.name} ({context} "
                        "tokens, max_position_embeddings); lower --max-new-tokens or shorten the prompts (--task)")
    return longest


def _engine_count(config: RunConfig) -> int:
    """The engines the controller starts: one pool, or one per policy of full weights, and the eval engines."""
    pools = 1 if config.lora_spec() else config.trainers
    return config.engines * pools + config.eval_engines


def _pool_args(config: RunConfig) -> list[str]:
    spec = config.lora_spec()
    if spec is not None:  # every policy is an adapter on the base pool
        return ["--enable-lora", "--max-lora-rank", spec.split(",")[0]]
    # every further trainer trains full weights: its policy gets an engine pool of its own
    return [arg for p in config.policies()[1:] for arg in ("--pool", f"{p}={config.engines}")]


MODEL_HEALTH_TIMEOUT_S = 120.0
"""A real model's engine on a busy CPU may take tens of seconds for one step (a prefill of a whole rollout), and
a health check's token waits for it: the controller gives it this long before it counts a failure."""


def _health_args(config: RunConfig) -> list[str]:
    return [] if config.model is None else ["--health-timeout-s", str(MODEL_HEALTH_TIMEOUT_S)]


def _agent_setup(config: RunConfig, out: Path) -> tuple[Path, dict[str, Any]]:
    """An agent run's model (the real one, or a fresh tiny LM with room for several turns) and its source's options."""
    from rollout_bus.launch.config import AGENT_CONTEXT, AGENTS

    spec = AGENTS[str(config.agent)]
    if config.model is not None:
        return resolve_model(config.model), {**spec["model"], "seed": config.seed}
    from rollout_bus.engine.init_weights import init_weights_dir
    from rollout_bus.lm.model import ModelConfig

    init = out / "init-agent"
    if not (init / "config.json").is_file():
        init_weights_dir(init, ModelConfig(max_seq_len=AGENT_CONTEXT), config.seed)
    return init, {**spec["tiny"], "seed": config.seed}


def _task_args(config: RunConfig, init: Path, task: dict[str, Any]) -> list[str]:
    """The executors' plug-ins: the tiny LM's arithmetic, word problems in the model's chat template, or an
    agent's episodes through the executor's session gateway."""
    if config.agent is not None:
        from rollout_bus.launch.config import AGENTS

        spec = AGENTS[config.agent]
        args = ["--agent", spec["episode"], "--agent-model-path", str(init), "--data-source", spec["source"],
                "--data-source-args", json.dumps(task)]
        if config.model is not None:
            args += ["--tokenizer", "rollout_bus.lm.hf_tokenizer.ChatTokenizer", "--tokenizer-args",
                     json.dumps({"path": str(init)})]
        return args
    if config.model is None:
        return ["--data-source-args", json.dumps(task)]
    return ["--data-source", "rollout_bus.tasks.math_words.MathWordsSource", "--data-source-args", json.dumps(task),
            "--reward", "rollout_bus.tasks.math_reward.reward", "--tokenizer",
            "rollout_bus.lm.hf_tokenizer.ChatTokenizer", "--tokenizer-args", json.dumps({"path": str(init)})]


def _wait_policy(client: Any, keys: Any, procs: Any, policy: str, version: int, timeout_s: float) -> int:
    """Until ``policy`` is served at ``version`` or newer (or ``timeout_s``); the version served."""
    from rollout_bus.events.registry import Registry

    registry = Registry(client, keys)
    deadline = time.monotonic() + timeout_s
    while True:
        record = registry.policy(policy)
        serving = record.serving if record is not None else -1
        if serving >= version or time.monotonic() > deadline:
            return serving
        try:
            procs.supervise()
        except Exception as exc:
            raise RunFailed(str(exc)) from None
        time.sleep(0.1)




def _tracker(config: RunConfig, client: Any, keys: Any, task: dict[str, Any], namespace: str,
             log_dir: Path) -> Any:
    """The run's ``EvalTracker``: eval requests of ``eval_problems`` held-out problems, logged per policy."""
    from rollout_bus.events.rollouts import RolloutRequest, SamplingParams
    from rollout_bus.events.submit import RolloutSubmitter
    from rollout_bus.launch.evals import EvalLog, EvalTracker
    from rollout_bus.trainer.config import parse_log_to

    if config.model is not None:
        from rollout_bus.lm import hf_tokenizer

        stop = tuple(hf_tokenizer.load(str(task.get("tokenizer") or resolve_model(str(config.model)))).stop_token_ids)
    else:
        from rollout_bus.lm.tokenizer import EOS_ID

        stop = (EOS_ID,)
    submitter = RolloutSubmitter(client, keys)
    n = config.eval_problems()

    def submit(policy: str, request_id: str) -> None:
        submitter.submit(RolloutRequest.create(
            # its deadline is the run's own: evals queue behind one another on their executor
            policy, 0, n, config.eval_samples, timeout_s=config.timeout_s, eval=True, request_id=request_id,
            data={**task, "split": "eval", "size": n},
            sampling=SamplingParams(temperature=config.temperature, max_new_tokens=config.max_new_tokens,
                                    stop_token_ids=stop)))

    logs = {p: EvalLog(log_dir, f"{namespace}-{p}", p, parse_log_to(config.log_to), group=namespace,
                       config={"eval_problems": n, "eval_samples": config.eval_samples, "eval_every": config.eval_every,
                               "task": task})
            for p in config.policies()}
    return EvalTracker(client, keys, submit, namespace, logs=logs, timeout_s=config.timeout_s + 60.0)


def _wait_evals(tracker: Any, points: list[Any], procs: Any) -> None:
    def supervise() -> None:
        try:
            procs.supervise()
        except Exception as exc:
            raise RunFailed(str(exc)) from None

    from rollout_bus.launch.evals import EvalFailed

    try:
        tracker.wait(points, tracker.timeout_s, supervise)
    except EvalFailed as exc:
        raise RunFailed(str(exc)) from None


def _fold_evals(summary: Any, tracker: Any, before: Any, after: Any) -> None:
    """The policy's evals into its summary: before, after, their paired difference, and those during the run."""
    from rollout_bus.launch.evals import difference, phase_metrics

    summary.evals = {"before": phase_metrics(before), "after": phase_metrics(after)}
    summary.eval_difference = difference(before.event, after.event)
    summary.eval_points = [before.to_dict(), *(p.to_dict() for p in tracker.of(summary.policy) if p is not before)]


def _trainer_args(config: RunConfig, policy: str, url: str, namespace: str, init: Path, weights_root: Path,
                  checkpoint_dir: Path, log_dir: Path, task: dict[str, Any], threads: Sequence[str] = ()) -> list[str]:
    extra: list[str] = []
    if config.model is not None:  # the task travels in every request: each executor serves the same one
        extra = ["--data", json.dumps(task), "--temperature", str(config.temperature),
                 "--micro-batch-size", str(config.micro_batch_size)]
        if config.lora_spec():
            extra += ["--lora", str(config.lora_spec())]
    return [*ROLE, "trainer", "train", "--redis-url", url, "--namespace", namespace, "--policy", policy,
            "--trainer-id", f"trainer-{policy}", "--mode", config.mode, "--steps", str(config.steps),
            "--seed", str(config.seed), "--model-path", str(init), "--weights-root", str(weights_root),
            "--checkpoint-dir", str(checkpoint_dir), "--n-groups", str(config.n_groups),
            "--n-samples", str(config.n_samples), "--max-new-tokens", str(config.max_new_tokens),
            "--in-flight", str(config.in_flight), "--max-staleness", str(config.max_staleness),
            "--rollout-timeout-s", str(config.rollout_timeout_s),
            "--get-timeout-s", str(max(600.0, 2.5 * config.rollout_timeout_s)),  # past a re-ask or two
            "--stale-policy", config.stale_policy, "--lr", str(config.lr), "--epochs", str(config.epochs),
            "--off-policy", config.off_policy, *threads,
            "--std-normalise" if config.std_normalise else "--no-std-normalise",
            "--minibatches", str(config.minibatches), "--log-to", config.log_to,
            *(["--over-sample-groups", str(config.over_sample_groups())] if config.filters_groups() else []),
            "--log-dir", str(log_dir), "--run-name", namespace, *extra, *(["--colocate"] if config.colocate else []),
            "--weight-sync", config.weight_sync, *config.trainer_args]


def _metrics_args(ports: dict[str, int], name: str) -> list[str]:
    return ["--metrics-port", str(ports[name])] if name in ports else []


def _wait_group(client: Any, keys: Any, policy: str, group: str, child: Any, timeout_s: float = 60.0) -> None:
    """Until ``group`` reads ``policy``'s batches (so the payloads wait for it too)."""
    deadline = time.monotonic() + timeout_s
    stream = keys.batch_stream(policy)
    while not client.sismember(keys.registered_groups(stream), group):
        if not child.alive():
            raise RunFailed(f"{child.name} exited with {child.proc.returncode}:\n{child.tail()}")
        if time.monotonic() > deadline:
            raise RunFailed(f"{child.name} did not join {stream} in {timeout_s:.0f}s:\n{child.tail()}")
        time.sleep(0.05)


def _adopt_engines(client: Any, keys: Any, procs: Any, *, quick: bool = False) -> None:
    """Remember the engines' pids, so that they are stopped even if the controller cannot do it (``quick``: one
    try, for a shard that may be gone)."""
    from rollout_bus.events.connection import Guard, ReconnectPolicy
    from rollout_bus.events.registry import Registry

    guard = Guard(client, ReconnectPolicy(max_wait_s=0.0), name="shard registry") if quick else None
    for record in Registry(client, keys, guard=guard).engines().values():
        if record.pid is not None and record.pid not in procs.extra_pids:
            procs.adopt(record.pid, record.engine_id)


def executor_fleet(config: RunConfig, client: Any, keys: Any, procs: Any, start: Callable[[int], Any]) -> Any:
    """The run's autoscaled executors: backlog read from ``keys``' queues, decisions published on its scaling stream."""
    import socket

    from rollout_bus.events.backlog import publish_scaling, read_backlog
    from rollout_bus.events.publish import Publisher
    from rollout_bus.events.schema import ExecutorsScaled, Producer
    from rollout_bus.launch.fleet import ExecutorFleet

    assert config.autoscale is not None
    publisher = Publisher(client, keys, Producer("autoscaler", socket.gethostname()))

    def publish(sample: Any, decision: Any, policy: Any) -> None:
        publish_scaling(publisher, keys, ExecutorsScaled(
            producer=publisher.producer, depth=sample.depth, oldest_age_s=float(sample.oldest_age_s),
            busy=sample.busy, current=sample.current, target=decision.target, reason=decision.reason,
            min_executors=policy.min, max_executors=policy.max))

    return ExecutorFleet(procs, config.autoscale, start=start, read_backlog=lambda: read_backlog(client, keys),
                         publish=publish)


def _filter_args(config: RunConfig) -> list[str]:
    """DAPO's dynamic sampling: groups whose rewards are all equal (no advantage) are left out, and each
    request draws more prompts (``over_sample_groups``, passed by the trainers) to fill the batch."""
    return ["--filter", "rollout_bus.executor.filters.nonzero_reward_std"] if config.filters_groups() else []


def _shard_faults(faults: Any, watch: Any, keys: Any) -> None:
    """Every other shard's requeued jobs and dead letters in the run's fault counts; a shard that cannot be read
    (lost, or not answering now) is named instead: the run's result stands either way."""
    from rollout_bus.events.connection import UNREACHABLE, Guard, ReconnectPolicy
    from rollout_bus.events.errors import BusError
    from rollout_bus.launch.report import run_faults

    unread: tuple[type[BaseException], ...] = (BusError, *UNREACHABLE)
    for shard in range(1, len(watch.urls)):
        if shard in watch.lost:
            faults.unread_shards.append(shard)
            continue
        client = watch.client(shard)
        try:
            faults.add_shard(run_faults(client, keys, {}, [], guard=Guard(
                client, ReconnectPolicy(max_wait_s=1.0), name=f"run faults, shard {shard}")))
        except unread as exc:
            log.warning("the fault counts of shard %d were not read: %s", shard, exc)
            faults.unread_shards.append(shard)


def _follow(config: RunConfig, client: Any, keys: Any, procs: Any, trainers: list[Any], started: float,
            epoch: Any, fleet: Any = None, tracker: Any = None, placed: Any = None, watch: Any = None) -> Any:
    """Follow the trainer stream until every trainer is done; restart what died; fail when one keeps dying,
    or when Redis lost the run's data (its bus epoch vanished: ``RunFailed`` with that reason)."""
    from tqdm import tqdm

    from rollout_bus.events.errors import BusError, BusReset
    from rollout_bus.launch.config import due_steps
    from rollout_bus.launch.procs import GaveUp, exit_text
    from rollout_bus.launch.report import RunLog

    runlog = RunLog()
    due = set(due_steps(config.eval_every, config.steps)) if tracker is not None else set()
    asked: set[tuple[str, int]] = set()
    last_adopt = last_epoch = 0.0
    total = config.steps * len(trainers)
    with tqdm(total=total, unit="step", disable=not config.progress, dynamic_ncols=True,
              desc=f"{config.mode}") as bar:
        while True:
            try:
                if time.monotonic() - last_epoch > 1.0:
                    last_epoch = time.monotonic()
                    epoch.check()
                new = runlog.follow(client, keys, block_ms=300)
                if watch is not None:  # each shard's batches (the steps come once, whichever shard shows them)
                    new += _follow_shards(runlog, watch, keys)
                for step in new:  # an eval of the policy as it is now; training goes on meanwhile
                    if tracker is not None and step.step in due and (step.policy, step.step) not in asked:
                        asked.add((step.policy, step.step))
                        tracker.ask(step.policy, "during", step.step)
                if tracker is not None:
                    tracker.poll()
                if time.monotonic() - last_adopt > 1.0:
                    _adopt_engines(client, keys, procs)
                    if watch is not None:
                        for shard in range(1, len(watch.urls)):
                            if watch.reachable(shard):
                                _adopt_engines_quietly(watch.client(shard), keys, procs, quick=True)
                    if placed is not None:
                        _observe(placed, procs)
                    last_adopt = time.monotonic()
            except BusReset as exc:
                _let_roles_notice(procs)
                raise RunFailed(f"{exc}; the run stops (its streams, groups and registry are gone: nothing to "
                                "resume from)") from None
            except BusError as exc:  # Redis away longer than the reconnect budget: the roles wait too
                log.warning("following the run: %s", exc)
                new = []
            if new:
                bar.update(len(new))
                bar.set_postfix({s.policy: f"{s.rewards[-1]:.2f}" + (f" acc {s.correct[-1]:.2f} fmt {s.formatted[-1]:.2f}"
                                                                      if s.correct else "")
                                 for s in runlog.policies.values() if s.rewards})
            if fleet is not None:
                fleet.tick()
            if watch is not None:
                watch.tick()
            try:
                for child in procs.supervise():
                    tqdm.write(f"{child.name} exited with {exit_text(child.exits[-1])}: restarted "
                               f"({child.restarts}/{child.policy.budget})")
            except GaveUp as exc:
                raise RunFailed(str(exc)) from None
            if all(t.finished for t in trainers):
                runlog.follow(client, keys, block_ms=0)
                if watch is not None:
                    _follow_shards(runlog, watch, keys)
                return runlog
            if time.monotonic() - started > config.timeout_s:
                raise RunFailed(f"the run did not finish in {config.timeout_s:.0f}s")


def _follow_shards(runlog: Any, watch: Any, keys: Any) -> list[Any]:
    """What the trainer streams of the run's further shards gained (a lost shard's is not read: one try each)."""
    from rollout_bus.events.connection import Guard, ReconnectPolicy
    from rollout_bus.events.errors import BusError

    new: list[Any] = []
    for shard in range(1, len(watch.urls)):
        if not watch.reachable(shard):
            continue
        client = watch.client(shard)
        try:
            new += runlog.follow(client, keys, block_ms=0, shard=shard,
                                 guard=Guard(client, ReconnectPolicy(max_wait_s=0.0), name=f"run log shard {shard}"))
        except BusError as exc:
            log.info("following shard %d: %s", shard, exc)
    return new


def _observe(placed: Any, procs: Any) -> None:
    """Read back the CPUs and GPUs of every process of the run now running (each once, again after a restart)."""
    from rollout_bus.launch.placement import ENGINES

    for child in procs.children:
        if child.alive():
            placed.observe(child.name, child.pid)
    for pid, name in list(procs.extra_pids.items()):  # the engines the controller started
        placed.observe(name, pid, ENGINES)


def _let_roles_notice(procs: Any) -> None:
    """After a bus reset, give every role the time to see it on its own (its epoch check) and stop with the
    reason in its log, before the run stops what is left: stopping them first would hide who noticed what."""
    from rollout_bus.events.epoch import check_interval_s

    deadline = time.monotonic() + min(3 * check_interval_s() + 1.0, 10.0)
    while time.monotonic() < deadline and any(child.alive() for child in procs.children):
        time.sleep(0.1)


def _adopt_engines_quietly(client: Any, keys: Any, procs: Any, *, quick: bool = False) -> None:
    try:
        _adopt_engines(client, keys, procs, quick=quick)
    except Exception as exc:  # cleanup goes on: the controller stops its engines itself
        log.warning("could not read the engine registry: %s", exc)


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
