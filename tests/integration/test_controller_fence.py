"""Fencing and failover with real processes: a controller process, its CPU engines and a redis-server.

- An engine that saw a token above the leader's (Redis lost data, or a raised token) is no failing
  engine: the leader checks its lease, raises the counter past that token and adopts the engine again,
  with no restart.
- After FLUSHALL the controller keeps the engine it launched (same pid, a token above any the engine
  saw), launches no second one, and a clean stop leaves no engine process.
- A leader that read ``WeightsPublished`` and died before acting: the standby takes the pending entry
  over at takeover and serves the version within seconds, not after the 600 s claim idle.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rollout_bus.controller.backends import pid_alive
from rollout_bus.engine.http_client import EngineClient, EngineHTTPError, close_shared_session
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.registry import EngineState, Registry
from rollout_bus.events.schema import EngineRestarting, EngineUnhealthy, WeightVersionServing
from tests.engine_proc import make_weights_dir
from tests.integration.test_controller_faults import engine_pids, spawn_controller
from tests.support.controller_driver import (
    find,
    publish_weights,
    read_events,
    wait_until,
    weight_events,
    write_version,
)

pytestmark = pytest.mark.integration
API_KEY = "fence-test-key"


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    make_weights_dir(tmp_path / "root" / "base", seed=0)
    return tmp_path / "root"


@pytest.fixture()
def started(root: Path) -> Iterator[list[int]]:
    """Pids of the processes a test started (controllers, and engines it saw; any engine on this test's model
    too, should a failing test leave one): SIGKILLed if still alive."""
    pids: list[int] = []
    yield pids
    for pid in [*pids, *engine_pids(root / "base")]:
        if pid_alive(pid):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)


def controller_args(keys: Keys, server: RedisServer, root: Path, log_dir: Path, *extra: str) -> list[str]:
    return ["--namespace", keys.namespace, "--redis-url", server.url, "--num-engines", "1",
            "--model-path", str(root / "base"), "--weights-root", str(root), "--lease-ttl-s", "1.5",
            "--health-interval-s", "0.3", "--janitor-interval-s", "0", "--log-dir", str(log_dir),
            "--log-level", "info", *extra]


def serving_pid(registry: Registry) -> int | None:
    record = registry.engines().get("engine-0")
    return record.pid if record is not None and record.state == EngineState.SERVING else None


def fence(client: redis.Redis, keys: Keys) -> int:
    return int(client.get(keys.controller_fence) or 0)


def engine_logs(log_dir: Path) -> list[Path]:
    """One log file per engine process the controller launched (``<id>-<port>.log``)."""
    return sorted(log_dir.glob("engine-*.log"))


def test_an_engine_that_saw_a_newer_token_is_adopted_again_above_it_never_restarted(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path, tmp_path: Path,
        started: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_BUS_ENGINE_API_KEY", API_KEY)
    registry = Registry(redis_client, keys)
    ctl = spawn_controller(controller_args(keys, redis_server, root, tmp_path / "logs"), tmp_path / "ctl.log")
    started.append(ctl.pid)
    wait_until("engine-0 serving", lambda: serving_pid(registry) is not None, 60)
    pid = serving_pid(registry)
    assert pid is not None
    started.append(pid)
    token = fence(redis_client, keys)
    url = registry.engines()["engine-0"].url
    seen = len(read_events(redis_client, keys.engine_stream))

    async def raise_engine_token() -> None:  # what an engine sees after Redis lost the counter
        try:
            await EngineClient(url, api_key=API_KEY, fence=token + 5).model_info()
            with pytest.raises(EngineHTTPError) as refused:
                await EngineClient(url, api_key=API_KEY, fence=token).model_info()
            assert refused.value.fenced and refused.value.fence_highest == token + 5
        finally:
            await close_shared_session()

    asyncio.run(raise_engine_token())  # the controller's next health check is refused (409 fenced)
    wait_until("the counter raised past the engine's token", lambda: fence(redis_client, keys) > token + 5, 20)
    wait_until("engine-0 serving under the new token", lambda: serving_pid(registry) == pid and registry.engines()[
        "engine-0"].updated_ms > time.time_ns() // 1_000_000 - 5_000 and fence(redis_client, keys) > token + 5, 20)
    assert fence(redis_client, keys) == token + 7  # raised past the engine's token + 5, then the new tenure's own
    after = read_events(redis_client, keys.engine_stream)[seen:]
    assert not find(after, EngineRestarting) and not find(after, EngineUnhealthy), after
    assert len(engine_logs(tmp_path / "logs")) == 1 and engine_pids(root / "base") == {pid}
    assert "Redis lost data" in (tmp_path / "ctl.log").read_text()
    ctl.send_signal(signal.SIGTERM)
    assert ctl.wait(30) == 0
    assert engine_pids(root / "base") == set()


def test_after_redis_lost_its_keys_the_controller_keeps_its_engine_fences_above_it_and_leaks_nothing(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path, tmp_path: Path,
        started: list[int]) -> None:
    registry = Registry(redis_client, keys)
    ctl = spawn_controller(controller_args(keys, redis_server, root, tmp_path / "logs"), tmp_path / "ctl.log")
    started.append(ctl.pid)
    wait_until("engine-0 serving", lambda: serving_pid(registry) is not None, 60)
    pid = serving_pid(registry)
    assert pid is not None
    started.append(pid)
    token = fence(redis_client, keys)
    assert token >= 1
    # Redis lost its data but the bus epoch (an AOF whose tail was lost): lease, counter, registry, streams.
    # (Losing the epoch too stops every role with BusReset: tests/integration/test_chaos.py.)
    lost = [k for k in redis_client.keys(keys.prefix + ":*") if k != keys.bus_epoch.encode()]
    assert lost and redis_client.delete(*lost) == len(lost)
    assert registry.engines() == {}
    wait_until("engine-0 adopted again after the wipe", lambda: serving_pid(registry) == pid, 30)
    assert fence(redis_client, keys) > token  # the engine saw `token`: the new tenure is above it
    assert redis_client.get(keys.controller_fence_holder) == redis_client.get(keys.controller_lease)
    assert engine_pids(root / "base") == {pid}  # no second engine beside the first
    assert len(engine_logs(tmp_path / "logs")) == 1
    ctl.send_signal(signal.SIGTERM)
    assert ctl.wait(30) == 0
    assert engine_pids(root / "base") == set() and not pid_alive(pid)


def consumer_of_pending(client: redis.Redis, keys: Keys) -> list[str]:
    rows = client.xpending_range(keys.weight_stream("default"), "controller", min="-", max="+", count=10)
    return [r["consumer"].decode() for r in rows]


def test_a_standby_serves_the_version_its_dead_predecessor_had_read_within_seconds(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path, tmp_path: Path,
        started: list[int]) -> None:
    registry = Registry(redis_client, keys)
    slow = ("--request-timeout-s", "60", "--update-timeout-s", "60", "--health-interval-s", "60")
    a = spawn_controller([*controller_args(keys, redis_server, root, tmp_path / "logs-a", "--instance", "a"),
                          *slow], tmp_path / "a.log")
    started.append(a.pid)
    wait_until("engine-0 serving", lambda: serving_pid(registry) is not None, 60)
    pid = serving_pid(registry)
    assert pid is not None
    started.append(pid)
    b = spawn_controller(controller_args(keys, redis_server, root, tmp_path / "logs-b", "--instance", "b"),
                         tmp_path / "b.log")
    started.append(b.pid)
    v1, sha = write_version(root / "base", root / "default" / "v1", seed=1)

    os.kill(pid, signal.SIGSTOP)  # the engine hangs: the leader reads v1 and is stuck acting on it
    publish_weights(redis_client, keys, "default", 1, str(v1), sha)
    a_consumer = f"{socket.gethostname()}-controller-a-0"
    wait_until("v1 read by the leader", lambda: consumer_of_pending(redis_client, keys) == [a_consumer], 20)
    os.kill(a.pid, signal.SIGKILL)  # dies after reading WeightsPublished, before it served it
    assert a.wait(10) == -signal.SIGKILL
    os.kill(pid, signal.SIGCONT)
    assert not find(weight_events(redis_client, keys), WeightVersionServing, version=1)

    def holder_pid() -> str:
        raw = redis_client.get(keys.controller_lease)
        return raw.decode().split(":")[2] if isinstance(raw, bytes) else ""

    wait_until("the standby takes the lease", lambda: holder_pid() == str(b.pid), 30)
    took_over = time.monotonic()
    wait_until("v1 served by the standby", lambda: find(
        weight_events(redis_client, keys), WeightVersionServing, version=1), 30)
    served_after = time.monotonic() - took_over
    print(f"v1 served {served_after:.2f}s after the standby took the lease")
    assert served_after < 20  # the trainer waits 60 s; a claim after 600 s idle never made it
    # the entry is acked right after the event it led to (an XACK after the XADD): wait for it, do not race it
    wait_until("v1's entry acked by the standby", lambda: consumer_of_pending(redis_client, keys) == [], 10)
    assert serving_pid(registry) == pid and engine_pids(root / "base") == {pid}
    b.send_signal(signal.SIGTERM)
    assert b.wait(30) == 0
    assert engine_pids(root / "base") == set()
