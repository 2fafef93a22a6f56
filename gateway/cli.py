"""``rollout-bus gateway``: the session gateway as a role of its own.

``rollout-bus gateway --model-path DIR [--port 8300] [--redis-url URL]`` serves every session of the
namespace; start as many as needed behind one address (they share nothing but the bus). The chat
template comes from ``--model-path`` (a Hugging Face directory; the tiny LM's directory, or none, gives
the tiny LM's character form). ``$ROLLOUT_BUS_ENGINE_API_KEY`` is the key sent to the engines, and no
client's: clients send keys of their own, from ``$ROLLOUT_BUS_GATEWAY_API_KEYS`` and/or
``--api-keys-file`` (``gateway.keys``). It serves on 127.0.0.1 unless told otherwise, and refuses any
other address without client keys. Arguments are parsed before anything heavy is imported (``--help`` is
instant).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Sequence

from rollout_bus.events.names import name_arg

ENGINE_API_KEY_ENV = "ROLLOUT_BUS_ENGINE_API_KEY"
log = logging.getLogger("rollout_bus.gateway")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout-bus gateway",
                                description="The agent session gateway: OpenAI's API per session, exact tokens.")
    p.add_argument("--redis-url", default=None, help="default: $REDIS_URL, else redis://127.0.0.1:6379/0")
    p.add_argument("--namespace", default=None, type=name_arg("namespace"))
    p.add_argument("--host", default="127.0.0.1",
                   help="another address than a loopback one needs client keys ($ROLLOUT_BUS_GATEWAY_API_KEYS or "
                        "--api-keys-file)")
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--api-keys-file", default=None,
                   help="the clients' keys, one per tenant with its policies: JSON or 'TENANT KEY [POLICY ...]' lines "
                        "(added to $ROLLOUT_BUS_GATEWAY_API_KEYS)")
    p.add_argument("--model-path", default=None,
                   help="the served model's directory, for its tokenizer and chat template (none: the tiny LM)")
    p.add_argument("--max-context", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--engine-wait-s", type=float, default=30.0,
                   help="how long a turn waits for an engine of its policy before it fails with 503")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--instance", default=None, help="the producer name of this gateway's events")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if ns.max_context is not None and ns.max_context <= 0:
        print("rollout-bus gateway: --max-context must be positive", file=sys.stderr)
        return 2
    import asyncio
    import signal

    from rollout_bus.events.connection import connect
    from rollout_bus.events.metrics import serve_metrics
    from rollout_bus.events.names import Keys
    from rollout_bus.gateway.chat import ChatError, load_format
    from rollout_bus.gateway.keys import KeysError, load_client_keys
    from rollout_bus.gateway.metrics import GatewayMetrics
    from rollout_bus.gateway.server import check_keys, make_gateway, serve
    from rollout_bus.lm.hf_tokenizer import TokenizerError

    engine_key = os.environ.get(ENGINE_API_KEY_ENV) or None
    try:
        client_keys = load_client_keys(os.environ, ns.api_keys_file)
        check_keys(ns.host, client_keys, engine_key)
    except KeysError as exc:
        print(f"rollout-bus gateway: {exc}", file=sys.stderr)
        return 2
    try:
        fmt = load_format(ns.model_path, max_context=ns.max_context)
    except (ChatError, TokenizerError) as exc:
        print(f"rollout-bus gateway: {exc}", file=sys.stderr)
        return 2
    keys = Keys(ns.namespace) if ns.namespace else Keys.from_env()
    client = connect(ns.redis_url)
    instance = ns.instance or f"{socket.gethostname()}-{os.getpid()}"
    metrics = GatewayMetrics()
    gateway = make_gateway(client, keys, fmt, instance=instance, engine_key=engine_key, metrics=metrics,
                           wait_s=ns.engine_wait_s)
    if ns.metrics_port is not None:
        serve_metrics(ns.metrics_port, registry=metrics.registry)

    async def run() -> None:
        running = await serve(gateway, host=ns.host, port=ns.port, client_keys=client_keys)
        log.info("gateway %s serving sessions of namespace %s on %s for %s", instance, keys.namespace, running.url,
                 f"tenants {', '.join(client_keys.tenants)}" if client_keys else "any caller (no client keys)")
        print(f"gateway listening on {running.url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await running.stop()

    asyncio.run(run())
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
