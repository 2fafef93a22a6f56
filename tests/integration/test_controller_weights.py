"""Weight updates on three real CPU engines (the tiny LM): each pause mode with requests in flight, bad
weights, adapter policies, offload and onload with requests in flight, loads, and adoption.

The engines are started once for the module and adopted by a fresh controller in each
test (its own namespace); versions grow across the module since the engines keep theirs.
The CPU engines answer what SGLang answers on each point these tests touch (an in_place pause
refuses the cache flush, release needs an idle engine, resume needs a released tag, loads are at
/v1/loads, /model_info has no per-adapter versions).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from rollout_bus.controller.config import ControllerConfig
from rollout_bus.controller.lifecycle import adopted_engine_id
from rollout_bus.controller.service import InferenceController
from rollout_bus.engine.http_client import EngineClient
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import EngineState, Registry
from rollout_bus.events.schema import (
    EngineOffloaded,
    EngineOnloaded,
    EngineReady,
    EngineRestarting,
    EngineServing,
    EngineUnhealthy,
    OffloadEngines,
    Producer,
    WeightsApplied,
    WeightUpdateFailed,
    WeightVersionServing,
)
from rollout_bus.lm.files import read_manifest, write_manifest
from tests.engine_proc import EngineProcess, make_weights_dir, wait_until
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

_versions = itertools.count(1)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("weights-root")
    make_weights_dir(root / "base", seed=0)
    return root


@pytest.fixture(scope="module")
def engines(root: Path) -> Iterator[list[EngineProcess]]:
    procs = [EngineProcess(root / "base", token_delay_ms=15, extra_args=["--enable-lora"]) for _ in range(3)]
    yield procs
    for proc in procs:  # signal all first, then wait: they shut down in parallel
        if proc.proc is not None and proc.proc.poll() is None:
            proc.proc.terminate()
    for proc in procs:
        proc.stop()


def adopted(engine: EngineProcess) -> str:
    return adopted_engine_id(engine.url)


def config(keys: Keys, server: RedisServer, root: Path, engines: list[EngineProcess], **kw: Any) -> ControllerConfig:
    settings: dict[str, Any] = dict(namespace=keys.namespace, redis_url=server.url, num_engines=0,
                                    adopt_urls=[e.url for e in engines], model_path=str(root / "base"),
                                    weights_root=str(root), health_interval_s=0.5, health_timeout_s=2.0)
    return ControllerConfig(**{**settings, **kw})


async def started(cfg: ControllerConfig, client: redis.Redis) -> InferenceController:
    ctl = InferenceController(cfg, client)
    await ctl.start()
    await ctl.wait_serving(timeout_s=20)
    return ctl


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_a_weight_update_reaches_all_three_engines_while_requests_are_in_flight(
        mode: str, keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path,
        engines: list[EngineProcess]) -> None:
    version = next(_versions)
    new_dir, sha = write_version(root / "base", root / "default" / f"v{version}", seed=version)

    async def scenario() -> list[Any]:
        ctl = await started(config(keys, redis_server, root, engines, pause_mode=mode), redis_client)
        try:
            params = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
            requests = [asyncio.create_task(EngineClient(e.url).generate([1, 2, 3], params, return_logprob=True))
                        for e in engines for _ in range(2)]
            await asyncio.sleep(0.2)  # every request is decoding (40 tokens x 15 ms)
            assert not any(r.done() for r in requests)
            publish_weights(redis_client, keys, "default", version, str(new_dir), sha)
            await wait_until_async("WeightVersionServing", lambda: find(
                weight_events(redis_client, keys), WeightVersionServing, version=version), 15)
            return list(await asyncio.wait_for(asyncio.gather(*requests), 15))
        finally:
            await ctl.stop()

    replies = asyncio.run(scenario())
    finishes = [r["meta_info"]["finish_reason"]["type"] for r in replies]
    if mode == "abort":
        assert finishes == ["abort"] * 6
    else:  # retract / in_place: paused, resumed on the new weights, finished normally
        assert finishes == ["length"] * 6
        assert all(r["meta_info"]["weight_version"] == str(version) for r in replies)
        assert all(len(r["output_ids"]) == 40 for r in replies)
    for engine in engines:
        assert engine.get("/model_info")[1]["weight_version"] == str(version)
    applied = find(weight_events(redis_client, keys), WeightsApplied, version=version)
    assert len(applied) == 3
    records = Registry(redis_client, keys).engines()
    assert {r.versions["default"] for r in records.values()} == {version}
    assert all(not r.updating and r.pause_mode == mode for r in records.values())


@pytest.mark.parametrize("case", ["checksum mismatch", "missing file", "wrong shapes", "outside the root",
                                  "wrong shapes caught by the engines"])
def test_bad_weights_are_refused_and_engines_keep_serving_the_old_version(
        case: str, keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path,
        engines: list[EngineProcess], tmp_path: Path) -> None:
    version = next(_versions)
    uri, sha = "", ""
    if case == "checksum mismatch":
        path, _ = write_version(root / "base", root / "default" / f"v{version}", seed=version)
        uri, sha = str(path), "ab" * 32
    elif case == "missing file":
        uri, sha = str(root / "default" / f"v{version}-never-written"), "ab" * 32
    elif case.startswith("wrong shapes"):
        path, sha = write_version(root / "base", root / "default" / f"v{version}", seed=version, shape_change=True)
        uri = str(path)
    elif case == "outside the root":
        path, sha = write_version(root / "base", tmp_path / f"v{version}", seed=version)
        uri = str(path)
    # Without a reference model the controller cannot check shapes: the engines refuse them.
    extra: dict[str, Any] = {"model_path": ""} if case.endswith("by the engines") else {}
    if case == "missing file":
        extra["weights_missing_wait_s"] = 0.5  # looked for again, with backoff, then refused
    old = {e.url: e.get("/model_info")[1]["weight_version"] for e in engines}

    async def scenario() -> None:
        ctl = await started(config(keys, redis_server, root, engines, **extra), redis_client)
        try:
            publish_weights(redis_client, keys, "default", version, uri, sha)
            await wait_until_async("a WeightUpdateFailed per engine", lambda: len(find(
                weight_events(redis_client, keys), WeightUpdateFailed, version=version)) == 3, 15)
            await asyncio.sleep(0.2)
        finally:
            await ctl.stop()

    asyncio.run(scenario())
    events = weight_events(redis_client, keys)
    failures = find(events, WeightUpdateFailed, version=version)
    keyword = {"checksum mismatch": "manifest mismatch", "missing file": "missing", "wrong shapes": "wrong shapes",
               "outside the root": "outside the weights root",
               "wrong shapes caught by the engines": "engine refused the weights"}[case]
    records = Registry(redis_client, keys).engines()
    for failure in failures:
        record = records[failure.engine_id]  # type: ignore[attr-defined]
        assert keyword in failure.reason  # type: ignore[attr-defined]
        assert f"keeps serving version {old[record.url]}" in failure.reason  # type: ignore[attr-defined]
        assert record.versions["default"] == int(old[record.url])
        assert record.state.value == "serving"
    assert not find(events, WeightVersionServing, version=version)
    assert not find(events, WeightsApplied, version=version)
    assert {e.url: e.get("/model_info")[1]["weight_version"] for e in engines} == old


def test_offloaded_engines_leave_serving_and_onload_brings_them_back_on_the_latest_weights(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path,
        engines: list[EngineProcess]) -> None:
    version = next(_versions)
    new_dir, sha = write_version(root / "base", root / "default" / f"v{version}", seed=version)
    producer = Producer("trainer", "test")

    async def scenario() -> str:
        ctl = await started(config(keys, redis_server, root, engines, metrics_port=0), redis_client)
        try:
            Publisher(redis_client, keys, producer).publish(keys.command_stream, OffloadEngines(
                producer=producer, tags=["weights", "kv_cache"], engine_ids=[adopted(engines[0])]))
            await wait_until_async("EngineOffloaded", lambda: find(
                read_events(redis_client, keys.engine_stream), EngineOffloaded), 10)
            assert engines[0].state()["memory_released"] == ["kv_cache", "weights"]
            # Weights published meanwhile reach the engines still serving, not the offloaded one.
            publish_weights(redis_client, keys, "default", version, str(new_dir), sha)
            await wait_until_async("v serving", lambda: find(
                weight_events(redis_client, keys), WeightVersionServing, version=version), 10)
            assert engines[0].get("/model_info")[1]["weight_version"] != str(version)
            results = await ctl.onload(["weights", "kv_cache"])
            assert results[adopted(engines[0])] == "ok"
            assert all(r.startswith("skipped") for e, r in results.items() if e != adopted(engines[0]))
            assert len(ctl.core.serving()) == 3
            async with aiohttp.ClientSession() as session, session.get(
                    f"http://127.0.0.1:{ctl.metrics_port}/metrics") as resp:
                return await resp.text()
        finally:
            await ctl.stop()

    metrics = asyncio.run(scenario())
    assert engines[0].get("/model_info")[1]["weight_version"] == str(version)  # caught up before serving
    assert engines[0].state()["memory_released"] == []
    types = [type(e) for e in read_events(redis_client, keys.engine_stream)
             if getattr(e, "engine_id", None) == adopted(engines[0])]
    assert types[-3:] == [EngineOffloaded, EngineOnloaded, EngineServing]
    assert 'rollout_bus_controller_engines{state="serving"} 3.0' in metrics
    assert "rollout_bus_controller_weight_update_seconds_count" in metrics


def test_an_adopted_engine_that_dies_leaves_serving_and_comes_back_with_the_latest_weights(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path,
        engines: list[EngineProcess]) -> None:
    version = next(_versions)
    new_dir, sha = write_version(root / "base", root / "default" / f"v{version}", seed=version)
    victim = engines[2]
    engine_id = adopted(victim)

    def own_events() -> list[Any]:
        return [e for e in read_events(redis_client, keys.engine_stream) if getattr(e, "engine_id", None) == engine_id]

    async def scenario() -> None:
        cfg = config(keys, redis_server, root, engines, health_interval_s=0.2, health_timeout_s=1.0,
                     health_failure_threshold=1)
        ctl = await started(cfg, redis_client)
        try:
            publish_weights(redis_client, keys, "default", version, str(new_dir), sha)
            await wait_until_async("v serving", lambda: find(
                weight_events(redis_client, keys), WeightVersionServing, version=version), 10)
            victim.kill()  # SIGKILL by pid; whoever launched it restarts it, not the controller
            await wait_until_async("EngineUnhealthy", lambda: find(own_events(), EngineUnhealthy), 10)
            assert Registry(redis_client, keys).engines()[engine_id].state == EngineState.UNHEALTHY
            assert len(ctl.core.serving()) == 2
            await asyncio.to_thread(victim.start)  # same port, launch weights (version 0)
            await wait_until_async("serving again", lambda: isinstance(own_events()[-1], EngineServing), 15)
        finally:
            await ctl.stop()

    asyncio.run(scenario())
    types = [type(e) for e in own_events()]
    assert EngineRestarting not in types
    assert types[-3:] == [EngineUnhealthy, EngineReady, EngineServing]
    assert own_events()[-1].versions == {"default": version}
    assert victim.get("/model_info")[1]["weight_version"] == str(version)


def test_an_adapter_policy_is_loaded_beside_the_base_and_full_weights_without_a_pool_never_touch_it(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path,
        engines: list[EngineProcess]) -> None:
    """SGLang drops ``lora_name`` from /update_weights_from_disk and overwrites the base model; a policy
    that is not the base is an adapter (loaded under ``<policy>@v<version>``), and full weights for it
    with no pool of its own are refused."""
    version = next(_versions)
    adapter_dir = tiny_adapter(root / "math" / f"v{version + 1}", seed=version, policy="math", version=version + 1)
    sha = read_manifest(adapter_dir)[1]
    full_dir, full_sha = write_version(root / "base", root / "math" / f"v{version}", seed=version)
    base_before = {e.url: e.get("/model_info")[1] for e in engines}

    async def scenario() -> list[Any]:
        ctl = await started(config(keys, redis_server, root, engines, enable_lora=True), redis_client)
        try:
            publish_weights(redis_client, keys, "math", version, str(full_dir), full_sha)
            await wait_until_async("the refusal", lambda: find(
                weight_events(redis_client, keys), WeightUpdateFailed, policy="math"), 10)
            publish_weights(redis_client, keys, "math", version + 1, str(adapter_dir), sha)
            await wait_until_async("math served", lambda: find(
                weight_events(redis_client, keys), WeightVersionServing, policy="math"), 15)
            record = next(iter(Registry(redis_client, keys).engines().values()))
            client = EngineClient(record.url)
            params = {"max_new_tokens": 4, "temperature": 0.0}
            return [await client.generate([1, 5, 6], params, lora_path=record.lora_path("math")),
                    await client.generate([1, 5, 6], params)]
        finally:
            await ctl.stop()

    try:
        with_adapter, base = asyncio.run(scenario())
        events = weight_events(redis_client, keys)
        refused = find(events, WeightUpdateFailed, policy="math", version=version)
        assert len(refused) == 3 and all("no engine pool runs it as its base" in e.reason  # type: ignore[attr-defined]
                                         for e in refused)
        assert with_adapter["output_ids"] != base["output_ids"]
        for record in Registry(redis_client, keys).engines().values():
            assert record.adapters == {"math": f"math@v{version + 1}"}
            assert record.versions["math"] == version + 1
        for engine in engines:
            info = engine.get("/model_info")[1]
            assert (info["weight_version"], info["model_path"]) == (base_before[engine.url]["weight_version"],
                                                                    base_before[engine.url]["model_path"])
            assert engine.state()["adapters"] == [f"math@v{version + 1}"]
    finally:
        for engine in engines:
            engine.post("/unload_lora_adapter", {"lora_name": f"math@v{version + 1}"})


def test_a_new_controller_reads_adapter_versions_from_the_engines_and_pushes_nothing_again(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path,
        engines: list[EngineProcess]) -> None:
    """/model_info carries no adapter versions; the adapter names /v1/models lists carry them."""
    version = next(_versions)
    adapter_dir = tiny_adapter(root / f"code-v{version}", seed=version)
    for engine in engines:
        assert engine.post("/load_lora_adapter", {"lora_name": f"code@v{version}", "lora_path": str(adapter_dir)})[0] == 200
        assert engine.post("/load_lora_adapter", {"lora_name": f"code@v{version - 1}", "lora_path": str(adapter_dir)})[0] == 200
    base = {e.url: e.get("/model_info")[1]["weight_version"] for e in engines}

    async def scenario() -> None:
        ctl = await started(config(keys, redis_server, root, engines, enable_lora=True), redis_client)
        try:
            await asyncio.sleep(0.5)
        finally:
            await ctl.stop()

    try:
        asyncio.run(scenario())
        for record in Registry(redis_client, keys).engines().values():
            assert record.versions == {"default": int(base[record.url]), "code": version}
            assert record.lora_path("code") == f"code@v{version}"
        assert not find(weight_events(redis_client, keys), WeightsApplied)
        for engine in engines:  # the stale name of the same policy was unloaded, the current one kept
            assert engine.state()["adapters"] == [f"code@v{version}"]
            assert engine.get("/model_info")[1]["weight_version"] == base[engine.url]
    finally:
        for engine in engines:
            engine.post("/unload_lora_adapter", {"lora_name": f"code@v{version}"})


def test_offloading_an_engine_with_requests_in_flight_pauses_it_first_and_onload_only_resumes_released_tags(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path,
        engines: list[EngineProcess]) -> None:
    """SGLang asserts its scheduler is idle on release (the server dies otherwise) and raises on resuming a
    tag it never released: the controller takes the engine out of serving, pauses it (abort), then
    releases; and refuses to resume what was not released."""
    victim = engines[1]

    async def scenario() -> tuple[list[Any], dict[str, str], dict[str, str]]:
        ctl = await started(config(keys, redis_server, root, engines), redis_client)
        try:
            params = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
            requests = [asyncio.create_task(EngineClient(victim.url).generate([1, 2, 3], params)) for _ in range(2)]
            await asyncio.to_thread(wait_until, "both running", lambda: victim.state()["running"] == 2)
            offloaded = await ctl.offload(["kv_cache"], [adopted(victim)])
            replies = list(await asyncio.wait_for(asyncio.gather(*requests), 10))
            onloaded = await ctl.onload(["weights"], [adopted(victim)])
            assert victim.state()["memory_released"] == ["kv_cache"]
            assert await ctl.onload(["kv_cache"], [adopted(victim)]) == {adopted(victim): "ok"}
            return replies, offloaded, onloaded
        finally:
            await ctl.stop()

    replies, offloaded, onloaded = asyncio.run(scenario())
    assert offloaded == {adopted(victim): "ok"}
    assert [r["meta_info"]["finish_reason"]["type"] for r in replies] == ["abort", "abort"]
    assert onloaded[adopted(victim)].startswith("refused: ['weights'] not offloaded") and "nothing was sent" in onloaded[adopted(victim)]
    assert victim.state()["memory_released"] == [] and victim.state()["paused"] is False
    assert victim.get("/health_generate")[0] == 200
    types = [type(e) for e in read_events(redis_client, keys.engine_stream)
             if getattr(e, "engine_id", None) == adopted(victim)]
    assert types[-3:] == [EngineOffloaded, EngineOnloaded, EngineServing]


def test_engine_loads_come_from_v1_loads(keys: Keys, redis_server: RedisServer, redis_client: redis.Redis,
                                        root: Path, engines: list[EngineProcess]) -> None:
    """SGLang's /server_info carries no request counts; the registry load comes from /v1/loads."""
    async def scenario() -> int:
        ctl = await started(config(keys, redis_server, root, engines, health_interval_s=0.2), redis_client)
        try:
            params = {"max_new_tokens": 60, "temperature": 0.0, "ignore_eos": True}
            requests = [asyncio.create_task(EngineClient(engines[0].url).generate([1, 2, 3], params))
                        for _ in range(3)]
            registry = Registry(redis_client, keys)
            await wait_until_async("a load of 3", lambda: registry.engines()[adopted(engines[0])].load == 3, 10)
            other = registry.engines()[adopted(engines[1])].load  # read while engine 0 holds the 3 requests
            await asyncio.gather(*requests)
            await wait_until_async("the load back to 0", lambda: registry.engines()[adopted(engines[0])].load == 0, 10)
            return other
        finally:
            await ctl.stop()

    assert asyncio.run(scenario()) <= 1  # the other engine's own: at most a health check's /health_generate


