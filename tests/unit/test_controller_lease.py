"""One active controller per namespace: the lease, and a standby that takes over when it lapses."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import fakeredis
import pytest
import redis

from rollout_bus.controller.lease import Lease
from rollout_bus.controller.runner import LeaderRunner
from rollout_bus.events.names import Keys


@pytest.fixture(params=["fakeredis", "redis-server"])
def client(request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    if request.param == "fakeredis":
        yield fakeredis.FakeRedis()
    else:
        yield request.getfixturevalue("redis_client")


class StubService:
    def __init__(self, log: list[str], name: str) -> None:
        self.log = log
        self.name = name

    async def start(self) -> None:
        self.log.append(f"{self.name} start")

    async def stop(self, *, stop_engines: bool | None = None) -> None:
        self.log.append(f"{self.name} stop engines={stop_engines}")


def test_only_the_holder_can_renew_or_release(client: redis.Redis, keys: Keys) -> None:
    a = Lease(client, keys.controller_lease, "a", ttl_s=5)
    b = Lease(client, keys.controller_lease, "b", ttl_s=5)
    assert a.try_acquire()
    assert not b.try_acquire()
    assert not b.renew()
    assert not b.release()
    assert a.holder() == "a"
    assert a.renew()
    assert a.release()
    assert b.try_acquire()


def test_a_lapsed_lease_can_be_taken(client: redis.Redis, keys: Keys) -> None:
    a = Lease(client, keys.controller_lease, "a", ttl_s=0.1)
    b = Lease(client, keys.controller_lease, "b", ttl_s=0.1)
    assert a.try_acquire()
    assert not b.try_acquire()
    asyncio.run(asyncio.sleep(0.2))  # a stops renewing: it died
    assert b.try_acquire()
    assert not a.renew()


def test_a_standby_takes_over_when_the_active_ones_lease_lapses(client: redis.Redis, keys: Keys) -> None:
    async def scenario() -> list[str]:
        log: list[str] = []
        ttl = 0.3
        first = LeaderRunner(Lease(client, keys.controller_lease, "first", ttl), lambda: StubService(log, "first"),
                             ttl)
        second = LeaderRunner(Lease(client, keys.controller_lease, "second", ttl),
                              lambda: StubService(log, "second"), ttl)
        stop_first, stop_second = asyncio.Event(), asyncio.Event()
        t1 = asyncio.create_task(first.run(stop_first))
        await asyncio.wait_for(first.active.wait(), 5)
        t2 = asyncio.create_task(second.run(stop_second))
        await asyncio.sleep(2 * ttl)
        assert not second.active.is_set()  # stands by while the first renews
        # The first controller hangs: it stops renewing without releasing.
        first.lease.renew = lambda: True  # type: ignore[method-assign]
        first.lease.release = lambda: False  # type: ignore[method-assign]
        t1.cancel()
        await asyncio.gather(t1, return_exceptions=True)
        await asyncio.wait_for(second.active.wait(), 5)
        assert second.lease.holder() == "second"
        stop_second.set()
        await asyncio.wait_for(t2, 5)
        assert second.lease.holder() is None  # a clean stop releases the lease
        return log

    log = asyncio.run(scenario())
    assert log[0] == "first start"
    assert log[-2:] == ["second start", "second stop engines=None"]


def test_an_active_controller_that_loses_its_lease_steps_down_leaving_the_engines(
        client: redis.Redis, keys: Keys) -> None:
    async def scenario() -> list[str]:
        log: list[str] = []
        runner = LeaderRunner(Lease(client, keys.controller_lease, "me", 0.3), lambda: StubService(log, "me"), 0.3)
        stop = asyncio.Event()
        task = asyncio.create_task(runner.run(stop))
        await asyncio.wait_for(runner.active.wait(), 5)
        client.set(keys.controller_lease, "someone-else", px=60_000)  # e.g. it was paused past its ttl
        await asyncio.wait_for(runner.lost.wait(), 5)
        await asyncio.sleep(0.1)
        stop.set()
        await asyncio.wait_for(task, 5)
        return log

    assert asyncio.run(scenario()) == ["me start", "me stop engines=False"]


def test_a_lease_whose_holder_died_on_this_host_is_taken_at_once(client: redis.Redis, keys: Keys) -> None:
    import subprocess

    from rollout_bus.controller.lease import owner_token

    gone = subprocess.Popen(["true"])
    gone.wait()
    lease = Lease(client, keys.controller_lease, owner_token("new"), ttl_s=5)
    client.set(keys.controller_lease, f"old:another-host:{gone.pid}:deadbeef", px=60_000)
    assert not lease.try_acquire()  # a holder on another host cannot be checked: it lapses in a minute
    client.set(keys.controller_lease, f"old:{socket.gethostname()}:{gone.pid}:deadbeef", px=60_000)
    assert lease.try_acquire() and lease.holder() == lease.owner and lease.token is not None


def test_a_leader_whose_renewals_fail_steps_down_before_its_lease_can_lapse(
        client: redis.Redis, keys: Keys) -> None:
    from rollout_bus.events.errors import BusUnavailable

    async def scenario() -> tuple[list[str], int]:
        log: list[str] = []
        ttl = 0.8
        runner = LeaderRunner(Lease(client, keys.controller_lease, "me", ttl), lambda: StubService(log, "me"), ttl)
        stop = asyncio.Event()
        task = asyncio.create_task(runner.run(stop))
        await asyncio.wait_for(runner.active.wait(), 5)

        def unreachable() -> bool:
            raise BusUnavailable("Redis unreachable")
        runner.lease.renew = unreachable  # type: ignore[method-assign]  # alive, but cut off from Redis
        runner.lease.try_acquire = lambda: False  # type: ignore[method-assign]
        await asyncio.wait_for(runner.lost.wait(), 5)
        left_ms = int(client.pttl(keys.controller_lease))  # the lease it last renewed has not lapsed yet
        stop.set()
        await asyncio.wait_for(task, 5)
        return log, left_ms

    log, left_ms = asyncio.run(scenario())
    assert log == ["me start", "me stop engines=False"]
    assert left_ms > 0


def test_a_fenced_registry_refuses_a_token_older_than_the_counter(client: redis.Redis, keys: Keys) -> None:
    from rollout_bus.events.errors import Fenced
    from rollout_bus.events.registry import EngineRecord, EngineState, Registry

    old, new = Lease(client, keys.controller_lease, "old", 5), Lease(client, keys.controller_lease, "new", 5)
    assert old.try_acquire() and old.release() and new.try_acquire()
    assert old.token is not None and new.token is not None and new.token == old.token + 1
    record = EngineRecord("e0", "http://x", EngineState.SERVING)
    Registry(client, keys, fence=new.token).put_engine(record)
    stale = EngineRecord("e0", "http://x", EngineState.STOPPED)
    with pytest.raises(Fenced, match=f"token {old.token} is older than {new.token}"):
        Registry(client, keys, fence=old.token).put_engine(stale)
    with pytest.raises(Fenced):
        Registry(client, keys, fence=old.token).remove_engine("e0")
    assert Registry(client, keys).engines()["e0"].state == EngineState.SERVING
