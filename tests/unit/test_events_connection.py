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


def test_a_sentinel_url_names_its_sentinels_master_db_and_credentials() -> None:
    from rollout_bus.events.connection import SentinelURL

    parsed = SentinelURL.parse("redis+sentinel://bus:s%40cret@h1:26379,h2:26380,h3/mymaster/2"
                               "?sentinel_password=sp&check_s=3")
    assert parsed.sentinels == (("h1", 26379), ("h2", 26380), ("h3", 26379))
    assert (parsed.master, parsed.db, parsed.username, parsed.password) == ("mymaster", 2, "bus", "s@cret")
    assert (parsed.sentinel_password, parsed.check_s) == ("sp", 3.0)
    assert SentinelURL.parse("redis+sentinel://h1:26379/m").db == 0


@pytest.mark.parametrize(("url", "says"), [
    ("redis+sentinel:///mymaster/0", "names no sentinel"),
    ("redis+sentinel://h1:26379/", "must name the master"),
    ("redis+sentinel://h1:26379/m/0/x", "must name the master"),
    ("redis+sentinel://h1:26379/m/zero", "must be a number"),
    ("redis+sentinel://h1:port/m", "must be host:port"),
    ("redis+sentinel://h1:26379/m?sentinel_pass=x", "unknown options"),
    ("redis+sentinel://u:pw@h1:99999/m", "must be host:port"),
])
def test_a_malformed_sentinel_url_says_what_to_fix_and_hides_the_password(url: str, says: str) -> None:
    from rollout_bus.events.connection import SentinelURL
    from rollout_bus.events.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=says) as info:
        SentinelURL.parse(url)
    assert "pw" not in str(info.value)


def test_an_unreachable_sentinel_is_bus_unavailable_within_its_check_time() -> None:
    started = time.monotonic()
    with pytest.raises(BusUnavailable, match="no Sentinel of master 'mymaster' of sentinels 127.0.0.1:.* reachable"):
        connect(f"redis+sentinel://127.0.0.1:{free_port()},127.0.0.1:{free_port()}/mymaster/0?check_s=0.5")
    assert time.monotonic() - started < 5


def test_durability_waits_for_a_replica_only_when_one_is_configured(monkeypatch: pytest.MonkeyPatch,
                                                                     fake_client: redis.Redis) -> None:
    from rollout_bus.events.connection import durability
    from rollout_bus.events.errors import InvalidRequest

    assert durability(fake_client).replicas == 0
    monkeypatch.setenv("ROLLOUT_BUS_WAIT_REPLICAS", "2")
    monkeypatch.setenv("ROLLOUT_BUS_WAIT_TIMEOUT_MS", "150")
    assert (durability(fake_client).replicas, durability(fake_client).timeout_ms) == (2, 150)
    monkeypatch.setenv("ROLLOUT_BUS_WAIT_TIMEOUT_MS", "soon")
    with pytest.raises(InvalidRequest, match="ROLLOUT_BUS_WAIT_TIMEOUT_MS must be a whole number"):
        durability(fake_client)
