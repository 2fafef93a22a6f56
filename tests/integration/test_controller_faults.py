"""Faults with real processes: an engine SIGKILLed or hung, and the controller itself SIGKILLed.

Every process is started here (or by a controller started here) and stopped by pid.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rollout_bus.controller.backends import pid_alive
from rollout_bus.controller.config import ControllerConfig
from rollout_bus.controller.service import InferenceController
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.registry import EngineState, Registry
from rollout_bus.events.schema import (
    EngineLaunching,
    EngineReady,
    EngineRestarting,
    EngineServing,
    EngineUnhealthy,
    Event,
    WeightsApplied,
    WeightVersionServing,
)
from tests.engine_proc import call, make_weights_dir
from tests.support.controller_driver import (
    find,
    publish_weights,
    read_events,
    wait_until,
    wait_until_async,
    weight_events,
    write_version,
)

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    make_weights_dir(tmp_path / "root" / "base", seed=0)
    return tmp_path / "root"


def engine_events(client: redis.Redis, keys: Keys, engine_id: str) -> list[Event]:
    return [e for e in read_events(client, keys.engine_stream) if getattr(e, "engine_id", None) == engine_id]


def test_a_killed_or_hung_engine_is_replaced_and_gets_the_latest_weights_before_it_serves(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path, tmp_path: Path) -> None:
    cfg = ControllerConfig(namespace=keys.namespace, redis_url=redis_server.url, num_engines=2,
                           model_path=str(root / "base"), weights_root=str(root), health_interval_s=0.2,
                           health_timeout_s=1.0, health_failure_threshold=2, log_dir=str(tmp_path / "logs"))
    v1, sha = write_version(root / "base", root / "default" / "v1", seed=1)

    async def scenario() -> None:
        ctl = InferenceController(cfg, redis_client)
        await ctl.start()
        try:
            launch = Registry(redis_client, keys).policy("default")  # before any publication: the launch record
            assert launch is not None and (launch.published, launch.serving, launch.uri) == (0, 0, "")
            publish_weights(redis_client, keys, "default", 1, str(v1), sha)
            await wait_until_async("v1 serving", lambda: find(
                weight_events(redis_client, keys), WeightVersionServing, version=1), 15)
            for engine_id, sig in (("engine-0", signal.SIGKILL), ("engine-1", signal.SIGSTOP)):
                h = ctl.engines[engine_id]
                old_pid = h.record.pid
                assert old_pid is not None
                seen = len(engine_events(redis_client, keys, engine_id))
                os.kill(old_pid, sig)  # SIGSTOP: a hung engine; health checks time out
                await wait_until_async(f"{engine_id} replaced", lambda e=engine_id, n=seen: find(  # type: ignore[misc]
                    engine_events(redis_client, keys, e)[n:], EngineServing), 30)
                assert h.state == EngineState.SERVING and h.record.pid != old_pid
                assert not pid_alive(old_pid)
                after = engine_events(redis_client, keys, engine_id)[seen:]
                assert [type(e) for e in after] == [EngineUnhealthy, EngineRestarting, EngineLaunching,
                                                    EngineReady, EngineServing]
                ready, serving = after[3], after[4]
                assert serving.versions == {"default": 1}  # type: ignore[attr-defined]
                applied = find(weight_events(redis_client, keys), WeightsApplied, engine_id=engine_id,
                               version=1)
                assert ready.ts_ms <= applied[-1].ts_ms <= serving.ts_ms
                status, info = call(h.record.url + "/model_info")
                assert status == 200 and info["weight_version"] == "1"
                assert pid_alive(h.record.pid or 0)
        finally:
            await ctl.stop()

    asyncio.run(scenario())
    records = Registry(redis_client, keys).engines()
    assert {r.state for r in records.values()} == {EngineState.STOPPED}
    assert not any(pid_alive(r.pid or 0) for r in records.values())


def test_an_engine_that_dies_under_a_weight_update_does_not_hold_back_the_others_while_it_relaunches(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path, tmp_path: Path) -> None:
    """The update round that finds an engine dead takes it out of serving and relaunches it in the
    background: the next version reaches the healthy engine before the dead one is back."""
    cfg = ControllerConfig(namespace=keys.namespace, redis_url=redis_server.url, num_engines=2,
                           model_path=str(root / "base"), weights_root=str(root), health_interval_s=30.0,
                           log_dir=str(tmp_path / "logs"))
    versions = {v: write_version(root / "base", root / "default" / f"v{v}", seed=v) for v in (1, 2)}

    async def scenario() -> None:
        ctl = InferenceController(cfg, redis_client)
        await ctl.start()
        try:
            dead = ctl.engines["engine-1"]
            old_pid = dead.record.pid
            assert old_pid is not None
            os.kill(old_pid, signal.SIGKILL)
            await wait_until_async("engine-1 gone", lambda: not pid_alive(old_pid), 10)
            seen = len(engine_events(redis_client, keys, "engine-1"))
            publish_weights(redis_client, keys, "default", 1, str(versions[1][0]), versions[1][1])
            # the health loop sleeps 30 s: the update round is what finds engine-1 dead
            await wait_until_async("engine-1 relaunching", lambda: find(
                engine_events(redis_client, keys, "engine-1")[seen:], EngineLaunching), 15)
            publish_weights(redis_client, keys, "default", 2, str(versions[2][0]), versions[2][1])
            await wait_until_async("v2 on engine-0", lambda: find(read_events(
                redis_client, keys.weight_stream("default")), WeightsApplied, engine_id="engine-0", version=2), 15)
            back = find(engine_events(redis_client, keys, "engine-1")[seen:], EngineServing)
            assert not back, "engine-0 got v2 only once engine-1 had relaunched"
            await wait_until_async("engine-1 back", lambda: find(
                engine_events(redis_client, keys, "engine-1")[seen:], EngineServing), 30)
            await wait_until_async("v2 serving", lambda: find(
                weight_events(redis_client, keys), WeightVersionServing, version=2), 15)
            assert dead.record.versions == {"default": 2} and dead.record.pid != old_pid
        finally:
            await ctl.stop()

    asyncio.run(scenario())


def spawn_controller(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "rollout_bus", "controller", *args], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def engine_pids(model_path: Path) -> set[int]:
    """Engine processes serving ``model_path`` (unique per test), found through /proc."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rollout_bus.engine.server" in args and str(model_path).encode() in args and pid_alive(int(entry.name)):
            pids.add(int(entry.name))
    return pids


