"""Split brain: the leader is alive but cut off from Redis (a TCP proxy in front of its connection).

It must step down before a standby can take the lease, and whatever it still sends afterwards
carries an old fencing token, which the registry's Lua and the engine both refuse.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis

from rollout_bus.controller.config import ControllerConfig
from rollout_bus.controller.lease import Lease
from rollout_bus.controller.runner import LeaderRunner
from rollout_bus.controller.service import InferenceController
from rollout_bus.engine.http_client import EngineClient, EngineHTTPError, close_shared_session
from rollout_bus.events.connection import connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.errors import Fenced
from rollout_bus.events.names import Keys
from rollout_bus.events.registry import EngineState, Registry
from tests.engine_proc import make_weights_dir
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.integration
TTL_S = 3.0


def test_a_leader_cut_off_from_redis_steps_down_before_the_standby_takes_over_and_is_fenced(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    make_weights_dir(tmp_path / "root" / "base", seed=0)
    proxy = TcpProxy(redis_server.port).start()
    common = dict(namespace=keys.namespace, num_engines=1, model_path=str(tmp_path / "root" / "base"),
                  weights_root=str(tmp_path / "root"), lease_ttl_s=TTL_S, health_interval_s=0.3,
                  janitor_interval_s=0)
    cfg_a = ControllerConfig(instance="a", log_dir=str(tmp_path / "logs-a"), **common)  # type: ignore[arg-type]
    cfg_b = ControllerConfig(instance="b", log_dir=str(tmp_path / "logs-b"), **common)  # type: ignore[arg-type]
    client_a, client_b = connect(proxy.url), connect(redis_server.url)
    lease_a = Lease(client_a, keys.controller_lease, "a", TTL_S)
    lease_b = Lease(client_b, keys.controller_lease, "b", TTL_S)
    runner_a = LeaderRunner(lease_a, lambda: InferenceController(cfg_a, client_a, fence=lease_a.token), TTL_S)
    runner_b = LeaderRunner(lease_b, lambda: InferenceController(cfg_b, client_b, fence=lease_b.token), TTL_S)

    async def scenario() -> None:
        stop_a, stop_b = asyncio.Event(), asyncio.Event()
        task_a = asyncio.create_task(runner_a.run(stop_a))
        await asyncio.wait_for(runner_a.active.wait(), 90)
        assert isinstance(runner_a.service, InferenceController)
        engine = runner_a.service.engines["engine-0"].record
        assert engine.state == EngineState.SERVING
        token_a = lease_a.token
        task_b = asyncio.create_task(runner_b.run(stop_b))
        await asyncio.sleep(TTL_S)
        assert not runner_b.active.is_set()  # stands by while the leader renews
        try:
            proxy.cut()  # the leader is alive, its renewals fail from now on
            a_down = b_holds = None
            deadline = time.monotonic() + 30
            while b_holds is None:
                now = time.monotonic()
                assert now < deadline, "the standby never took over"
                if a_down is None and runner_a.lost.is_set():
                    a_down = now
                if redis_client.get(keys.controller_lease) == b"b":
                    b_holds = now
                await asyncio.sleep(0.02)
            assert proxy.refused > 0  # the cut was real: the leader kept trying to reach Redis
            assert a_down is not None and a_down < b_holds  # no moment with two leaders
            assert not runner_a.active.is_set()
            await asyncio.wait_for(runner_b.active.wait(), 90)
            assert isinstance(runner_b.service, InferenceController)
            adopted = runner_b.service.engines["engine-0"].record
            assert adopted.pid == engine.pid  # the engines were left running and adopted, not relaunched
            token_b = lease_b.token
            assert token_a is not None and token_b is not None and token_b > token_a
            # the old leader's writes are refused: by the registry's Lua ...
            with pytest.raises(Fenced, match=f"token {token_a} is older than {token_b}"):
                Registry(client_b, keys, fence=token_a).put_engine(engine)
            assert Registry(redis_client, keys).engines()["engine-0"].state == EngineState.SERVING
            # ... and by the engine, which has seen the new leader's token
            with pytest.raises(EngineHTTPError) as refused:
                await EngineClient(engine.url, fence=token_a).pause_generation("abort")
            assert refused.value.fenced and refused.value.status == 409
            assert (await EngineClient(engine.url, fence=token_b).model_info())["weight_version"] == "0"
        finally:
            proxy.heal()
            stop_a.set()
            stop_b.set()
            await asyncio.wait_for(asyncio.gather(task_a, task_b, return_exceptions=True), 60)
            await close_shared_session()

    try:
        asyncio.run(scenario())
    finally:
        proxy.close()
        client_a.close()
        client_b.close()
    assert runner_a.step_downs == 1
