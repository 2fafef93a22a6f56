"""The project's own requests, sent by its own code (executor router, controller updater and offload,
health checks), to SGLang's real HTTP app: each lands in the fields meant, and each of the seven
findings of the contract review holds against SGLang itself."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import fakeredis
import pytest

from tests.contract.lane import require_sglang

require_sglang()

from rollout_bus.controller.config import ControllerConfig  # noqa: E402
from rollout_bus.controller.health import check_engine, load_of  # noqa: E402
from rollout_bus.controller.lifecycle import adopted_engine_id  # noqa: E402
from rollout_bus.controller.service import InferenceController  # noqa: E402
from rollout_bus.controller.state import EngineHandle  # noqa: E402
from rollout_bus.controller.versions import Target  # noqa: E402
from rollout_bus.engine.http_client import EngineClient, EngineHTTPError, close_shared_session  # noqa: E402
from rollout_bus.events.names import Keys  # noqa: E402
from rollout_bus.events.registry import EngineRecord, EngineState, Registry  # noqa: E402
from rollout_bus.executor.engines import EngineCaller, EngineRouter, EngineTime  # noqa: E402
from tests.contract.sglang_harness import Harness, plain  # noqa: E402

T = TypeVar("T")
ARGV = ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all", "--weight-version", "0"]


@pytest.fixture(scope="module")
def harness() -> Harness:
    return Harness(ARGV)


@pytest.fixture(scope="module")
def url(harness: Harness) -> Iterator[str]:
    with harness.serve() as base:
        yield base


@pytest.fixture(autouse=True)
def fresh(harness: Harness) -> Iterator[None]:
    harness.tm.calls.clear()
    harness.tm.hold.clear()
    yield
    harness.tm.hold.clear()
    assert harness.tm.scheduler_deaths == [], "a real SGLang scheduler would have died"


def run(coro: Coroutine[Any, Any, T]) -> T:
    async def with_session() -> T:
        try:
            return await coro
        finally:
            await close_shared_session()
    return asyncio.run(with_session())


def controller(url: str, tmp_path: Path, **settings: Any) -> tuple[InferenceController, EngineHandle]:
    config = ControllerConfig(namespace=f"c{tmp_path.name[-8:].replace('-', '')}", num_engines=0, adopt_urls=[url],
                              weights_root=str(tmp_path), log_dir=str(tmp_path / "logs"), enable_lora=True,
                              **settings)
    ctl = InferenceController(config, fakeredis.FakeRedis())
    h = ctl.lifecycle.new_handle(adopted_engine_id(url), url, managed=False, state=EngineState.SERVING)
    h.record.versions = {"default": 0}
    return ctl, h


async def held(harness: Harness, client: EngineClient, count: int) -> list[asyncio.Task[Any]]:
    """``count`` generate calls that stay in flight (until released or aborted)."""
    before = len(harness.tm.inflight)
    harness.tm.hold.set()
    tasks = [asyncio.create_task(client.generate([1, 2, 3], {"max_new_tokens": 4}, rid=f"held-{i}"))
             for i in range(count)]
    deadline = asyncio.get_running_loop().time() + 30.0
    while len(harness.tm.inflight) < before + count:
        ended = [t for t in tasks if t.done()]
        if ended or asyncio.get_running_loop().time() > deadline:  # a call that never got in flight: say why
            harness.tm.hold.clear()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            why = [repr(t.exception()) if not t.cancelled() and t.exception() else "no reply" for t in ended]
            raise AssertionError(f"{len(harness.tm.inflight) - before} of {count} held calls in flight after "
                                 f"{'an early end' if ended else '30 s'}: {why or 'none ended'}")
        await asyncio.sleep(0.01)
    return tasks


def test_the_executors_generate_calls_land_in_sglangs_fields_and_adapters_are_named_by_version(
        harness: Harness, url: str) -> None:
    """Finding 1: a non-base policy is served by an adapter the controller loaded; the call names it."""
    keys = Keys("contract")
    registry = Registry(fakeredis.FakeRedis(), keys)
    registry.put_engine(EngineRecord("e0", url, EngineState.SERVING, versions={"default": 0, "math": 2},
                                     adapters={"math": "math@v2"}))
    params = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "sampling_seed": 3}

    async def scenario() -> list[Any]:
        await EngineClient(url).load_lora_adapter("math@v2", "/w/math/v000002")
        caller = EngineCaller(EngineRouter(registry))
        return [await caller.generate(policy, [1, 5, 6], params, rid=f"req-{policy}", deadline=None,
                                      timer=EngineTime()) for policy in ("default", "math")]

    base, adapter = run(scenario())
    sent = [plain(c.obj) for c in harness.tm.calls_of("generate_request")]
    for body, lora in zip(sent, [None, "math@v2"], strict=True):
        assert body["input_ids"] == [1, 5, 6] and body["return_logprob"] is True and body["lora_path"] == lora
        assert body["sampling_params"] == params
    assert [s["rid"] for s in sent] == ["req-default.0", "req-math.0"]
    assert (base.versions, adapter.versions) == ([0], [2])  # the adapter's version is in its name
    assert len(base.output_ids) == len(base.log_probs) == 8


def test_an_adapter_never_loaded_is_sglangs_400_which_the_client_recognises(harness: Harness, url: str) -> None:
    async def scenario() -> EngineHTTPError:
        with pytest.raises(EngineHTTPError) as caught:
            await EngineClient(url).generate([1, 2], {"max_new_tokens": 2}, lora_path="math")
        return caught.value

    error = run(scenario())
    assert error.status == 400 and error.unknown_adapter


def test_a_batch_with_n_samples_comes_back_prompt_major(harness: Harness, url: str) -> None:
    replies = run(EngineClient(url).generate([[1, 2, 3], [4, 5]], {"max_new_tokens": 2, "n": 2}, return_logprob=True,
                                             rid="b"))
    assert [r["meta_info"]["prompt_tokens"] for r in replies] == [3, 3, 2, 2]
    (call,) = harness.tm.calls_of("generate_request")
    assert call.obj.input_ids == [[1, 2, 3], [4, 5], [1, 2, 3], [4, 5]]  # normalised rows, not the reply order
    assert call.obj.parallel_sample_num == 2 and call.obj.batch_size == 2


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_a_full_weight_update_lands_with_the_version_and_no_lora_name_in_every_pause_mode(
        harness: Harness, url: str, tmp_path: Path, mode: str) -> None:
    """Finding 2: SGLang has no per-policy weight sets (a ``lora_name`` would be dropped and the base
    overwritten); the controller sends none. Finding 5: under an in_place pause no flush is asked for."""
    ctl, h = controller(url, tmp_path, pause_mode=mode)
    version = {"abort": 11, "retract": 12, "in_place": 13}[mode]
    target = Target("default", version, "/w", "0" * 64, f"/w/default/v{version:06d}")

    async def scenario() -> tuple[Any, list[Any]]:
        tasks = await held(harness, h.client, 1)  # a request in flight while the update runs
        async with ctl.core.operate(h):
            outcome = await ctl.updater.push(h, target, pause=True)
        harness.tm.hold.clear()
        return outcome, list(await asyncio.gather(*tasks))

    try:
        outcome, replies = run(scenario())
    finally:
        ctl.core.bus.close()
    assert outcome.status == "applied", outcome.reason
    assert replies[0]["meta_info"]["finish_reason"]["type"] == ("abort" if mode == "abort" else "length")
    methods = [c.method for c in harness.tm.calls if c.method not in ("generate_request", "abort_request")]
    flushed = ["pause_generation", "flush_cache"] if mode == "in_place" else []  # no old-weights KV left
    assert methods == ["pause_generation", "update_weights_from_disk", *flushed, "continue_generation"]
    assert [p.obj.mode for p in harness.tm.calls_of("pause_generation")] == [mode, *(["retract"] if flushed else [])]
    assert all(c.kwargs["success"] for c in harness.tm.calls_of("flush_cache"))  # SGLang's app accepted it
    update = harness.tm.calls_of("update_weights_from_disk")[0].obj
    body = plain(update)
    assert (body["model_path"], body["weight_version"], body["abort_all_requests"]) == (target.engine_path, str(version), False)
    assert body["flush_cache"] is (mode != "in_place") and "lora_name" not in body
    assert harness.tm.weight_version == str(version) and h.record.versions["default"] == version


def test_a_broadcast_update_drives_sglangs_three_routes_with_their_fields(
        harness: Harness, url: str, tmp_path: Path) -> None:
    """``--weight-sync broadcast``: the controller's group and bucket requests land in SGLang's own request
    types (``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``), a bucket per call,
    the version as ``weight_version``, the cache flushed with the last bucket; a second version reuses the group,
    and an engine set that changes destroys it (``DestroyWeightsUpdateGroupReqInput``)."""
    from rollout_bus.lm.buckets import bucket_plan
    from rollout_bus.lm.files import tensor_shapes
    from tests.engine_proc import make_weights_dir

    ctl, h = controller(url, tmp_path, weight_sync="broadcast")
    directory = make_weights_dir(tmp_path / "default" / "v000031", seed=31)
    shapes = tensor_shapes(directory)
    plan = tuple(tuple(b) for b in bucket_plan(shapes, 32 * 1024))
    assert ctl.updater.broadcast is not None and len(plan) > 2

    def target(version: int) -> Target:
        return Target("default", version, str(directory), "0" * 64, str(directory), group_address="127.0.0.1:29555",
                      group_backend="gloo", buckets=plan)

    async def scenario() -> list[Any]:
        first = await ctl.updater.broadcast_all(target(31), [h])
        second = await ctl.updater.broadcast_all(target(32), [h])
        ctl.updater.broadcast.groups["default"] = dataclasses.replace(ctl.updater.broadcast.groups["default"],
                                                                       members=("gone", h.engine_id))
        third = await ctl.updater.broadcast_all(target(33), [h])
        return [*first, *second, *third]

    try:
        outcomes = run(scenario())
    finally:
        ctl.core.bus.close()
    assert [o.status for o in outcomes] == ["applied"] * 3, outcomes
    (opened, reopened) = [plain(c.obj) for c in harness.tm.calls_of("init_weights_update_group")]
    assert (opened["master_address"], opened["master_port"], opened["rank_offset"], opened["world_size"],
            opened["backend"]) == ("127.0.0.1", 29555, 1, 2, "gloo")
    assert reopened["group_name"] != opened["group_name"]
    (destroyed,) = [plain(c.obj) for c in harness.tm.calls_of("destroy_weights_update_group")]
    assert destroyed["group_name"] == opened["group_name"]
    buckets = [plain(c.obj) for c in harness.tm.calls_of("update_weights_from_distributed")]
    assert len(buckets) == 3 * len(plan)
    first = buckets[:len(plan)]
    assert [tuple(b["names"]) for b in first] == list(plan)
    assert all(b["dtypes"] == ["float32"] * len(b["names"]) for b in first)
    assert all(b["shapes"] == [list(shapes[n][1]) for n in b["names"]] for b in first)
    assert {b["weight_version"] for b in first} == {"31"} and {b["group_name"] for b in first} == {opened["group_name"]}
    assert [b["flush_cache"] for b in first] == [False] * (len(plan) - 1) + [True]
    assert harness.tm.weight_version == "33" and h.record.versions["default"] == 33


def test_an_unflushed_update_under_an_in_place_pause_is_counted_as_applied_and_its_version_set(
        harness: Harness, url: str, tmp_path: Path) -> None:
    """Finding 5 as SGLang answers it: 400 "Weights were updated, but the cache was not flushed" while the
    weights are in. The client recognises it; the controller sets the version instead of rolling back."""
    ctl, h = controller(url, tmp_path, pause_mode="in_place")

    async def scenario() -> EngineHTTPError:
        tasks = await held(harness, h.client, 1)
        await h.client.pause_generation("in_place")
        with pytest.raises(EngineHTTPError) as caught:
            await h.client.update_weights_from_disk("/w/default/v000020", weight_version=20, flush_cache=True)
        status, _ = await ctl.updater._load_weights(h, Target("default", 21, "/w", "0" * 64, "/w/default/v000021"),
                                                    pause=False)
        assert status == "applied"
        await h.client.continue_generation()
        harness.tm.hold.clear()
        await asyncio.gather(*tasks)
        return caught.value

    try:
        error = run(scenario())
    finally:
        ctl.core.bus.close()
    assert error.unflushed
    assert harness.tm.calls_of("update_weight_version")[-1].obj.new_version == "21"
    assert harness.tm.weight_version == "21"


def test_adapter_versions_are_swapped_by_name_and_read_back_from_the_engine(
        harness: Harness, url: str, tmp_path: Path) -> None:
    """Finding 3: /model_info has no per-adapter versions; the names /v1/models lists carry them."""
    ctl, h = controller(url, tmp_path)

    async def scenario() -> dict[str, int]:
        for version in (1, 2):
            target = Target("code", version, "/w", "0" * 64, f"/w/code/v{version:06d}", "adapter")
            async with ctl.core.operate(h):
                assert (await ctl.updater.push(h, target, pause=False)).status == "applied"
        await asyncio.sleep(1.5)  # the old name is retired a moment after the registry names the new one
        h.record.versions, h.record.adapters = {}, {}
        await ctl.lifecycle.read_versions(h)
        return dict(h.record.versions)

    try:
        versions = run(scenario())
    finally:
        ctl.core.bus.close()
    loads = [plain(c.obj) for c in harness.tm.calls_of("load_lora_adapter")]
    assert [(b["lora_name"], b["lora_path"]) for b in loads] == [("code@v1", "/w/code/v000001"), ("code@v2", "/w/code/v000002")]
    assert [c.obj.lora_name for c in harness.tm.calls_of("unload_lora_adapter")] == ["code@v1"]
    assert not harness.tm.calls_of("update_weights_from_disk") and not harness.tm.calls_of("pause_generation")
    assert versions["code"] == 2 and h.record.lora_path("code") == "code@v2"
    assert "weight_versions" not in run(h.client.model_info())


def test_loads_are_read_from_v1_loads_and_server_info_has_none(harness: Harness, url: str) -> None:
    """Finding 4."""
    client = EngineClient(url)

    async def scenario() -> tuple[Any, dict[str, Any]]:
        tasks = await held(harness, client, 2)
        try:
            result = await check_engine("e0", client, 30.0, with_load=True)
            info = await client.server_info()
        finally:
            harness.tm.hold.clear()
            await asyncio.gather(*tasks)
        return result, info

    result, info = run(scenario())
    assert result.ok and result.load == 2
    assert load_of(info) is None
    assert not {"num_running_reqs", "num_waiting_reqs", "running", "queued"} & set(info["internal_states"][0])


def test_offload_with_requests_in_flight_pauses_first_and_onload_sends_only_released_tags(
        harness: Harness, url: str, tmp_path: Path) -> None:
    """Findings 6 and 7: SGLang's scheduler asserts it is idle on release, and raises on resuming a tag it
    never released; either kills the server. Neither happens here (``fresh`` checks it after each test)."""
    ctl, h = controller(url, tmp_path)

    async def scenario() -> tuple[dict[str, str], list[Any], dict[str, str], dict[str, str]]:
        tasks = await held(harness, h.client, 2)
        offloaded = await ctl.offload(["kv_cache", "weights"], [h.engine_id])
        replies = list(await asyncio.gather(*tasks))
        refused = await ctl.onload(["cuda_graph"], [h.engine_id])
        onloaded = await ctl.onload(["kv_cache", "weights"], [h.engine_id])
        return offloaded, replies, refused, onloaded

    try:
        offloaded, replies, refused, onloaded = run(scenario())
    finally:
        ctl.core.bus.close()
    assert offloaded == {h.engine_id: "ok"} and onloaded == {h.engine_id: "ok"}
    assert [r["meta_info"]["finish_reason"]["type"] for r in replies] == ["abort", "abort"]
    assert "nothing was sent" in refused[h.engine_id]
    methods = [c.method for c in harness.tm.calls if c.method not in ("generate_request", "abort_request")]
    assert methods == ["pause_generation", "release_memory_occupation", "resume_memory_occupation",
                       "continue_generation"]
    assert harness.tm.calls_of("pause_generation")[0].obj.mode == "abort"
    assert sorted(harness.tm.calls_of("resume_memory_occupation")[0].obj.tags) == ["kv_cache", "weights"]
    assert harness.tm.released == set() and h.state == EngineState.SERVING


def test_control_bodies_land_in_their_fields(harness: Harness, url: str) -> None:
    client = EngineClient(url)

    async def scenario() -> dict[str, Any]:
        await client.update_weight_version(5)
        await client.abort_request("some-rid")
        await client.abort_request(abort_all=True)
        await client.release_memory_occupation(["kv_cache"])
        await client.resume_memory_occupation(["kv_cache"])
        await client.health_generate(timeout_s=30)
        return await client.model_info()

    info = run(scenario())
    version = plain(harness.tm.calls_of("update_weight_version")[0].obj)
    assert (version["new_version"], version["abort_all_requests"]) == ("5", False)
    assert [c.kwargs for c in harness.tm.calls_of("abort_request")] == [
        {"rid": "some-rid", "abort_all": False}, {"rid": "", "abort_all": True}]
    assert harness.tm.calls_of("release_memory_occupation")[0].obj.tags == ["kv_cache"]
    assert harness.tm.calls_of("resume_memory_occupation")[0].obj.tags == ["kv_cache"]
    assert any(c.kwargs["health"] for c in harness.tm.calls_of("generate_request"))
    assert info["weight_version"] == "5" and "model_path" in info
