"""The Guard on a real server that goes away: one log line when lost, one when back, then give up."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_bus.events.connection import Guard, ReconnectPolicy, connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.errors import BusUnavailable, RedisCommandError

pytestmark = pytest.mark.integration


@pytest.fixture()
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of this test alone, since the test kills it."""
    server = RedisServer(data_dir=tmp_path).start()
    yield server
    server.stop()


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rollout_bus.events.connection"]


def test_the_guard_logs_once_when_the_connection_is_lost_and_once_when_it_is_back(
        own_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rollout_bus.events.connection")
    client = connect(own_server.url)
    guard = Guard(client, ReconnectPolicy(max_wait_s=20, base_s=0.02, cap_s=0.1), name="test-guard")
    assert guard.call(lambda c: c.set("k", "v"))
    own_server.kill()
    restarter = threading.Timer(0.6, own_server.restart)
    restarter.start()
    try:
        started = time.monotonic()
        assert guard.call(lambda c: c.ping()) is True
        assert time.monotonic() - started >= 0.5
    finally:
        restarter.join()
    lines = messages(caplog)
    assert len(lines) == 2, lines
    assert lines[0].startswith("test-guard: connection to Redis lost (")
    assert lines[1].startswith("test-guard: connection to Redis is back after ")
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == "rollout_bus.events.connection")
    assert guard.outages == 1
    assert guard.call(lambda c: c.ping()) is True
    assert len(messages(caplog)) == 2
    client.close()


def test_the_guard_raises_bus_unavailable_when_redis_stays_down(
        own_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rollout_bus.events.connection")
    client = connect(own_server.url)
    guard = Guard(client, ReconnectPolicy(max_wait_s=0.5, base_s=0.02, cap_s=0.1), name="doomed")
    guard.call(lambda c: c.ping())
    own_server.kill()
    started = time.monotonic()
    with pytest.raises(BusUnavailable, match=r"doomed: Redis unreachable for \d+\.\ds \(budget 0\.5s\)") as info:
        guard.call(lambda c: c.ping())
    assert 0.5 <= time.monotonic() - started < 5
    assert info.value.__cause__ is None
    assert [m for m in messages(caplog) if "lost" in m] and not [m for m in messages(caplog) if "back" in m]
    client.close()


def test_a_wrong_password_fails_at_once_instead_of_retrying_for_the_whole_budget(tmp_path: Path) -> None:
    with RedisServer(data_dir=tmp_path, extra_args=["--requirepass", "s3cret"]) as server:  # ready despite NOAUTH
        good = connect(server.url.replace("redis://", "redis://:s3cret@"))
        assert Guard(good).call(lambda c: c.ping()) is True
        good.close()
        for url in (server.url, server.url.replace("redis://", "redis://:wrong@")):
            client = connect(url)
            guard = Guard(client, ReconnectPolicy(max_wait_s=30), name="bad-auth")
            started = time.monotonic()
            with pytest.raises(RedisCommandError, match="bad-auth: AuthenticationError"):
                guard.call(lambda c: c.ping())
            assert time.monotonic() - started < 5
            client.close()
