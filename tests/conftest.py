"""Shared fixtures: a private redis-server per test module, a unique namespace per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import fakeredis
import pytest
import redis

from rollout_bus.events.connection import connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on a free port, owned by this test module and stopped by pid."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture()
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = connect(redis_server.url)
    yield client
    client.close()


@pytest.fixture()
def keys() -> Keys:
    """A namespace of its own for each test, instead of FLUSHALL."""
    return Keys(f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture()
def fake_client() -> redis.Redis:
    return fakeredis.FakeRedis()
