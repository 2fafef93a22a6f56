"""Fencing that survives Redis losing data: equal tokens of another holder, raising the counter past
what engines saw, durable lease writes, and the runner judging a fence refusal (never the engine)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
import redis
from aiohttp import web

from rollout_bus.controller.config import ControllerConfig
from rollout_bus.controller.lease import MAX_TOKEN, Lease
from rollout_bus.controller.runner import LeaderRunner
from rollout_bus.controller.service import InferenceController
from rollout_bus.engine.http_client import EngineClient, EngineHTTPError, close_shared_session
from rollout_bus.events.embedded import free_port
from rollout_bus.events.errors import Fenced, ReplicationTimeout
from rollout_bus.events.names import Keys
from rollout_bus.events.registry import EngineRecord, EngineState, Registry


@pytest.fixture(params=["fakeredis", "redis-server"])
def client(request: pytest.FixtureRequest) -> Iterator[redis.Redis]:
    if request.param == "fakeredis":
        yield fakeredis.FakeRedis()
    else:
        yield request.getfixturevalue("redis_client")


def lease(client: redis.Redis, keys: Keys, owner: str) -> Lease:
    return Lease(client, keys.controller_lease, owner, ttl_s=5)


def test_an_equal_token_from_another_holder_is_refused(client: redis.Redis, keys: Keys) -> None:
    old, new = lease(client, keys, "old"), lease(client, keys, "new")
    assert old.try_acquire() and old.token == 1
    # Redis loses the tail of its log: the lease and the increment are gone, and a standby gets the same number
    client.delete(keys.controller_lease)
    client.set(keys.controller_fence, 0)
    assert new.try_acquire() and new.token == old.token
    record = EngineRecord("e0", "http://x", EngineState.SERVING)
    Registry(client, keys, fence=new.token, holder=new.owner).put_engine(record)
    with pytest.raises(Fenced, match="not the one the current holder took"):
        Registry(client, keys, fence=old.token, holder=old.owner).put_engine(
            EngineRecord("e0", "http://x", EngineState.STOPPED))
    assert Registry(client, keys).engines()["e0"].state == EngineState.SERVING


def test_after_redis_lost_everything_no_token_writes_until_the_lease_is_taken_again(
        client: redis.Redis, keys: Keys) -> None:
    holder = lease(client, keys, "a")
    assert holder.try_acquire() and holder.release() and holder.try_acquire() and holder.token == 2
    client.delete(keys.controller_lease, keys.controller_fence, keys.controller_fence_holder)  # a restart, empty
    with pytest.raises(Fenced):  # the counter says 0: the token alone would pass
        Registry(client, keys, fence=holder.token, holder=holder.owner).put_engine(
            EngineRecord("e0", "http://x", EngineState.SERVING))
    assert holder.try_acquire() and holder.token == 1  # a new tenure, from an empty counter ...
    assert holder.raise_above(2) == 3 and holder.token == 3  # ... raised past what an engine saw
    Registry(client, keys, fence=3, holder=holder.owner).put_engine(EngineRecord("e0", "http://x", EngineState.SERVING))


def test_only_the_holder_raises_the_counter_and_it_never_goes_back(client: redis.Redis, keys: Keys) -> None:
    a, b = lease(client, keys, "a"), lease(client, keys, "b")
    assert a.try_acquire() and a.token == 1
    assert b.raise_above(50) == 0 and int(client.get(keys.controller_fence) or 0) == 1
    assert a.raise_above(7) == 8 and a.token == 8
    assert a.raise_above(3) == 9  # past the counter even when the engine saw less
    with pytest.raises(Fenced, match="token 8 is older than 9"):
        Registry(client, keys, fence=8, holder="a").put_engine(EngineRecord("e0", "http://x", EngineState.SERVING))
    with pytest.raises(ValueError):
        a.raise_above(MAX_TOKEN + 1)
    assert a.release() and a.raise_above(100) == 0
    assert b.try_acquire() and b.token == 10


def test_lease_and_fence_writes_wait_for_the_replicas(redis_client: redis.Redis, keys: Keys,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_BUS_WAIT_REPLICAS", "1")  # as under Sentinel; this server has no replica
    monkeypatch.setenv("ROLLOUT_BUS_WAIT_TIMEOUT_MS", "20")
    monkeypatch.setenv("ROLLOUT_BUS_WAIT_ATTEMPTS", "1")
    monkeypatch.setenv("ROLLOUT_BUS_WAIT_DEGRADED_S", "0")  # no degraded wait: the error at once
    a = lease(redis_client, keys, "a")
    with pytest.raises(ReplicationTimeout, match="lease"):
        a.try_acquire()
    assert redis_client.get(keys.controller_lease) == b"a"  # on the primary, but not confirmed
    with pytest.raises(ReplicationTimeout, match="fence raise"):
        a.raise_above(5)
    assert a.renew() and a.release()  # a renewal is not waited for: a late replica must not depose the leader


def fenced_engine(body: dict[str, object]) -> tuple[web.AppRunner, str]:
    async def refuse(_: web.Request) -> web.Response:
        return web.json_response(body, status=409)
    app = web.Application()
    app.router.add_get("/model_info", refuse)
    return web.AppRunner(app), f"http://127.0.0.1:{free_port()}"


@pytest.mark.parametrize(("body", "highest"), [
    ({"success": False, "fenced": True, "highest": 41, "message": "fenced: token 3 is older than 41"}, 41),
    ({"success": False, "message": "fenced: token 3 is older than 12: another controller took over"}, 12),
    ({"success": False, "fenced": True, "highest": "9", "message": "fenced"}, None),
])
def test_an_engines_fenced_reply_is_told_apart_and_reported_before_it_is_raised(
        body: dict[str, object], highest: int | None) -> None:
    async def scenario() -> tuple[EngineHTTPError, list[EngineHTTPError]]:
        runner, url = fenced_engine(body)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", int(url.rsplit(":", 1)[1])).start()
        seen: list[EngineHTTPError] = []
        try:
            with pytest.raises(EngineHTTPError) as refused:
                await EngineClient(url, fence=3, on_fenced=seen.append).model_info()
        finally:
            await close_shared_session()
            await runner.cleanup()
        return refused.value, seen

    error, seen = asyncio.run(scenario())
    assert error.fenced and error.fence_highest == highest and seen == [error]


class FencedService:
    """A service that meets an engine whose highest token is ``highest`` as it starts (once)."""

    def __init__(self, log: list[str], lease: Lease, highest: int | None, fenced_once: list[bool]) -> None:
        self.log, self.lease, self.highest, self.once = log, lease, highest, fenced_once
        self.fenced = asyncio.Event()
        self.fence_highest = 0

    async def start(self) -> None:
        self.log.append(f"start token={self.lease.token}")
        if self.highest is not None and not self.once:
            self.once.append(True)
            self.fence_highest = self.highest
            self.fenced.set()

    async def stop(self, *, stop_engines: bool | None = None) -> None:
        self.log.append(f"stop engines={stop_engines}")


def test_a_fence_refusal_while_the_lease_is_ours_raises_the_counter_and_takes_over_again(
        client: redis.Redis, keys: Keys) -> None:
    async def scenario() -> tuple[list[str], LeaderRunner]:
        log: list[str] = []
        me = Lease(client, keys.controller_lease, "me", 0.6)
        runner = LeaderRunner(me, lambda: FencedService(log, me, 40, once), 0.6)
        stop = asyncio.Event()
        task = asyncio.create_task(runner.run(stop))
        await asyncio.wait_for(runner.active.wait(), 5)
        stop.set()
        await asyncio.wait_for(task, 5)
        return log, runner

    once: list[bool] = []
    log, runner = asyncio.run(scenario())
    assert log == ["start token=1", "stop engines=False", "start token=42", "stop engines=None"]
    assert runner.step_downs == 0 and len(runner.retakes) == 1


def test_a_fence_refusal_after_the_lease_was_taken_makes_the_leader_step_down(
        client: redis.Redis, keys: Keys) -> None:
    async def scenario() -> tuple[list[str], LeaderRunner]:
        log: list[str] = []
        me = Lease(client, keys.controller_lease, "me", 30.0)
        runner = LeaderRunner(me, lambda: FencedService(log, me, None, []), 30.0)
        stop = asyncio.Event()
        task = asyncio.create_task(runner.run(stop))
        await asyncio.wait_for(runner.active.wait(), 5)
        client.set(keys.controller_lease, "other", px=60_000)  # paused past its lease; another took over
        client.incr(keys.controller_fence)
        service = runner.service
        assert isinstance(service, FencedService)
        service.fence_highest = 2
        service.fenced.set()  # an engine refused our token
        await asyncio.wait_for(runner.lost.wait(), 5)
        stop.set()
        await asyncio.wait_for(task, 5)
        return log, runner

    log, runner = asyncio.run(scenario())
    assert log == ["start token=1", "stop engines=False"]
    assert runner.step_downs == 1 and runner.retakes == [] and client.get(keys.controller_lease) == b"other"


def test_a_fenced_controller_neither_fails_nor_restarts_an_engine_nor_writes(tmp_path: Path) -> None:
    """A fence refusal spends no restart budget: once fenced, nothing is marked, restarted or written."""
    config = ControllerConfig(namespace="unit", num_engines=1, model_path=str(tmp_path),
                              weights_root=str(tmp_path), log_dir=str(tmp_path / "logs"))

    async def scenario() -> tuple[EngineState, int, list[str]]:
        ctl = InferenceController(config, fakeredis.FakeRedis(), fence=1, holder="me")
        h = ctl.lifecycle.new_handle("engine-0", "http://127.0.0.1:9", managed=True, state=EngineState.SERVING)
        ctl.fenced.set()  # an engine answered 409 fenced
        await ctl.lifecycle.fail(h, "health check failed 3 times: HTTP 409: fenced")
        h.record.state = EngineState.UNHEALTHY
        await ctl.lifecycle.restart(h)
        refused = []
        try:
            await ctl.core.save(h)
        except Fenced as exc:
            refused.append(str(exc))
        await close_shared_session()
        return h.state, h.restart_attempts, refused

    state, attempts, refused = asyncio.run(scenario())
    assert state == EngineState.UNHEALTHY and attempts == 0 and len(refused) == 1


def test_a_leader_fenced_again_and_again_stops_chasing_the_token_and_lets_the_lease_go(
        client: redis.Redis, keys: Keys) -> None:
    """Something that keeps raising tokens (a caller holding the engine key) gets three takeovers, not a loop."""
    async def scenario() -> tuple[list[str], LeaderRunner, bytes | None]:
        log: list[str] = []
        me = Lease(client, keys.controller_lease, "me", 0.6)
        runner = LeaderRunner(me, lambda: FencedService(log, me, (me.token or 0) + 100, []), 0.6)
        stop = asyncio.Event()
        task = asyncio.create_task(runner.run(stop))
        await asyncio.wait_for(runner.lost.wait(), 10)
        await asyncio.sleep(0.2)  # within the lease's wait that follows
        holder = client.get(keys.controller_lease)
        stop.set()
        await asyncio.wait_for(task, 5)
        return log, runner, holder

    log, runner, holder = asyncio.run(scenario())
    # each retake: the counter raised past the engine's highest, then the new tenure's own increment
    assert log[:8] == ["start token=1", "stop engines=False", "start token=103", "stop engines=False",
                       "start token=205", "stop engines=False", "start token=307", "stop engines=False"]
    assert len(runner.retakes) == 3 and runner.step_downs == 1
    assert holder is None  # released for another controller to try


def test_a_leader_that_takes_its_own_unlapsed_lease_back_starts_a_new_tenure_with_a_new_token(
        client: redis.Redis, keys: Keys) -> None:
    """A leader that stepped down (its renewals went quiet) while its key had not lapsed yet takes it back
    under a new token: its engines saw the old one, and an equal token reads as another holder's."""
    me = Lease(client, keys.controller_lease, "me", 30.0)
    assert me.try_acquire() and me.token == 1
    assert me.try_acquire() and me.token == 2  # the key was still ours: a new tenure all the same
    other = Lease(client, keys.controller_lease, "other", 30.0)
    assert not other.try_acquire()
