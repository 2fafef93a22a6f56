"""Running the gateway on an event loop that already runs: inside an executor, or under ``gateway.cli``."""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import Registry
from rollout_bus.events.schema import Producer
from rollout_bus.events.sessions import SessionStore
from rollout_bus.gateway.app import build_app
from rollout_bus.gateway.chat import ChatFormat
from rollout_bus.gateway.engines import Pinner
from rollout_bus.gateway.keys import GATEWAY_API_KEYS_ENV, ClientKeys, KeysError
from rollout_bus.gateway.metrics import GatewayMetrics
from rollout_bus.gateway.service import Gateway

ENGINE_API_KEY_ENV = "ROLLOUT_BUS_ENGINE_API_KEY"
"""The engines' key: the gateway sends it to the engines; no client of the gateway ever holds it."""
log = logging.getLogger(__name__)


def make_gateway(client: Any, keys: Keys, fmt: ChatFormat, *, instance: str, engine_key: str | None,
                 metrics: GatewayMetrics | None = None, wait_s: float = 30.0) -> Gateway:
    """A gateway reaching the engines with ``engine_key`` (``$ROLLOUT_BUS_ENGINE_API_KEY``)."""
    producer = Producer("gateway", instance)
    return Gateway(SessionStore(client, keys), Publisher(client, keys, producer),
                   Pinner(Registry(client, keys), api_key=engine_key, wait_s=wait_s), fmt, metrics=metrics,
                   instance=instance)


@dataclass
class Running:
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def session_url(self, sid: str) -> str:
        return f"{self.url}/sessions/{sid}/v1"

    async def stop(self) -> None:
        await self.runner.cleanup()


def is_loopback(host: str) -> bool:
    """Whether ``host`` is only reachable from this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_keys(host: str, client_keys: ClientKeys | None, engine_key: str | None) -> None:
    """``KeysError`` for a gateway that would be open to the network, or whose clients would hold the engines."""
    if not client_keys and not is_loopback(host):
        raise KeysError(f"refusing to serve on {host}, which other machines reach, without client keys: set "
                        f"${GATEWAY_API_KEYS_ENV} or --api-keys-file, or serve on 127.0.0.1")
    if client_keys:
        client_keys.refuse_engine_key(engine_key)


async def serve(gateway: Gateway, *, host: str = "127.0.0.1", port: int = 0,
                client_keys: ClientKeys | None = None) -> Running:
    """Start the gateway's HTTP server on the running loop; port 0 takes a free one. Refused (``KeysError``)
    on a non-loopback ``host`` without client keys, or with a client key that is the engines' key."""
    check_keys(host, client_keys, gateway.pinner.api_key)
    runner = web.AppRunner(build_app(gateway, client_keys=client_keys), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = port
    sockets = getattr(site._server, "sockets", None)
    if sockets:
        bound = int(sockets[0].getsockname()[1])
    return Running(runner, host, bound)


