"""The main job: a whole async RL run on one machine, in one command.

``python scripts/run.py [--mode sync|one-step|async] [--trainers N] [--executors N]
[--engines N] [--steps N] [--seed S] [--out DIR] [--metrics-base-port PORT]``

Without ``REDIS_URL`` (or ``--redis-url``) it starts a private ``redis-server`` on a free
port. It warm-starts the model briefly (supervised, noisy labels: the reward starts well
below its ceiling), then starts the controller (which launches the engines), the
executors and one trainer per policy, each as a process through its ``scripts/``
entrypoint, follows the trainers' events with a progress bar, prints a summary (reward
before and after, steps/s and samples/s, staleness histogram), writes
``<out>/reward.png`` and ``<out>/summary.json``, and stops everything it started, by pid,
on exit, on error and on Ctrl-C. With ``--metrics-base-port N`` every process serves
Prometheus ``/metrics``: the controller on N, executor i on N+1+i, then the trainers, then
a bus exporter (``scripts/status.py --serve-metrics``: consumer lag, pending, dead letters,
rq queues); the URLs are printed at the start.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import MODES, STALE_POLICIES  # noqa: E402  (light: dataclasses only)

log = logging.getLogger("run")


@dataclass
class RunConfig:
    mode: str = "async"
    trainers: int = 1
    executors: int = 1
    engines: int = 1
    steps: int = 40
    seed: int = 0
    out: str = "runs/latest"
    redis_url: str | None = None
    namespace: str | None = None
    # --- rollouts and training ---------------------------------------------------------------
    n_groups: int = 16
    n_samples: int = 8
    max_new_tokens: int = 6
    in_flight: int = 2
    max_staleness: int = 1
    stale_policy: str = "drop"
    lr: float = 5e-4
    epochs: int = 1
    minibatches: int = 1
    digits: int = 1
    token_delay_ms: float = 0.0
    engine_max_batch: int = 128
    """Sequences an engine decodes together (a whole rollout at once by default)."""
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
    trainer_args: list[str] = field(default_factory=list)
    timeout_s: float = 900.0
    progress: bool = True
    plot: bool = True

    def policies(self) -> list[str]:
        return [f"p{i}" for i in range(self.trainers)]


def metrics_ports(config: RunConfig) -> dict[str, int]:
    """The ``/metrics`` port of each process, by name; empty when ``metrics_base_port`` is 0.

    The controller on the base port, executor i on base+1+i, the trainer of policy j after
    the executors, and the bus exporter (lag, pending, dead letters, queues) last.
    """
    base = config.metrics_base_port
    if not base:
        return {}
    names = ["controller", *(f"executor-{i}" for i in range(config.executors)),
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


class RunFailed(RuntimeError):
    """A process of the run failed; the message carries the end of its log."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/run.py", description=__doc__.split("\n\n")[0])
    d = RunConfig()
    p.add_argument("--mode", choices=MODES, default=d.mode)
    p.add_argument("--trainers", type=int, default=d.trainers, help="policies trained at once (one trainer each)")
    p.add_argument("--executors", type=int, default=d.executors)
    p.add_argument("--engines", type=int, default=d.engines)
    p.add_argument("--steps", type=int, default=d.steps, help="training steps per trainer")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out, help="logs, weights, checkpoints, summary.json, reward.png")
    p.add_argument("--redis-url", default=None, help="default: $REDIS_URL, else a private redis-server")
    p.add_argument("--namespace", default=None, help="default: a fresh one per run")
    g = p.add_argument_group("rollouts and training")
    g.add_argument("--n-groups", type=int, default=d.n_groups, help="prompts per rollout")
    g.add_argument("--n-samples", type=int, default=d.n_samples, help="samples per prompt")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    g.add_argument("--in-flight", type=int, default=d.in_flight, help="async: requests in flight")
    g.add_argument("--max-staleness", type=int, default=d.max_staleness)
    g.add_argument("--stale-policy", choices=STALE_POLICIES, default=d.stale_policy)
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--epochs", type=int, default=d.epochs)
    g.add_argument("--minibatches", type=int, default=d.minibatches)
    g.add_argument("--digits", type=int, default=d.digits, help="arithmetic task: digits per operand")
    g.add_argument("--token-delay-ms", type=float, default=d.token_delay_ms, help="engine sleep per decode step")
    g.add_argument("--engine-max-batch", type=int, default=d.engine_max_batch,
                   help="sequences an engine decodes together")
    g.add_argument("--warm-steps", type=int, default=d.warm_steps)
    g.add_argument("--warm-keep", type=float, default=d.warm_keep, help="share of correct warm-start labels")
    g.add_argument("--trainer-arg", dest="trainer_args", action="append", default=[],
                   help="extra scripts/trainer.py argument (repeatable), e.g. --trainer-arg=--tis-cap=3")
    x = p.add_argument_group("extras")
    x.add_argument("--recorder", action="store_true", help="record the first policy's batches")
    x.add_argument("--metrics-base-port", type=int, default=d.metrics_base_port, metavar="PORT",
                   help="serve /metrics: controller on PORT, executors on PORT+1.., then trainers, then the bus "
                        "exporter (default 0: off)")
    x.add_argument("--timeout-s", type=float, default=d.timeout_s)
    x.add_argument("--no-progress", dest="progress", action="store_false")
    x.add_argument("--no-plot", dest="plot", action="store_false")
    x.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def config_from_args(ns: argparse.Namespace) -> RunConfig:
    values = {k: v for k, v in vars(ns).items() if k in RunConfig.__dataclass_fields__}
    config = RunConfig(**values)
    problems = [f"--{name} must be >= 1" for name in ("trainers", "executors", "engines", "steps")
                if getattr(config, name) < 1]
    n_ports = config.executors + config.trainers + 2
    if config.metrics_base_port < 0 or (config.metrics_base_port and config.metrics_base_port + n_ports > 65536):
        problems.append(f"--metrics-base-port must be 0 (off) or leave room for {n_ports} ports below 65536")
    if problems:
        raise SystemExit("; ".join(problems))
    return config


