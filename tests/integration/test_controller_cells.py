"""Cells and colocation on a real controller launching real CPU engines, over a real Redis: a scaled-down
engine drains before it stops, bad scale commands are refused on the bus and by the CLI, and an offloaded
engine's resident memory really falls (and comes back on onload)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from rollout_bus.controller.config import ControllerConfig
from rollout_bus.controller.service import InferenceController
from rollout_bus.engine.http_client import EngineClient
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import EngineState, Registry
from rollout_bus.events.schema import (
    CommandDone,
    EngineDraining,
    EngineLaunching,
    EngineServing,
    EnginesScaled,
    EngineStopped,
    OffloadEngines,
    OnloadEngines,
    Producer,
    ScaleEngines,
    WeightVersionServing,
)
from rollout_bus.lm.files import read_manifest
from rollout_bus.lm.model import ModelConfig
from tests.engine_proc import make_weights_dir
from tests.support.controller_driver import (
    find,
    publish_weights,
    read_events,
    wait_until_async,
    weight_events,
    write_version,
)
from tests.support.models import tiny_adapter

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ASKER = Producer("test", "cells")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("weights-root")
    make_weights_dir(root / "base", seed=0)
    return root


def config(keys: Keys, server: RedisServer, root: Path, tmp_path: Path, **kw: Any) -> ControllerConfig:
    settings: dict[str, Any] = dict(namespace=keys.namespace, redis_url=server.url, num_engines=2,
                                    model_path=str(root / "base"), weights_root=str(root), health_interval_s=0.5,
                                    health_timeout_s=2.0, log_dir=str(tmp_path / "logs"), max_engines=3)
    return ControllerConfig(**{**settings, **kw})


def send(client: redis.Redis, keys: Keys, event: Any) -> None:
    Publisher(client, keys, ASKER).publish(keys.command_stream, event)


def scaled(client: redis.Redis, keys: Keys, request_id: str) -> list[EnginesScaled]:
    return [e for e in find(read_events(client, keys.engine_stream), EnginesScaled, request_id=request_id)
            if isinstance(e, EnginesScaled)]


def test_a_scaled_down_engine_leaves_the_serving_set_and_finishes_its_requests_before_it_stops(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path, tmp_path: Path) -> None:
    async def scenario() -> tuple[dict[str, Any], list[Any], int]:
        ctl = InferenceController(config(keys, redis_server, root, tmp_path, token_delay_ms=25), redis_client)
        await ctl.start()
        try:
            await ctl.wait_serving(timeout_s=60, count=2)
            victim = ctl.engines["engine-1"]  # the highest index goes first
            pid = victim.record.pid
            params = {"max_new_tokens": 60, "temperature": 0.0, "ignore_eos": True}
            request = asyncio.create_task(EngineClient(victim.record.url).generate([1, 2, 3], params))
            await asyncio.sleep(0.3)  # decoding: 60 tokens x 25 ms
            assert not request.done()
            send(redis_client, keys, ScaleEngines(producer=ASKER, policy="default", count="-1", request_id="down"))
            registry = Registry(redis_client, keys)
            await wait_until_async("engine-1 draining", lambda: registry.engines()["engine-1"].state
                                   == EngineState.DRAINING, 10)
            assert victim.process is not None and victim.process.alive()  # out of serving, still running
            assert not request.done()
            reply = await asyncio.wait_for(request, 30)
            await wait_until_async("the scale answered", lambda: any(
                e.outcome == "done" for e in scaled(redis_client, keys, "down")), 30)
            assert pid is not None
            return reply, scaled(redis_client, keys, "down"), pid
        finally:
            await ctl.stop()

    reply, answers, pid = asyncio.run(scenario())
    assert reply["meta_info"]["finish_reason"]["type"] == "length"  # the whole answer, not an abort or a reset
    assert len(reply["output_ids"]) == 60
    assert [(a.outcome, a.from_count, a.to_count, a.engine_ids) for a in answers] == [
        ("started", 2, 1, []), ("done", 2, 1, ["engine-1"])]
    assert answers[0].requested_by == str(ASKER)
    events = read_events(redis_client, keys.engine_stream)
    order = [type(e).__name__ for e in events if getattr(e, "engine_id", None) == "engine-1"
             and isinstance(e, EngineDraining | EngineStopped)]
    assert order == ["EngineDraining", "EngineStopped"]
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in Path(f"/proc/{pid}/status").read_text()
    assert Registry(redis_client, keys).policies()["default"].engines == 1  # a takeover keeps the new size


def _cli(redis_url: str, namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollout_bus", "scale", "engines", "--redis-url", redis_url,
                           "--namespace", namespace, "--timeout-s", "60", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_bad_scale_commands_are_refused_on_the_bus_and_by_the_cli_saying_what_to_fix(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path, tmp_path: Path) -> None:
    async def scenario() -> dict[str, subprocess.CompletedProcess[str]]:
        ctl = InferenceController(config(keys, redis_server, root, tmp_path, num_engines=1, max_engines=2),
                                  redis_client)
        await ctl.start()
        try:
            await ctl.wait_serving(timeout_s=60, count=1)
            send(redis_client, keys, ScaleEngines(producer=ASKER, policy="default", count="two", request_id="raw"))
            await wait_until_async("the malformed count refused", lambda: scaled(redis_client, keys, "raw"), 10)
            cases = {"above": ("--policy", "default", "--to", "3"), "below": ("--policy", "default", "-2"),
                     "nowhere": ("--policy", "nope", "--to", "1"), "malformed": ("--policy", "default", "--to", "x2")}
            out = {name: await asyncio.to_thread(_cli, redis_server.url, keys.namespace, *args)
                   for name, args in cases.items()}
            assert len(ctl.engines) == 1 and ctl.engines["engine-0"].state == EngineState.SERVING  # nothing moved
            return out
        finally:
            await ctl.stop()

    out = asyncio.run(scenario())
    (raw,) = scaled(redis_client, keys, "raw")
    assert raw.outcome == "refused" and "malformed" in raw.reason and (raw.from_count, raw.to_count) == (1, 1)
    assert all(r.returncode == 2 for r in out.values()), {k: (r.returncode, r.stderr) for k, r in out.items()}
    assert "its bound is 2" in out["above"].stderr
    assert "a pool has 0 engines or more" in out["below"].stderr
    assert "policy 'nope' has no engine pool" in out["nowhere"].stderr and "['default']" in out["nowhere"].stderr
    assert "malformed" in out["malformed"].stderr
    refused = [e for e in read_events(redis_client, keys.engine_stream)
               if isinstance(e, EnginesScaled) and e.outcome == "refused"]
    assert len(refused) == 4  # the raw one and three from the CLI; the malformed CLI count never left the host
    assert all(e.requested_by.startswith("scale/") for e in refused if e.request_id != "raw")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_an_offloaded_engine_gives_its_memory_back_and_onload_brings_the_weights_back_from_disk(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> None:
    big = tmp_path / "root" / "base"
    make_weights_dir(big, seed=3, config=ModelConfig(d_model=512, n_layers=8, n_heads=8, d_ff=2048))
    weights_mb = (big / "model.safetensors").stat().st_size / 2**20  # about 96 MB

    async def answer(request_id: str) -> CommandDone:
        await wait_until_async(request_id, lambda: find(read_events(redis_client, keys.engine_stream), CommandDone,
                                                        request_id=request_id), 60)
        (done,) = find(read_events(redis_client, keys.engine_stream), CommandDone, request_id=request_id)
        assert isinstance(done, CommandDone)
        return done

    async def scenario() -> dict[str, float]:
        cfg = config(keys, redis_server, big.parent, tmp_path, num_engines=1, model_path=str(big), colocate=True)
        ctl = InferenceController(cfg, redis_client)
        await ctl.start()
        try:
            await ctl.wait_serving(timeout_s=60, count=1)
            engine = ctl.engines["engine-0"]
            assert engine.record.pid is not None
            pid = engine.record.pid
            client = EngineClient(engine.record.url)
            await client.generate([1, 2, 3], {"max_new_tokens": 4})
            rss = {"serving": _rss_mb(pid)}
            digest = (await client.weights_digest())["digest"]
            send(redis_client, keys, OffloadEngines(producer=ASKER, tags=["weights", "kv_cache"], policy="default",
                                                    request_id="off"))
            done = await answer("off")
            assert (done.outcome, done.results) == ("ok", {"engine-0": "ok"}), done
            assert Registry(redis_client, keys).engines()["engine-0"].state == EngineState.OFFLOADED
            rss["offloaded"] = _rss_mb(pid)
            for tags, request_id in ((["weights"], "on-w"), (["kv_cache"], "on-kv")):  # miles' order
                send(redis_client, keys, OnloadEngines(producer=ASKER, tags=tags, policy="default",
                                                       request_id=request_id))
                assert (await answer(request_id)).outcome == "ok"
            rss["onloaded"] = _rss_mb(pid)
            assert engine.state == EngineState.SERVING
            assert (await client.weights_digest())["digest"] == digest  # the same tensors, read back from disk
            reply = await client.generate([1, 2, 3], {"max_new_tokens": 4})
            assert reply["meta_info"]["finish_reason"]["type"] in ("length", "stop")
            checks = await ctl.check_weights()
            assert [c.outcome for c in checks] == ["match"]
            return rss
        finally:
            await ctl.stop()

    rss = asyncio.run(scenario())
    assert rss["serving"] - rss["offloaded"] >= 0.8 * weights_mb, (rss, weights_mb)
    assert rss["onloaded"] - rss["offloaded"] >= 0.8 * weights_mb, (rss, weights_mb)


def test_a_started_engine_gets_the_newest_base_version_and_the_adapter_before_it_serves(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> None:
    root = tmp_path / "root"
    make_weights_dir(root / "base", seed=0)
    base_dir, base_sha = write_version(root / "base", root / "default" / "v1", seed=1)
    adapter_dir = tiny_adapter(root / "math" / "v2", seed=2, policy="math", version=2)
    adapter_sha = read_manifest(adapter_dir)[1]

    async def scenario() -> tuple[Any, dict[str, Any]]:
        ctl = InferenceController(config(keys, redis_server, root, tmp_path, num_engines=1, enable_lora=True),
                                  redis_client)
        await ctl.start()
        try:
            await ctl.wait_serving(timeout_s=60, count=1)
            publish_weights(redis_client, keys, "default", 1, str(base_dir), base_sha)
            publish_weights(redis_client, keys, "math", 2, str(adapter_dir), adapter_sha)
            for policy in ("default", "math"):
                await wait_until_async(f"{policy} served", lambda p=policy: find(  # type: ignore[misc]
                    weight_events(redis_client, keys), WeightVersionServing, policy=p), 30)
            send(redis_client, keys, ScaleEngines(producer=ASKER, policy="default", count="+1", request_id="up"))
            await wait_until_async("the scale answered", lambda: any(
                e.outcome in ("done", "failed") for e in scaled(redis_client, keys, "up")), 60)
            new = ctl.engines["engine-1"]
            models = await EngineClient(new.record.url).models()
            return scaled(redis_client, keys, "up"), {"record": new.record, "models": models}
        finally:
            await ctl.stop()

    answers, seen = asyncio.run(scenario())
    assert [(a.outcome, a.from_count, a.to_count, a.engine_ids) for a in answers] == [
        ("started", 1, 2, []), ("done", 1, 2, ["engine-1"])]
    (serving,) = find(read_events(redis_client, keys.engine_stream), EngineServing, engine_id="engine-1")
    assert isinstance(serving, EngineServing) and serving.versions == {"default": 1, "math": 2}  # before it served
    assert seen["record"].adapters == {"math": "math@v2"}
    assert "math@v2" in {m.get("id") for m in seen["models"]["data"]}  # the engine itself holds the adapter
    events = read_events(redis_client, keys.engine_stream)
    launching = [i for i, e in enumerate(events) if isinstance(e, EngineLaunching) and e.engine_id == "engine-1"]
    served = [i for i, e in enumerate(events) if isinstance(e, EngineServing) and e.engine_id == "engine-1"]
    assert launching and served and launching[0] < served[0]
