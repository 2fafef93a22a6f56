"""Run the inference controller: ``rollout-bus controller --model-path DIR --weights-root DIR``.

Flags are parsed into a validated ``ControllerConfig`` before anything heavy is
imported, so ``--help`` and config errors come back at once. The controller then waits
for the namespace lease (standing by while another instance holds it), runs until
SIGTERM or SIGINT, and stops the engines it launched unless ``--keep-engines``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from rollout_bus.controller.config import (
    BACKENDS,
    BROADCAST_PAUSES,
    PAUSE_MODES,
    WEIGHT_SYNCS,
    ConfigError,
    ControllerConfig,
)
from rollout_bus.events.names import name_arg

STOP_PROBE_S = 1.0
"""After a stop signal, how long the controller stops as usual before it asks whether Redis still answers."""


def build_parser() -> argparse.ArgumentParser:
    d = ControllerConfig()
    p = argparse.ArgumentParser(prog="rollout-bus controller", description="rollout-bus inference controller",
                                epilog="Engines on a shared network: set $ROLLOUT_BUS_ENGINE_API_KEY (SGLang's "
                                       "--api-key) for the controller and the executors.")
    p.add_argument("--namespace", default=os.environ.get("ROLLOUT_BUS_NAMESPACE", d.namespace), type=name_arg("namespace"))
    p.add_argument("--redis-url", default=None, help="default: $REDIS_URL, else redis://127.0.0.1:6379/0")
    p.add_argument("--instance", default=d.instance, help="stable instance name (consumer names, producer)")
    p.add_argument("--backend", choices=BACKENDS, default=d.backend)
    p.add_argument("--num-engines", type=int, default=d.num_engines,
                   help="engines of the base policy (adapter policies are served on them too)")
    p.add_argument("--pool", action="append", default=[], dest="pools", metavar="POLICY=N",
                   help="N more engines whose base weights are the full-weight policy POLICY (repeatable)")
    p.add_argument("--eval-engines", type=int, default=d.eval_engines, metavar="K",
                   help="K more base-pool engines kept on the newest weights for eval requests alone (executors "
                        "never send them a training rollout)")
    p.add_argument("--model-path", default=d.model_path)
    p.add_argument("--engine-host", default=d.engine_host,
                   help="where launched engines listen (default: 127.0.0.1 when everything is on this host, "
                        "else 0.0.0.0)")
    p.add_argument("--advertise-host", default=d.advertise_host,
                   help="the address engines register under, reachable from the executors' hosts (default: "
                        "this host's address on the route to Redis)")
    p.add_argument("--engine-arg", action="append", default=[], dest="engine_args",
                   help="extra engine argument (repeatable), e.g. --engine-arg=--tp --engine-arg=2")
    p.add_argument("--token-delay-ms", type=float, default=d.token_delay_ms)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--initial-version", type=int, default=d.initial_version)
    p.add_argument("--adopt-url", action="append", default=[], dest="adopt_urls",
                   help="an engine launched elsewhere to manage (repeatable)")
    p.add_argument("--log-dir", default=None, help="engine logs (default: a temporary directory)")
    p.add_argument("--enable-lora", action="store_true", help="launch engines with LoRA on (adapter policies)")
    p.add_argument("--max-loras-per-batch", type=int, default=d.max_loras_per_batch)
    p.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank, help="largest adapter rank (SGLang)")
    p.add_argument("--lora-target-modules", nargs="+", default=d.lora_target_modules,
                   help="modules adapters may target (SGLang; 'all' by default)")
    p.add_argument("--tp-size", type=int, default=d.tp_size, help="SGLang: GPUs per engine")
    p.add_argument("--base-gpu-id", type=int, default=d.base_gpu_id,
                   help="SGLang: first GPU; engine i starts at base + i * tp-size")
    p.add_argument("--max-engines", type=int, default=d.max_engines,
                   help="the most engines a pool may be scaled to at run time (rollout-bus scale)")
    p.add_argument("--max-pool", action="append", default=[], dest="max_pools", metavar="POLICY=N",
                   help="the most engines of POLICY's pool, over --max-engines (repeatable)")
    p.add_argument("--drain-timeout-s", type=float, default=d.drain_timeout_s,
                   help="how long a scaled-down engine's requests may run on before they are aborted")
    p.add_argument("--drain-grace-s", type=float, default=d.drain_grace_s,
                   help="a draining engine stops no sooner than this after it left the serving set")
    p.add_argument("--colocate", action="store_true",
                   help="engines share devices with a trainer that offloads and onloads them around each step: "
                        "refuses engines that cannot release their memory")
    p.add_argument("--no-memory-saver", dest="memory_saver", action="store_false",
                   help="SGLang: launch without --enable-memory-saver (then engines cannot release memory)")
    p.add_argument("--startup-timeout-s", type=float, default=d.startup_timeout_s)
    p.add_argument("--max-restart-attempts", type=int, default=d.max_restart_attempts)
    p.add_argument("--keep-engines", action="store_true", help="leave launched engines running on exit")
    p.add_argument("--health-interval-s", type=float, default=d.health_interval_s)
    p.add_argument("--health-timeout-s", type=float, default=d.health_timeout_s)
    p.add_argument("--health-failure-threshold", type=int, default=d.health_failure_threshold)
    p.add_argument("--weights-root", default=d.weights_root)
    p.add_argument("--base-policy", default=d.base_policy, type=name_arg("base policy"))
    p.add_argument("--pause-mode", choices=PAUSE_MODES, default=d.pause_mode)
    p.add_argument("--update-timeout-s", type=float, default=d.update_timeout_s)
    p.add_argument("--weight-sync", choices=WEIGHT_SYNCS, default=d.weight_sync,
                   help="broadcast: full weights a trainer offers by collective go through the engines' weight-update "
                        "group (the version directory is the fallback); disk: engines always load the directory")
    p.add_argument("--broadcast-pause", choices=BROADCAST_PAUSES, default=d.broadcast_pause,
                   help="broadcast: pause the engines before the first bucket (SGLang), or only before the last one "
                        "(swap: engines that stage a version and swap it in whole, the CPU engine)")
    p.add_argument("--group-timeout-s", type=float, default=d.group_timeout_s,
                   help="broadcast: how long a weight-update group may take to form, or a rank in a broadcast")
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    p.add_argument("--weights-missing-wait-s", type=float, default=d.weights_missing_wait_s,
                   help="how long a published directory not visible here yet is looked for again, with backoff, "
                        "before it is refused (a shared mount late to show it); 0: refused at once")
    p.add_argument("--lease-ttl-s", type=float, default=d.lease_ttl_s)
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus /metrics on this port (0: any free one; default: off)")
    j = p.add_argument_group("housekeeping (the janitor: retention, payload sweep, expired groups)")
    j.add_argument("--janitor-interval-s", type=float, default=d.janitor_interval_s, help="0 turns it off")
    j.add_argument("--retention-max-len", type=int, default=d.retention_max_len,
                   help="entries kept per stream (never past an unacked entry of a live group); 0: no limit")
    j.add_argument("--retention-max-age-s", type=float, default=d.retention_max_age_s, help="0: no age limit")
    j.add_argument("--payload-max-age-s", type=float, default=d.payload_max_age_s,
                   help="payloads older than this are deleted whatever their readers")
    j.add_argument("--payload-root", action="append", default=[], dest="payload_roots",
                   help="directory of a shm or file payload store the janitor may delete from (repeatable)")
    p.add_argument("--log-level", default="INFO")
    return p


def parse_config(argv: list[str] | None = None) -> tuple[ControllerConfig, str]:
    args = vars(build_parser().parse_args(argv))
    level = args.pop("log_level")
    args["stop_engines_on_exit"] = not args.pop("keep_engines")
    return ControllerConfig.from_mapping(args), level


def main(argv: list[str] | None = None) -> int:
    try:
        config, level = parse_config(argv)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    import contextlib
    from pathlib import Path

    from rollout_bus.lm.files import weights_root_problem

    with contextlib.suppress(OSError):  # as the trainer does: the root may not exist yet on the shared filesystem
        Path(config.weights_root).mkdir(parents=True, exist_ok=True)
    problem = weights_root_problem(config.weights_root)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import asyncio
    import signal

    from rollout_bus.controller.launched import Launched
    from rollout_bus.controller.lease import Lease, owner_token
    from rollout_bus.controller.runner import LeaderRunner
    from rollout_bus.controller.service import InferenceController
    from rollout_bus.events.connection import abandon, answers, connect, probe_client, redis_url
    from rollout_bus.events.epoch import stop_on_bus_reset
    from rollout_bus.events.names import Keys
    from rollout_bus.events.registry import Registry

    async def run() -> None:
        client = connect(config.redis_url)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        async def give_up_if_gone() -> None:
            """Stopping while Redis does not answer: the calls waiting in their reconnect loops (lease, registry,
            streams) give up at their next try, so the stop goes on to the engines instead of waiting minutes."""
            await asyncio.sleep(STOP_PROBE_S)
            probe = probe_client(redis_url(config.redis_url), timeout_s=1.0)
            try:
                if not await asyncio.to_thread(answers, probe):
                    logging.getLogger("controller").warning("stopping while Redis does not answer: not waiting for it")
                    abandon(client)
            finally:
                probe.close()

        def on_signal() -> None:
            if not stop.is_set():
                stop.set()
                loop.create_task(give_up_if_gone())

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        keys = Keys(config.namespace)
        lease = Lease(client, keys.controller_lease, owner_token(config.instance), config.lease_ttl_s)
        launched = Launched.in_dir(config.log_dir, config.instance)  # one record for every service this process runs
        runner = LeaderRunner(lease, lambda: InferenceController(config, client, fence=lease.token, holder=lease.owner,
                                                                 launched=launched),
                              config.lease_ttl_s, launched=launched, registry=Registry(client, keys))
        try:
            with stop_on_bus_reset(client, Keys(config.namespace), "controller", create=True):  # SIGTERM: stop is set
                await runner.run(stop)
        finally:
            client.close()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
