"""The main job: a private Redis (unless one is given), the warm start, then every role as a process.

``run_job`` starts the controller (which launches the engines), the executors and one
trainer per policy, each as ``python -m rollout_bus <role>``, follows the trainers'
events with a progress bar, writes ``<out>/summary.json`` and ``<out>/reward.png``, and
stops everything it started, by pid, on exit, on error and on Ctrl-C.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rollout_bus.launch.config import RunConfig, RunFailed, RunResult, metrics_ports

log = logging.getLogger(__name__)

ROLE = ["-m", "rollout_bus"]
"""How a child process runs a role: ``python -m rollout_bus <role> ...``."""


def run_job(config: RunConfig) -> RunResult:
    """Run the whole system for ``config``; stops everything it started before it returns or raises."""
    from rollout_bus.events.connection import connect, redis_url
    from rollout_bus.events.embedded import private_redis
    from rollout_bus.events.names import Keys
    from rollout_bus.launch.procs import ProcessSet
    from rollout_bus.launch.report import format_outputs, format_summary, plot_rewards
    from rollout_bus.tasks.warmstart import WarmStartConfig, warm_start_cached
    from rollout_bus.trainer.config import parse_log_to
    from rollout_bus.trainer.metric_loggers import output_paths

    started = time.monotonic()
    out = Path(config.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("checkpoints", "weights", "logs", "recording", "metrics"):  # a run starts afresh in its directory
        shutil.rmtree(out / stale, ignore_errors=True)
    namespace = config.namespace or f"run-{uuid.uuid4().hex[:8]}"
    keys = Keys(namespace)
    server = None
    url = config.redis_url or os.environ.get("REDIS_URL")
    if not url:
        server = private_redis()
        url = server.url
    url = redis_url(url)
    procs = ProcessSet(out / "logs", env={"ROLLOUT_BUS_NAMESPACE": namespace, "REDIS_URL": url})
    client = connect(url)
    try:
        warm = WarmStartConfig(steps=config.warm_steps, keep=config.warm_keep, digits=config.digits,
                               seed=config.seed)
        init = warm_start_cached(Path(config.init_dir) if config.init_dir else out / "init", warm)
        weights_root = out / "weights"
        weights_root.mkdir(exist_ok=True)
        policies = config.policies()
        ports = metrics_ports(config)
        if ports:
            procs.start("bus-metrics", [*ROLE, "status", "--redis-url", url, "--namespace", namespace,
                                        "--serve-metrics", str(ports["bus-metrics"])])
            print("metrics:\n" + "\n".join(f"  {name:<12} http://127.0.0.1:{port}/metrics"
                                            for name, port in ports.items()), flush=True)
        procs.start("controller", [
            *ROLE, "controller", "--redis-url", url, "--namespace", namespace,
            "--num-engines", str(config.engines), "--model-path", str(init), "--weights-root", str(weights_root),
            "--base-policy", policies[0], "--seed", str(config.seed), "--log-dir", str(out / "logs"),
            # every further trainer trains full weights: its policy gets an engine pool of its own
            *(arg for p in policies[1:] for arg in ("--pool", f"{p}={config.engines}")),
            "--token-delay-ms", str(config.token_delay_ms), "--log-level", "INFO",
            "--engine-arg=--max-batch-size", f"--engine-arg={config.engine_max_batch}",
            *_metrics_args(ports, "controller")])
        data_args = json.dumps({"digits": config.digits, "seed": config.seed})
        for i in range(config.executors):
            procs.start(f"executor-{i}", [*ROLE, "executor", "--redis-url", url, "--namespace", namespace,
                                          "--index", str(i), "--data-source-args", data_args,
                                          *_metrics_args(ports, f"executor-{i}")])
        recorder = None
        if config.recorder:
            recorder = procs.start("recorder", [*ROLE, "trainer", "record", "--redis-url", url, "--namespace",
                                                namespace, "--policy", policies[0], "--out",
                                                str(out / "recording"), "--start", "0"])
            _wait_group(client, keys, policies[0], "recorder", recorder)
        # trainers wait for their policy to be served before they ask for rollouts: no need to wait here
        trainers = [procs.start(f"trainer-{p}", [*_trainer_args(config, p, url, namespace, init, weights_root,
                                                                out / "checkpoints" / p, out / "metrics"),
                                                 *_metrics_args(ports, f"trainer-{p}")])
                    for p in policies]
        runlog = _follow(config, client, keys, procs, trainers, started)
        if recorder is not None:
            time.sleep(1.0)  # let the recorder catch up with the last batches
        wall_s = time.monotonic() - started
        summaries = [runlog.policy(p) for p in policies]
        outputs = {p: output_paths(out / "metrics", f"{namespace}-{p}", parse_log_to(config.log_to))
                   for p in policies}
        text = format_summary(summaries, mode=config.mode, wall_s=wall_s) + "\n" + format_outputs(outputs)
        result = {"config": asdict(config), "namespace": namespace, "wall_s": wall_s,
                  "policies": {s.policy: s.to_dict() for s in summaries},
                  "metric_logs": {p: {k: str(v) for k, v in o.items()} for p, o in outputs.items()}}
        (out / "summary.json").write_text(json.dumps(_finite(result), indent=2, default=str) + "\n")
        if config.plot:
            plot_rewards(summaries, out / "reward.png",
                         title=f"{config.mode} mode, {config.trainers} trainer(s), seed {config.seed}")
        return RunResult(config, {s.policy: s.to_dict() for s in summaries}, wall_s, out, namespace, text)
    finally:
        _adopt_engines_quietly(client, keys, procs)
        procs.stop_all()
        client.close()
        if server is not None:
            server.stop()


def _trainer_args(config: RunConfig, policy: str, url: str, namespace: str, init: Path, weights_root: Path,
                  checkpoint_dir: Path, log_dir: Path) -> list[str]:
    return [*ROLE, "trainer", "train", "--redis-url", url, "--namespace", namespace, "--policy", policy,
            "--trainer-id", f"trainer-{policy}", "--mode", config.mode, "--steps", str(config.steps),
            "--seed", str(config.seed), "--model-path", str(init), "--weights-root", str(weights_root),
            "--checkpoint-dir", str(checkpoint_dir), "--n-groups", str(config.n_groups),
            "--n-samples", str(config.n_samples), "--max-new-tokens", str(config.max_new_tokens),
            "--in-flight", str(config.in_flight), "--max-staleness", str(config.max_staleness),
            "--stale-policy", config.stale_policy, "--lr", str(config.lr), "--epochs", str(config.epochs),
            "--minibatches", str(config.minibatches), "--log-to", config.log_to, "--log-dir", str(log_dir),
            "--run-name", namespace, *config.trainer_args]


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


def _adopt_engines(client: Any, keys: Any, procs: Any) -> None:
    """Remember the engines' pids, so that they are stopped even if the controller cannot do it."""
    from rollout_bus.events.registry import Registry

    for record in Registry(client, keys).engines().values():
        if record.pid is not None and record.pid not in procs.extra_pids:
            procs.adopt(record.pid, record.engine_id)


