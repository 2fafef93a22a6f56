"""Fixtures shared by the integration tests: agent sessions' (defined in tests/support/gateway.py), and a TCP proxy
in front of the test's redis-server."""

from collections.abc import Iterator

import pytest

from rollout_bus.events.embedded import RedisServer
from tests.support.gateway import agent_engine, agent_model  # noqa: F401 - fixtures: a tiny LM with room for turns
from tests.support.tcp_proxy import TcpProxy


@pytest.fixture()
def proxy(redis_server: RedisServer) -> Iterator[TcpProxy]:
    """A TCP proxy in front of the test's redis-server that can drop a reply or cut every connection."""
    p = TcpProxy(redis_server.port).start()
    yield p
    p.close()