def test_an_adapter_the_engine_fails_on_is_a_refused_version_and_the_engine_is_not_restarted(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> None:
    """The engine answers 500 to an adapter peft cannot build (rank 0 in its config, which the controller's
    checks do not read), and still generates on its base weights: the version is refused, the engine is
    neither restarted nor taken out of serving (a restart would load the same adapter again), and the
    policy's next version still applies."""
    root = tmp_path / "weights"
    make_weights_dir(root / "base", seed=0)
    broken = tiny_adapter(root / "math" / "v000001", seed=1, policy="math", version=1)
    settings = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**settings, "r": 0}))
    write_manifest(broken, policy="math", version=1)
    good = tiny_adapter(root / "math" / "v000002", seed=2, policy="math", version=2)
    cfg = ControllerConfig(namespace=keys.namespace, redis_url=redis_server.url, num_engines=1, enable_lora=True,
                           model_path=str(root / "base"), weights_root=str(root), health_interval_s=0.2,
                           health_timeout_s=2.0, health_failure_threshold=1, log_dir=str(tmp_path / "logs"))

    def own(kind: type) -> list[Any]:
        return find(read_events(redis_client, keys.engine_stream), kind, engine_id="engine-0")

    async def scenario() -> tuple[int | None, int | None, Any]:
        ctl = await started(cfg, redis_client)
        try:
            pid = ctl.engines["engine-0"].record.pid
            publish_weights(redis_client, keys, "math", 1, str(broken), read_manifest(broken)[1])
            await wait_until_async("the refusal", lambda: find(
                weight_events(redis_client, keys), WeightUpdateFailed, policy="math", version=1), 15)
            publish_weights(redis_client, keys, "math", 2, str(good), read_manifest(good)[1])
            await wait_until_async("v2 serving", lambda: find(
                weight_events(redis_client, keys), WeightVersionServing, policy="math", version=2), 15)
            await asyncio.sleep(0.5)  # a few more health rounds
            record = Registry(redis_client, keys).engines()["engine-0"]
            reply = await EngineClient(record.url).generate([1, 5, 6], {"max_new_tokens": 4, "temperature": 0.0})
            return pid, ctl.engines["engine-0"].record.pid, reply
        finally:
            await ctl.stop()

    pid_before, pid_after, reply = asyncio.run(scenario())
    (refused,) = find(weight_events(redis_client, keys), WeightUpdateFailed, policy="math", version=1,
                      engine_id="engine-0")
    assert "HTTP 500 loading adapter math@v1" in refused.reason  # type: ignore[attr-defined]
    assert "still generates on its base weights" in refused.reason  # type: ignore[attr-defined]
    assert not own(EngineUnhealthy) and not own(EngineRestarting)
    assert pid_before is not None and pid_before == pid_after
    assert len(reply["output_ids"]) == 4