def _follow(config: RunConfig, client: Any, keys: Any, procs: Any, trainers: list[Any], started: float) -> Any:
    """Follow the trainer stream until every trainer is done; a failed process fails the run."""
    from tqdm import tqdm

    from rollout_bus.launch.report import RunLog

    runlog = RunLog()
    last_adopt = 0.0
    total = config.steps * len(trainers)
    services = [c for c in procs.children if c not in trainers and c.name != "recorder"]
    with tqdm(total=total, unit="step", disable=not config.progress, dynamic_ncols=True,
              desc=f"{config.mode}") as bar:
        while True:
            new = runlog.follow(client, keys, block_ms=300)
            if time.monotonic() - last_adopt > 1.0:
                _adopt_engines(client, keys, procs)
                last_adopt = time.monotonic()
            if new:
                bar.update(len(new))
                bar.set_postfix({s.policy: f"{s.rewards[-1]:.2f}" for s in runlog.policies.values() if s.rewards})
            done = [t for t in trainers if not t.alive()]
            for t in done:
                if t.proc.returncode != 0:
                    raise RunFailed(f"{t.name} exited with {t.proc.returncode}:\n{t.tail()}")
            if len(done) == len(trainers):
                runlog.follow(client, keys, block_ms=0)
                return runlog
            for s in services:
                if not s.alive():
                    raise RunFailed(f"{s.name} exited with {s.proc.returncode}:\n{s.tail()}")
            if time.monotonic() - started > config.timeout_s:
                raise RunFailed(f"the run did not finish in {config.timeout_s:.0f}s")


def _adopt_engines_quietly(client: Any, keys: Any, procs: Any) -> None:
    try:
        _adopt_engines(client, keys, procs)
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


