"""Run one trainer, or a recorder beside one: ``python scripts/trainer.py [train|record|offline] ...``.

``train`` (the default) runs the reference GRPO trainer of one policy; ``record`` runs a
passive subscriber that writes the policy's batches to a directory; ``offline`` retrains
from the batches of an exported log (``scripts/replay.py export``), without engines or
Redis, deterministically (``trainer.offline``)::

    python scripts/trainer.py offline --log run.rblog --policy p0 --model-path INIT [--steps N] [--out DIR]

It prints one JSON line (batch ids in training order, final metrics, the weights' sha256)
and, with ``--out``, writes ``batch_ids.txt``, ``result.json`` and ``model/``. Flags are parsed
before torch or Redis clients are imported, so ``--help`` is instant. SIGTERM or SIGINT
stops at once; the checkpoint written after every step is what a restart resumes from.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.offline import OfflineConfig

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import (  # noqa: E402  (light: dataclasses only)
    DP_STRATEGIES,
    MODES,
    STALE_POLICIES,
    LossSettings,
    OptimConfig,
    PublishConfig,
    RolloutConfig,
    ScheduleConfig,
    TrainerConfig,
)

COMMANDS = ("train", "record", "offline")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=None, help="default: $REDIS_URL, else redis://127.0.0.1:6379/0")
    p.add_argument("--namespace", default=None, help="default: $ROLLOUT_BUS_NAMESPACE or 'default'")
    p.add_argument("--policy", default="default")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/trainer.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    t = sub.add_parser("train", help="the reference GRPO trainer (default)")
    _common(t)
    t.add_argument("--trainer-id", default="trainer-0", help="names the consumer group; stable across restarts")
    t.add_argument("--steps", type=int, default=40)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--model-path", default="", help="initial weights (ignored when a checkpoint exists)")
    t.add_argument("--initial-version", type=int, default=0)
    t.add_argument("--checkpoint-dir", default="", help="checkpoint after every step; resume from it")
    t.add_argument("--weights-root", required=True, help="published versions go under <root>/<policy>/")
    t.add_argument("--mode", choices=MODES, default="async")
    t.add_argument("--in-flight", type=int, default=2, help="async: requests kept in flight")
    t.add_argument("--max-staleness", type=int, default=1, help="async: versions a sample may lag")
    t.add_argument("--stale-policy", choices=STALE_POLICIES, default="drop")
    w = t.add_mutually_exclusive_group()
    w.add_argument("--wait-serving", dest="wait_serving", action="store_true", default=None,
                   help="after publishing, wait until the engines serve the version (default: not in async)")
    w.add_argument("--no-wait-serving", dest="wait_serving", action="store_false")
    t.add_argument("--serving-timeout-s", type=float, default=60.0)
    t.add_argument("--keep-versions", type=int, default=4)
    t.add_argument("--n-groups", type=int, default=16)
    t.add_argument("--n-samples", type=int, default=8, help="samples per prompt group")
    t.add_argument("--max-new-tokens", type=int, default=6)
    t.add_argument("--temperature", type=float, default=1.0)
    t.add_argument("--data", default="{}", help="JSON options for the executors' data source")
    t.add_argument("--rollout-timeout-s", type=float, default=120.0)
    t.add_argument("--get-timeout-s", type=float, default=600.0)
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--minibatches", type=int, default=1)
    t.add_argument("--tis-cap", type=float, default=2.0)
    t.add_argument("--ppo-clip", type=float, default=0.2, help="<= 0 turns the PPO clip off")
    t.add_argument("--dp-rank", type=int, default=0)
    t.add_argument("--dp-size", type=int, default=1)
    t.add_argument("--dp-strategy", choices=DP_STRATEGIES, default="shared-group")
    t.add_argument("--torch-threads", type=int, default=1)
    t.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus /metrics on this port (0: any free one; default: off)")
    r = sub.add_parser("record", help="a passive recorder of one policy's batches")
    _common(r)
    r.add_argument("--out", required=True, help="directory for <batch_id>.safetensors and index.jsonl")
    r.add_argument("--name", default="recorder", help="consumer group")
    r.add_argument("--start", default="0", help="where a new group starts: 0 (all retained) or $ (new only)")
    r.add_argument("--max-batches", type=int, default=None)
    o = sub.add_parser("offline", help="retrain from an exported log's batches (no engines, no Redis)")
    o.add_argument("--log", required=True, help="a log file written by scripts/replay.py export (with payloads)")
    o.add_argument("--policy", required=True, help="train on this policy's batches")
    o.add_argument("--model-path", required=True, help="initial weights (config.json + model.safetensors)")
    o.add_argument("--steps", type=int, default=0, help="stop after N steps (0: every batch of the log)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--out", default=None, help="write batch_ids.txt, result.json and model/ here")
    o.add_argument("--initial-version", type=int, default=0)
    o.add_argument("--max-staleness", type=int, default=None,
                   help="leave out groups more than this many versions behind (default: train every sample)")
    o.add_argument("--trained-only", action="store_true",
                   help="only the batches a trainer of the log accepted (its BatchConsumed events)")
    o.add_argument("--lr", type=float, default=5e-4)
    o.add_argument("--epochs", type=int, default=1)
    o.add_argument("--minibatches", type=int, default=1)
    o.add_argument("--tis-cap", type=float, default=2.0)
    o.add_argument("--ppo-clip", type=float, default=0.2, help="<= 0 turns the PPO clip off")
    o.add_argument("--torch-threads", type=int, default=1, help="more than 1 may cost bit-exact reproducibility")
    o.add_argument("--allow-truncated", action="store_true", help="read a log without its end record")
    o.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in (*COMMANDS, "-h", "--help"):
        args = ["train", *args]
    return build_parser().parse_args(args)


def trainer_config(ns: argparse.Namespace) -> TrainerConfig:
    from events.names import Keys

    data: Any = json.loads(ns.data)
    if not isinstance(data, dict):
        raise SystemExit("--data must be a JSON object")
    return TrainerConfig(
        policy=ns.policy, trainer_id=ns.trainer_id, namespace=ns.namespace or Keys.from_env().namespace,
        redis_url=ns.redis_url, steps=ns.steps, seed=ns.seed, model_path=ns.model_path,
        initial_version=ns.initial_version, checkpoint_dir=ns.checkpoint_dir, dp_rank=ns.dp_rank,
        dp_size=ns.dp_size, dp_strategy=ns.dp_strategy, get_timeout_s=ns.get_timeout_s,
        torch_threads=ns.torch_threads,
        rollout=RolloutConfig(n_groups=ns.n_groups, n_samples_per_group=ns.n_samples,
                              max_new_tokens=ns.max_new_tokens, temperature=ns.temperature,
                              timeout_s=ns.rollout_timeout_s, data=data),
        schedule=ScheduleConfig(mode=ns.mode, in_flight=ns.in_flight, max_staleness=ns.max_staleness,
                                stale_policy=ns.stale_policy),
        publish=PublishConfig(weights_root=ns.weights_root, wait_serving=ns.wait_serving,
                              serving_timeout_s=ns.serving_timeout_s, keep_versions=ns.keep_versions),
        optim=OptimConfig(lr=ns.lr, epochs=ns.epochs, minibatches=ns.minibatches),
        loss=LossSettings(tis_cap=ns.tis_cap, ppo_clip=ns.ppo_clip if ns.ppo_clip > 0 else None),
    ).validate()


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def run_trainer(ns: argparse.Namespace) -> int:
    config = trainer_config(ns)

    from events.connection import connect
    from events.metrics import serve_metrics
    from trainer.service import Trainer

    if ns.metrics_port is not None:
        serve_metrics(ns.metrics_port)
    client = connect(config.redis_url)
    trainer = Trainer(config, client)
    try:
        trainer.start()
        state = trainer.run()
        logging.getLogger("trainer").info("done: %d steps, version %d", state.step, state.version)
    finally:
        trainer.stop()
        client.close()
    return 0


def run_recorder(ns: argparse.Namespace) -> int:
    from events.connection import connect
    from events.names import Keys
    from trainer.recorder import Recorder, RecorderConfig

    client = connect(ns.redis_url)
    keys = Keys(ns.namespace) if ns.namespace else Keys.from_env()
    recorder = Recorder(client, keys, RecorderConfig(policy=ns.policy, out_dir=ns.out, name=ns.name,
                                                     start_id=ns.start))
    try:
        recorder.start()
        recorder.run(ns.max_batches)
    finally:
        recorder.stop()
        recorder.close()
        client.close()
    return 0


def offline_config(ns: argparse.Namespace) -> OfflineConfig:
    from trainer.offline import OfflineConfig

    return OfflineConfig(
        log=ns.log, model_path=ns.model_path, policy=ns.policy, steps=ns.steps, seed=ns.seed,
        initial_version=ns.initial_version, max_staleness=ns.max_staleness, trained_only=ns.trained_only,
        torch_threads=ns.torch_threads, allow_truncated=ns.allow_truncated,
        optim=OptimConfig(lr=ns.lr, epochs=ns.epochs, minibatches=ns.minibatches),
        loss=LossSettings(tis_cap=ns.tis_cap, ppo_clip=ns.ppo_clip if ns.ppo_clip > 0 else None),
    ).validate()


def run_offline(ns: argparse.Namespace) -> int:
    from trainer.config import ConfigError

    try:
        config = offline_config(ns)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None

    from trainer.offline import run_offline as train_offline
    from trainer.offline import write_outputs

    result, model = train_offline(config)
    out = str(write_outputs(result, model, ns.out)) if ns.out else None
    print(json.dumps({"log": result.log, "policy": result.policy, "steps": len(result.batch_ids),
                      "batch_ids": result.batch_ids, "skipped": result.skipped, "version": result.version,
                      "weights_sha256": result.weights_sha256,
                      "final_metrics": result.to_dict()["final_metrics"], "out": out}, sort_keys=True))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse(argv)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if ns.command == "record":
        return run_recorder(ns)
    if ns.command == "offline":
        return run_offline(ns)
    return run_trainer(ns)


if __name__ == "__main__":
    sys.exit(main())
