"""Run one rollout executor: ``rollout-bus executor [--index 0] [--redis-url URL] ...``.

Arguments are parsed before anything heavy is imported, so ``--help`` is instant.
SIGTERM or SIGINT: finish the current job, then stop (a second one stops at once).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from rollout_bus.events.names import name_arg


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout-bus executor", description="Rollout executor (an rq worker).")
    p.add_argument("--redis-url", default=None, help="default: $REDIS_URL, else redis://127.0.0.1:6379/0")
    p.add_argument("--namespace", default=None, type=name_arg("namespace"), help="default: $ROLLOUT_BUS_NAMESPACE or 'default'")
    p.add_argument("--index", type=int, default=None,
                   help="a stable name, <host>-<namespace>-executor-<index>, that a restart takes over (one per "
                        "executor of a host); default: a name of this process alone")
    p.add_argument("--queues", default="rollout,eval", help="comma-separated, in priority order: rollout, eval")
    p.add_argument("--payload-store", default="redis", help="redis, shm, shm:/dir, memfd or file:/shared/dir")
    g = p.add_argument_group("plug-ins (dotted paths)")
    g.add_argument("--data-source", default="rollout_bus.tasks.arithmetic.ArithmeticSource")
    g.add_argument("--data-source-args", default="{}", help="JSON object of keyword arguments")
    g.add_argument("--generate", default="rollout_bus.executor.generate.single_turn")
    g.add_argument("--reward", default="rollout_bus.tasks.arithmetic.exact_match")
    g.add_argument("--group-reward", action="store_true", help="the reward takes a group, returns a list")
    g.add_argument("--filter", default=None, help="dynamic sampling filter, e.g. executor.filters.nonzero_reward_std")
    g.add_argument("--tokenizer", default="rollout_bus.lm.tokenizer")
    g.add_argument("--tokenizer-args", default="{}",
                   help='JSON object: build the tokenizer with these, e.g. --tokenizer '
                        'rollout_bus.lm.hf_tokenizer.ChatTokenizer --tokenizer-args \'{"path": "MODEL_DIR"}\'')
    a = p.add_argument_group("agents (multi-turn episodes through the session gateway)")
    a.add_argument("--agent", default=None,
                   help="dotted path of 'async def episode(client, item) -> reward' (an OpenAI client bound to the "
                        "sample's session), or 'external' (sessions handed out to agents that run elsewhere)")
    a.add_argument("--agent-model-path", default=None,
                   help="the served model's directory, for its chat template (default: the tiny LM's form)")
    a.add_argument("--agent-max-context", type=int, default=None)
    a.add_argument("--agent-per-turn", action="store_true",
                   help="one sample per turn (the turn's reply, after everything before it) instead of one per episode")
    a.add_argument("--gateway-host", default="127.0.0.1", help="where this executor's gateway listens")
    a.add_argument("--gateway-port", type=int, default=0, help="0: a free port")
    r = p.add_argument_group("engines")
    r.add_argument("--registry-refresh-s", type=float, default=0.5)
    r.add_argument("--engine-cooldown-s", type=float, default=2.0)
    r.add_argument("--call-timeout-s", type=float, default=120.0)
    r.add_argument("--max-failovers", type=int, default=8)
    r.add_argument("--no-partial-rollout", action="store_true",
                   help="after an abort, start the response again instead of continuing it")
    r.add_argument("--max-sampling-rounds", type=int, default=4)
    f = p.add_argument_group("fault tolerance")
    f.add_argument("--heartbeat-ttl-s", type=int, default=10)
    f.add_argument("--heartbeat-interval-s", type=float, default=2.0)
    f.add_argument("--reap-interval-s", type=float, default=2.0)
    f.add_argument("--worker-ttl-s", type=int, default=30)
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus /metrics on this port (0: any free one; default: off)")
    p.add_argument("--burst", action="store_true", help="drain the queues, then exit")
    p.add_argument("--max-jobs", type=int, default=None)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def config_from_args(ns: argparse.Namespace) -> Any:
    from rollout_bus.events.names import Keys
    from rollout_bus.executor.config import ExecutorConfig
    from rollout_bus.executor.engines import RouterConfig
    from rollout_bus.executor.plugins import PluginConfig
    from rollout_bus.executor.rollout import RolloutConfig

    args = json.loads(ns.data_source_args)
    if not isinstance(args, dict):
        raise SystemExit("--data-source-args must be a JSON object")
    tokenizer_args = json.loads(ns.tokenizer_args)
    if not isinstance(tokenizer_args, dict):
        raise SystemExit("--tokenizer-args must be a JSON object")
    agent = None
    if ns.agent:
        from rollout_bus.executor.agents import AgentConfig

        if ns.agent_max_context is not None and ns.agent_max_context <= 0:
            raise SystemExit("--agent-max-context must be positive")
        agent = AgentConfig(ns.agent, model_path=ns.agent_model_path, max_context=ns.agent_max_context,
                            host=ns.gateway_host, port=ns.gateway_port, per_turn=ns.agent_per_turn)
    return ExecutorConfig(
        redis_url=ns.redis_url, namespace=ns.namespace or Keys.from_env().namespace, index=ns.index,
        payload_store=ns.payload_store,
        queues=tuple(q.strip() for q in ns.queues.split(",") if q.strip()),
        plugins=PluginConfig(data_source_path=ns.data_source, data_source_args=args, generate_path=ns.generate,
                             reward_path=ns.reward, group_reward=ns.group_reward, filter_path=ns.filter,
                             tokenizer_path=ns.tokenizer, tokenizer_args=tokenizer_args),
        router=RouterConfig(refresh_s=ns.registry_refresh_s, cooldown_s=ns.engine_cooldown_s,
                            call_timeout_s=ns.call_timeout_s, max_failovers=ns.max_failovers,
                            partial_rollout=not ns.no_partial_rollout),
        rollout=RolloutConfig(max_sampling_rounds=ns.max_sampling_rounds),
        heartbeat_ttl_s=ns.heartbeat_ttl_s, heartbeat_interval_s=ns.heartbeat_interval_s,
        reap_interval_s=ns.reap_interval_s, worker_ttl_s=ns.worker_ttl_s, metrics_port=ns.metrics_port, agent=agent,
        log_level=ns.log_level)


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(ns)

    from rollout_bus.events.connection import abandon, connect
    from rollout_bus.events.epoch import check_interval_s, stop_on_bus_reset
    from rollout_bus.events.errors import InvalidRequest
    from rollout_bus.events.names import Keys
    from rollout_bus.executor.errors import PluginError
    from rollout_bus.executor.service import ExecutorService

    try:
        check_interval_s()  # read again by the epoch watch below: a bad value stops the executor before it starts
    except InvalidRequest as exc:
        logging.getLogger("executor").error("cannot start: %s", exc)
        return 2
    service = ExecutorService(config)
    try:
        service.start()
    except PluginError as exc:
        logging.getLogger("executor").error("cannot start: %s", exc)
        service.stop()
        return 2
    watch_client = connect(config.redis_url)
    try:  # SIGTERM on a bus reset: rq's warm shutdown, then the reset is raised
        with stop_on_bus_reset(watch_client, Keys(config.namespace), f"executor-{config.index}"):
            try:
                service.work(burst=ns.burst, max_jobs=ns.max_jobs)
            finally:
                service.stop()
                abandon(watch_client)  # the last epoch check does not wait for a Redis that is gone
    finally:
        watch_client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