@pytest.fixture()
def cleanup() -> Iterator[list[int]]:
    pids: list[int] = []
    yield pids
    for pid in pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_new_controller_adopts_the_engines_of_a_killed_one_without_duplicates(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path, tmp_path: Path,
        cleanup: list[int]) -> None:
    base = root / "base"
    args = ["--namespace", keys.namespace, "--redis-url", redis_server.url, "--num-engines", "2",
            "--model-path", str(base), "--weights-root", str(root), "--lease-ttl-s", "1",
            "--health-interval-s", "0.3", "--log-dir", str(tmp_path / "logs"), "--log-level", "info"]
    registry = Registry(redis_client, keys)
    first = spawn_controller(args, tmp_path / "controller-1.log")
    cleanup.append(first.pid)

    def serving() -> dict[str, int]:
        return {r.engine_id: r.pid or 0 for r in registry.engines().values() if r.state == EngineState.SERVING}

    wait_until("two serving engines", lambda: len(serving()) == 2, 30)
    pids = serving()
    cleanup.extend(pids.values())
    launches = len(find(read_events(redis_client, keys.engine_stream), EngineLaunching))
    os.kill(first.pid, signal.SIGKILL)
    first.wait(10)
    assert all(pid_alive(pid) for pid in pids.values())  # engines outlive their controller

    killed_ms = time.time_ns() // 1_000_000
    second = spawn_controller(args, tmp_path / "controller-2.log")
    cleanup.append(second.pid)
    def holder_pid() -> str:
        raw = redis_client.get(keys.controller_lease)
        return raw.decode().split(":")[2] if isinstance(raw, bytes) else ""

    wait_until("the second controller to hold the lease", lambda: holder_pid() == str(second.pid), 15)
    wait_until("the engines adopted", lambda: all(
        r.updated_ms > killed_ms and r.state == EngineState.SERVING for r in registry.engines().values()), 15)
    assert serving() == pids
    assert len(registry.engines()) == 2
    assert engine_pids(base) == set(pids.values())
    assert len(find(read_events(redis_client, keys.engine_stream), EngineLaunching)) == launches

    v1, sha = write_version(base, root / "default" / "v1", seed=1)
    publish_weights(redis_client, keys, "default", 1, str(v1), sha)
    wait_until("v1 serving after the takeover", lambda: find(
        weight_events(redis_client, keys), WeightVersionServing, version=1), 15)
    for record in registry.engines().values():
        assert call(record.url + "/model_info")[1]["weight_version"] == "1"

    second.send_signal(signal.SIGTERM)
    assert second.wait(20) == 0
    assert not any(pid_alive(pid) for pid in pids.values())  # a clean stop takes its engines down
    assert redis_client.get(keys.controller_lease) is None


def test_a_controller_stops_on_one_sigterm_while_its_redis_is_gone(keys: Keys, root: Path, tmp_path: Path,
                                                                   cleanup: list[int]) -> None:
    """Its lease, registry and stream calls wait in their reconnect loops for a Redis that is gone (a shard lost
    for good); one SIGTERM must still stop it, and its engine with it."""
    server = RedisServer().start()
    try:
        client = redis.Redis.from_url(server.url)
        args = ["--namespace", keys.namespace, "--redis-url", server.url, "--num-engines", "1",
                "--model-path", str(root / "base"), "--weights-root", str(root), "--health-interval-s", "0.3",
                "--log-dir", str(tmp_path / "logs"), "--log-level", "info"]
        log = tmp_path / "controller.log"
        ctl = spawn_controller(args, log)
        cleanup.append(ctl.pid)
        registry = Registry(client, keys)
        wait_until("a serving engine", lambda: any(r.state == EngineState.SERVING
                                                   for r in registry.engines().values()), 30)
        engine = next(r.pid for r in registry.engines().values() if r.pid)
        assert engine is not None
        cleanup.append(engine)
        client.close()
        server.kill()
        wait_until("the controller saw Redis go", lambda: "connection to Redis lost" in log.read_text(), 30)
        wait_until("its calls waiting to reconnect", lambda: log.read_text().count("connection to Redis lost") >= 2, 30)
        assert ctl.poll() is None
        ctl.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while ctl.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ctl.poll() is not None, "one SIGTERM did not stop the controller:\n" + log.read_text()[-3000:]
        wait_until("its engine stopped", lambda: not pid_alive(engine), 10)
    finally:
        server.stop()