# --- the job ------------------------------------------------------------------------------------

def run_job(config: RunConfig) -> RunResult:
    """Run the whole system for ``config``; stops everything it started before it returns or raises."""
    import os

    from events.connection import connect, redis_url
    from events.embedded import private_redis
    from events.names import Keys
    from trainer.procs import ProcessSet
    from trainer.report import format_summary, plot_rewards
    from trainer.warmstart import WarmStartConfig, warm_start_cached

    started = time.monotonic()
    out = Path(config.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("checkpoints", "weights", "logs", "recording"):  # a run starts afresh in its directory
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
            procs.start("bus-metrics", ["scripts/status.py", "--redis-url", url, "--namespace", namespace,
                                        "--serve-metrics", str(ports["bus-metrics"])])
            print("metrics:\n" + "\n".join(f"  {name:<12} http://127.0.0.1:{port}/metrics"
                                            for name, port in ports.items()), flush=True)
        procs.start("controller", [
            "scripts/controller.py", "--redis-url", url, "--namespace", namespace,
            "--num-engines", str(config.engines), "--model-path", str(init), "--weights-root", str(weights_root),
            "--base-policy", policies[0], "--seed", str(config.seed), "--log-dir", str(out / "logs"),
            "--token-delay-ms", str(config.token_delay_ms), "--log-level", "INFO",
            "--engine-arg=--max-batch-size", f"--engine-arg={config.engine_max_batch}",
            *_metrics_args(ports, "controller")])
        data_args = json.dumps({"digits": config.digits, "seed": config.seed})
        for i in range(config.executors):
            procs.start(f"executor-{i}", ["scripts/executor.py", "--redis-url", url, "--namespace", namespace,
                                          "--index", str(i), "--data-source-args", data_args,
                                          *_metrics_args(ports, f"executor-{i}")])
        recorder = None
        if config.recorder:
            recorder = procs.start("recorder", ["scripts/trainer.py", "record", "--redis-url", url, "--namespace",
                                                namespace, "--policy", policies[0], "--out",
                                                str(out / "recording"), "--start", "0"])
            _wait_group(client, keys, policies[0], "recorder", recorder)
        # trainers wait for their policy to be served before they ask for rollouts: no need to wait here
        trainers = [procs.start(f"trainer-{p}", [*_trainer_args(config, p, url, namespace, init, weights_root,
                                                                out / "checkpoints" / p),
                                                 *_metrics_args(ports, f"trainer-{p}")])
                    for p in policies]
        runlog = _follow(config, client, keys, procs, trainers, started)
        if recorder is not None:
            time.sleep(1.0)  # let the recorder catch up with the last batches
        wall_s = time.monotonic() - started
        summaries = [runlog.policy(p) for p in policies]
        text = format_summary(summaries, mode=config.mode, wall_s=wall_s)
        result = {"config": asdict(config), "namespace": namespace, "wall_s": wall_s,
                  "policies": {s.policy: s.to_dict() for s in summaries}}
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
                  checkpoint_dir: Path) -> list[str]:
    return ["scripts/trainer.py", "train", "--redis-url", url, "--namespace", namespace, "--policy", policy,
            "--trainer-id", f"trainer-{policy}", "--mode", config.mode, "--steps", str(config.steps),
            "--seed", str(config.seed), "--model-path", str(init), "--weights-root", str(weights_root),
            "--checkpoint-dir", str(checkpoint_dir), "--n-groups", str(config.n_groups),
            "--n-samples", str(config.n_samples), "--max-new-tokens", str(config.max_new_tokens),
            "--in-flight", str(config.in_flight), "--max-staleness", str(config.max_staleness),
            "--stale-policy", config.stale_policy, "--lr", str(config.lr), "--epochs", str(config.epochs),
            "--minibatches", str(config.minibatches), *config.trainer_args]


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
    from events.registry import Registry

    for record in Registry(client, keys).engines().values():
        if record.pid is not None and record.pid not in procs.extra_pids:
            procs.adopt(record.pid, record.engine_id)


def _follow(config: RunConfig, client: Any, keys: Any, procs: Any, trainers: list[Any], started: float) -> Any:
    """Follow the trainer stream until every trainer is done; a failed process fails the run."""
    from tqdm import tqdm

    from trainer.report import RunLog

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


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(ns)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background
    try:
        result = run_job(config)
    except RunFailed as exc:
        print(f"run failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: everything this run started is stopped", file=sys.stderr)
        return 130
    print(result.text)
    print(f"outputs in {result.out} (summary.json{', reward.png' if config.plot else ''}, logs/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
