"""The Guard's error translation, without a server."""

from __future__ import annotations

import time

import pytest
import redis

from rollout_bus.events.connection import Guard, ReconnectPolicy, connect, is_busygroup, redis_url
from rollout_bus.events.embedded import free_port
from rollout_bus.events.errors import BusUnavailable, Failure, RedisCommandError


def test_an_error_reply_becomes_a_redis_command_error(fake_client: redis.Redis) -> None:
    fake_client.set("k", "not a number")
    with pytest.raises(RedisCommandError, match="not an integer") as info:
        Guard(fake_client).call(lambda c: c.incr("k"))
    assert isinstance(info.value, Failure)
    assert info.value.__cause__ is None


def test_a_client_side_driver_error_becomes_a_redis_command_error(fake_client: redis.Redis) -> None:
    with pytest.raises(RedisCommandError, match="DataError"):
        Guard(fake_client).call(lambda c: c.set("k", {"a": 1}))


def test_results_pass_through(fake_client: redis.Redis) -> None:
    guard = Guard(fake_client)
    assert guard.call(lambda c: c.set("k", "v")) is True
    assert guard.call(lambda c: c.get("k")) == b"v"
    assert guard.outages == 0


def test_nothing_listening_is_bus_unavailable_after_the_budget() -> None:
    client = connect(f"redis://127.0.0.1:{free_port()}/0")
    guard = Guard(client, ReconnectPolicy(max_wait_s=0.2, base_s=0.01, cap_s=0.05))
    started = time.monotonic()
    with pytest.raises(BusUnavailable, match="budget 0.2s"):
        guard.call(lambda c: c.ping())
    assert time.monotonic() - started < 5
    assert guard.outages == 1


def test_the_url_comes_from_the_argument_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://env:1/0")
    assert redis_url("redis://arg:2/0") == "redis://arg:2/0"
    assert redis_url() == "redis://env:1/0"
    monkeypatch.delenv("REDIS_URL")
    assert redis_url() == "redis://127.0.0.1:6379/0"


def test_busygroup_is_recognised() -> None:
    assert is_busygroup(redis.ResponseError("BUSYGROUP Consumer Group name already exists"))
    assert not is_busygroup(redis.ResponseError("WRONGTYPE"))
