"""``rollout-bus trainer [train|record] ...``: one trainer, or a recorder beside one.

``train`` (the default) runs the reference GRPO trainer of one policy; ``record`` runs a
passive subscriber that writes the policy's batches to a directory (also ``rollout-bus
record``). Retraining from an exported log is ``rollout-bus replay offline`` (also reachable
as ``rollout-bus trainer offline``). Flags are parsed before torch or Redis clients are
imported, so ``--help`` is instant. SIGTERM or SIGINT stops at once; the checkpoint written
after every step is what a restart resumes from. A trainer whose policy lease lapsed (it was
paused or cut off longer than ``--lease-ttl-s``) stops with a ``deposed:`` line and exit status
75 (``LeaseLost.exit_code``), having written nothing after the lapse.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_bus.trainer.service import Trainer

from rollout_bus.events.names import name_arg
from rollout_bus.trainer.config import (  # light: dataclasses only
    DP_STRATEGIES,
    LOG_BACKENDS,
    MODES,
    OFF_POLICIES,
    OFF_POLICY_HELP,
    STALE_POLICIES,
    WEIGHT_SYNCS,
    LogConfig,
    LossSettings,
    OptimConfig,
    PublishConfig,
    RolloutConfig,
    ScheduleConfig,
    TrainerConfig,
    parse_log_to,
)
from rollout_bus.trainer.hf_config import HFSettings, LoraSettings

COMMANDS = ("train", "record")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=None, help="default: $REDIS_URL, else redis://127.0.0.1:6379/0")
    p.add_argument("--namespace", default=None, type=name_arg("namespace"), help="default: $ROLLOUT_BUS_NAMESPACE or 'default'")
    p.add_argument("--policy", default="default", type=name_arg("policy"))
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout-bus trainer", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    t = sub.add_parser("train", help="the reference GRPO trainer (default)")
    _common(t)
    t.add_argument("--shard-url", action="append", default=[], metavar="URL",
                   help="another Redis primary to spread rollouts over, each a whole bus (controller, engines, "
                        "executors); repeat for more: the trainer's shards are --redis-url and these")
    t.add_argument("--trainer-id", default="trainer-0", type=name_arg("trainer id"), help="names the consumer group; stable across restarts")
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
    t.add_argument("--colocate", action="store_true",
                   help="sync mode: offload the policy's engines (weights and KV cache) while training, onload them "
                        "(weights, then KV cache) before the next rollout")
    w = t.add_mutually_exclusive_group()
    w.add_argument("--wait-serving", dest="wait_serving", action="store_true", default=None,
                   help="after publishing, wait until the engines serve the version (default: not in async)")
    w.add_argument("--no-wait-serving", dest="wait_serving", action="store_false")
    t.add_argument("--serving-timeout-s", type=float, default=60.0)
    t.add_argument("--keep-versions", type=int, default=4)
    t.add_argument("--weight-sync", choices=WEIGHT_SYNCS, default="disk",
                   help="broadcast: also send full weights by collective (rank 0 of the engines' weight-update group; "
                        "the version directory stays the fallback); disk: engines load them from the directory")
    t.add_argument("--group-host", default="127.0.0.1", help="broadcast: where engines reach this trainer's store")
    t.add_argument("--group-port", type=int, default=0, help="broadcast: the store's port (0: a free one)")
    t.add_argument("--bucket-mb", type=float, default=64.0, help="broadcast: tensors per bucket, by size")
    t.add_argument("--group-timeout-s", type=float, default=60.0,
                   help="broadcast: how long a group may take to form, or a rank in a broadcast")
    t.add_argument("--group-keep", type=int, default=3,
                   help="broadcast: the newest versions held in memory for the controller's requests")
    t.add_argument("--n-groups", type=int, default=16)
    t.add_argument("--n-samples", type=int, default=8, help="samples per prompt group")
    t.add_argument("--over-sample-groups", type=int, default=None, metavar="N",
                   help="prompt groups the executors draw per sampling round (>= --n-groups): with their dynamic "
                        "filter (rollout-bus executor --filter), extra groups replace those it leaves out")
    t.add_argument("--max-new-tokens", type=int, default=6)
    t.add_argument("--temperature", type=float, default=1.0)
    t.add_argument("--std-normalise", action=argparse.BooleanOptionalAction, default=False,
                   help="divide each group's advantages by its reward std (default off: keeps the reward's scale)")
    t.add_argument("--data", default="{}", help="JSON options for the executors' data source")
    t.add_argument("--rollout-timeout-s", type=float, default=120.0)
    t.add_argument("--get-timeout-s", type=float, default=600.0)
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--minibatches", type=int, default=1)
    t.add_argument("--tis-cap", type=float, default=2.0,
                   help="C: the cap of the importance weight (tis, decoupled) or the band [1/C, C] (mis)")
    t.add_argument("--off-policy", choices=OFF_POLICIES, default="tis",
                   help="the off-policy correction: " + "; ".join(f"{k}: {v}" for k, v in OFF_POLICY_HELP.items()))
    t.add_argument("--ppo-clip", type=float, default=0.2, help="<= 0 turns the PPO clip off")
    t.add_argument("--entropy-coef", type=float, default=0.0, help="weight of the entropy bonus in the loss")
    t.add_argument("--dp-rank", type=int, default=0)
    t.add_argument("--dp-size", type=int, default=1)
    t.add_argument("--dp-strategy", choices=DP_STRATEGIES, default="shared-group")
    t.add_argument("--torch-threads", type=int, default=1)
    t.add_argument("--lease-ttl-s", type=float, default=30.0,
                   help="the policy lease lapses this long after the trainer stops renewing it (a pause longer "
                        "than this deposes the trainer; another may then take the policy)")
    h = t.add_argument_group("Hugging Face models (--model-path a HF directory)")
    h.add_argument("--lora", default=None, metavar="R,ALPHA",
                   help="train a LoRA adapter of rank R and scale ALPHA (peft) on the frozen model and publish "
                        "adapters (the controller serves them on the base pool; it needs --enable-lora); "
                        "default: full fine-tune, publishing whole model directories")
    h.add_argument("--lora-targets", default="all-linear",
                   help="comma-separated module names, or all-linear (every linear layer but the head)")
    h.add_argument("--micro-batch-size", type=int, default=4, help="sequences per forward/backward")
    h.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    h.add_argument("--gradient-checkpointing", action="store_true")
    t.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus /metrics on this port (0: any free one; default: off)")
    lg = t.add_argument_group("metric logs (every step: reward, loss terms, entropy, TIS/clip fractions, "
                              "throughput, staleness, waits and update/publish times)")
    lg.add_argument("--log-to", default="jsonl", metavar="BACKENDS",
                    help=f"comma-separated, of {','.join(LOG_BACKENDS)}; jsonl is always written "
                         "(tensorboard and wandb are extras: pip install 'rollout-bus[tensorboard,wandb]')")
    lg.add_argument("--log-dir", default="runs", help="<dir>/<run>.jsonl, <dir>/tensorboard/<run>/, <dir>/wandb/")
    lg.add_argument("--run-name", default="", help="the run is <run-name>-<policy> (default: the namespace)")
    lg.add_argument("--wandb-project", default="rollout-bus")
    r = sub.add_parser("record", help="a passive recorder of one policy's batches")
    _common(r)
    r.add_argument("--out", required=True, help="directory for <batch_id>.safetensors and index.jsonl")
    r.add_argument("--name", default="recorder", type=name_arg("group"), help="consumer group")
    r.add_argument("--start", default="0", help="where a new group starts: 0 (all retained) or $ (new only)")
    r.add_argument("--max-batches", type=int, default=None)
    return p


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in (*COMMANDS, "-h", "--help"):
        args = ["train", *args]
    return build_parser().parse_args(args)


def trainer_config(ns: argparse.Namespace) -> TrainerConfig:
    from rollout_bus.events.connection import redis_url
    from rollout_bus.events.names import Keys

    data: Any = json.loads(ns.data)
    if not isinstance(data, dict):
        raise SystemExit("--data must be a JSON object")
    lora = parse_lora(ns.lora, ns.lora_targets) if ns.lora else None
    return TrainerConfig(
        policy=ns.policy, trainer_id=ns.trainer_id, namespace=ns.namespace or Keys.from_env().namespace,
        redis_url=ns.redis_url, shards=[redis_url(ns.redis_url), *ns.shard_url] if ns.shard_url else [],
        steps=ns.steps, seed=ns.seed, model_path=ns.model_path,
        initial_version=ns.initial_version, checkpoint_dir=ns.checkpoint_dir, dp_rank=ns.dp_rank,
        dp_size=ns.dp_size, dp_strategy=ns.dp_strategy, get_timeout_s=ns.get_timeout_s,
        torch_threads=ns.torch_threads, lease_ttl_s=ns.lease_ttl_s,
        rollout=RolloutConfig(n_groups=ns.n_groups, n_samples_per_group=ns.n_samples, std_normalise=ns.std_normalise,
                              max_new_tokens=ns.max_new_tokens, temperature=ns.temperature,
                              over_sample_groups=ns.over_sample_groups,
                              timeout_s=ns.rollout_timeout_s, data=data),
        schedule=ScheduleConfig(mode=ns.mode, in_flight=ns.in_flight, max_staleness=ns.max_staleness,
                                stale_policy=ns.stale_policy, colocate=ns.colocate),
        publish=PublishConfig(weights_root=ns.weights_root, wait_serving=ns.wait_serving,
                              serving_timeout_s=ns.serving_timeout_s, keep_versions=ns.keep_versions,
                              weight_sync=ns.weight_sync, group_host=ns.group_host, group_port=ns.group_port,
                              bucket_mb=ns.bucket_mb, group_timeout_s=ns.group_timeout_s,
                              group_keep=ns.group_keep),
        optim=OptimConfig(lr=ns.lr, epochs=ns.epochs, minibatches=ns.minibatches),
        loss=LossSettings(tis_cap=ns.tis_cap, ppo_clip=ns.ppo_clip if ns.ppo_clip > 0 else None,
                          entropy_coef=ns.entropy_coef, off_policy=ns.off_policy),
        log=LogConfig(to=parse_log_to(ns.log_to), dir=ns.log_dir, run_name=ns.run_name,
                      wandb_project=ns.wandb_project),
        hf=HFSettings(micro_batch_size=ns.micro_batch_size, temperature=ns.temperature, device=ns.device,
                      gradient_checkpointing=ns.gradient_checkpointing, lora=lora),
    ).validate()


def parse_lora(spec: str, targets: str = "all-linear") -> LoraSettings:
    """``"8,16"`` -> rank 8, alpha 16; ``SystemExit`` saying the form otherwise."""
    parts = spec.split(",")
    try:
        r, alpha = int(parts[0]), int(parts[1]) if len(parts) > 1 else 2 * int(parts[0])
    except ValueError:
        raise SystemExit(f"--lora must be R,ALPHA (two integers, e.g. 8,16), got {spec!r}") from None
    if len(parts) > 2 or r < 1 or alpha < 1:
        raise SystemExit(f"--lora must be R,ALPHA with R >= 1 and ALPHA >= 1, got {spec!r}")
    names: list[str] | str = targets if targets == "all-linear" else [t for t in targets.split(",") if t]
    return LoraSettings(r=r, alpha=alpha, target_modules=names)


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def run_trainer(ns: argparse.Namespace, setup: Callable[[Trainer], None] | None = None) -> int:
    """Run the reference trainer; ``setup`` sees it before it starts (to add hooks)."""
    from rollout_bus.trainer.config import ConfigError

    try:
        config = trainer_config(ns)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    from rollout_bus.lm.files import weights_root_problem

    with contextlib.suppress(OSError):  # the trainer writes the versions: it may make the root (shared filesystem)
        Path(config.publish.weights_root).mkdir(parents=True, exist_ok=True)
    problem = weights_root_problem(config.publish.weights_root)
    if problem is not None:
        raise SystemExit(problem)

    from rollout_bus.events.connection import connect
    from rollout_bus.events.epoch import stop_on_bus_reset
    from rollout_bus.events.errors import LeaseLost
    from rollout_bus.events.metrics import serve_metrics
    from rollout_bus.events.names import Keys
    from rollout_bus.trainer.service import Trainer

    if ns.metrics_port is not None:
        serve_metrics(ns.metrics_port)
    client = connect(config.redis_url)
    trainer = Trainer(config, client)
    if setup is not None:
        setup(trainer)
    # with shards, each shard's epoch is the shard monitor's: one restarted empty is a lost shard, not the run's end
    watching = (stop_on_bus_reset(client, Keys(config.namespace), "trainer") if not config.shards
                else contextlib.nullcontext(None))
    try:
        with watching as watch:  # SIGTERM: SystemExit, then stop
            try:
                trainer.start()
                state = trainer.run()
                logging.getLogger("trainer").info("done: %d steps, version %d", state.step, state.version)
            except LeaseLost:
                if watch is not None:
                    watch.check_now()  # the lease went with the rest of Redis's data: that is the cause to report
                raise
            finally:
                trainer.stop()
    except LeaseLost as exc:
        logging.getLogger("trainer").error(
            "deposed: trainer %s no longer holds the lease of policy %s (%s); it stops and writes nothing more "
            "(exit %d)", config.trainer_id, config.policy, exc, LeaseLost.exit_code)
        return LeaseLost.exit_code
    finally:
        client.close()
    return 0


def run_recorder(ns: argparse.Namespace) -> int:
    from rollout_bus.events.connection import connect
    from rollout_bus.events.epoch import stop_on_bus_reset
    from rollout_bus.events.names import Keys
    from rollout_bus.trainer.recorder import Recorder, RecorderConfig

    client = connect(ns.redis_url)
    keys = Keys(ns.namespace) if ns.namespace else Keys.from_env()
    recorder = Recorder(client, keys, RecorderConfig(policy=ns.policy, out_dir=ns.out, name=ns.name,
                                                     start_id=ns.start))
    try:
        with stop_on_bus_reset(client, keys, "recorder"):
            try:
                recorder.start()
                recorder.run(ns.max_batches)
            finally:
                recorder.stop()
                recorder.close()
    finally:
        client.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse(argv)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if ns.command == "record":
        return run_recorder(ns)
    return run_trainer(ns)


if __name__ == "__main__":
    sys.exit(main())
