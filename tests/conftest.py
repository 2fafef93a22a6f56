"""Shared fixtures: a private redis-server per test module, a unique namespace per test."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator

import fakeredis
import pytest
import redis

from rollout_bus.events.connection import connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys

SYSTEM_TEMP = tempfile.gettempdir()
"""The system's temp directory, for what the suite keeps between runs on purpose (the warm-start cache)."""


@pytest.fixture(scope="session", autouse=True)
def _temp_files_in_pytests_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Temp files of the suite and of every process it starts (TMPDIR) go under pytest's base temp
    directory, which pytest prunes, never loose into the system's."""
    root = str(tmp_path_factory.mktemp("tmp"))
    os.environ.setdefault("ROLLOUT_BUS_SYSTEM_TEMP", SYSTEM_TEMP)  # for caches kept on purpose (shared_init_dir)
    saved = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = root
    os.environ["TMPDIR"] = root
    yield
    tempfile.tempdir = saved[0]
    if saved[1] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved[1]


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