def test_each_policy_s_weight_stream_is_applied_a_policy_that_appears_later_too_and_the_legacy_stream_still(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path,
        engines: list[EngineProcess]) -> None:
    """Two policies publish on their own weight streams, one of them (an adapter policy) only after the controller
    started and read the others; a publication on the legacy stream of before is still applied; a publication
    of one policy on another's stream is dead-lettered and never applied. Each outcome goes on its policy's stream."""
    version, legacy = next(_versions), next(_versions)
    full_dir, full_sha = write_version(root / "base", root / "default" / f"v{version}", seed=version)
    legacy_dir, legacy_sha = write_version(root / "base", root / "default" / f"v{legacy}", seed=legacy)
    adapter_dir = tiny_adapter(root / "late" / "v1", seed=7, policy="late", version=1)
    forged_dir, forged_sha = write_version(root / "base", root / "default" / f"v{legacy + 1}", seed=legacy + 1)

    def served(policy: str, v: int) -> list[Any]:
        return find(read_events(redis_client, keys.weight_stream(policy)), WeightVersionServing, policy=policy, version=v)

    async def scenario() -> None:
        ctl = await started(config(keys, redis_server, root, engines, enable_lora=True), redis_client)
        try:
            publish_weights(redis_client, keys, "default", version, str(full_dir), full_sha)
            await wait_until_async("default served", lambda: served("default", version), 15)
            assert not redis_client.exists(keys.weight_stream("late"))  # no such stream when the controller started
            publish_weights(redis_client, keys, "late", 1, str(adapter_dir), read_manifest(adapter_dir)[1])
            await wait_until_async("the later policy served", lambda: served("late", 1), 15)
            publish_weights(redis_client, keys, "default", legacy + 1, str(forged_dir), forged_sha,
                            stream=keys.weight_stream("late"))  # default's version on late's stream
            await wait_until_async("the misplaced one dead-lettered", lambda: any(
                b"weight stream of policy 'late'" in f.get(b"reason", b"")
                for _, f in redis_client.xrange(keys.dead_letters)), 15)
            publish_weights(redis_client, keys, "default", legacy, str(legacy_dir), legacy_sha,
                            stream=keys.legacy_weight_stream)
            await wait_until_async("the legacy publication served", lambda: served("default", legacy), 15)
        finally:
            await ctl.stop()

    asyncio.run(scenario())
    for policy in ("default", "late"):  # the controller's outcomes, each on its policy's stream
        outcomes = [e for e in read_events(redis_client, keys.weight_stream(policy)) if e.producer.role == "controller"]
        assert outcomes and {e.policy for e in outcomes} == {policy}  # type: ignore[attr-defined]
    assert not [e for e in read_events(redis_client, keys.legacy_weight_stream) if e.producer.role == "controller"]
    assert not find(weight_events(redis_client, keys), WeightsApplied, version=legacy + 1)
    records = Registry(redis_client, keys).engines()
    assert {r.versions["default"] for r in records.values()} == {legacy}
    assert {r.versions["late"] for r in records.values()} == {1}
    pending = {s: redis_client.xpending(s, "controller")["pending"]
               for s in (keys.weight_stream("default"), keys.weight_stream("late"), keys.legacy_weight_stream)}
    assert pending == dict.fromkeys(pending, 0)  # each handled entry acked on its own stream
