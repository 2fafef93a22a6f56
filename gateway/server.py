"""Running the gateway on an event loop that already runs: inside an executor, or under ``gateway.cli``."""

from __future__ import annotations

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
from rollout_bus.gateway.metrics import GatewayMetrics
from rollout_bus.gateway.service import Gateway

ENGINE_API_KEY_ENV = "ROLLOUT_BUS_ENGINE_API_KEY"
log = logging.getLogger(__name__)


def make_gateway(client: Any, keys: Keys, fmt: ChatFormat, *, instance: str, api_key: str | None,
                 metrics: GatewayMetrics | None = None, wait_s: float = 30.0) -> Gateway:
    producer = Producer("gateway", instance)
    return Gateway(SessionStore(client, keys), Publisher(client, keys, producer),
                   Pinner(Registry(client, keys), api_key=api_key, wait_s=wait_s), fmt, metrics=metrics,
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


async def serve(gateway: Gateway, *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None) -> Running:
    """Start the gateway's HTTP server on the running loop; port 0 takes a free one."""
    runner = web.AppRunner(build_app(gateway, api_key=api_key), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = port
    sockets = getattr(site._server, "sockets", None)
    if sockets:
        bound = int(sockets[0].getsockname()[1])
    return Running(runner, host, bound)


