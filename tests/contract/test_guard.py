"""SGLang ignores the fencing header; behind the guard (``engine.guard``) its real app is fenced: a
deposed controller's control calls are refused before they reach SGLang, while a newer controller's
calls, health checks and ``/generate`` go through."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import fakeredis
import pytest
from aiohttp import web

from tests.contract.lane import require_sglang

require_sglang()

from rollout_bus.controller.config import ControllerConfig  # noqa: E402
from rollout_bus.controller.health import check_engine  # noqa: E402
from rollout_bus.controller.service import InferenceController  # noqa: E402
from rollout_bus.controller.versions import Target  # noqa: E402
from rollout_bus.engine.guard import build_guard_app  # noqa: E402
from rollout_bus.engine.http_client import EngineClient, EngineHTTPError  # noqa: E402
from rollout_bus.events.errors import Fenced  # noqa: E402
from rollout_bus.events.registry import EngineState  # noqa: E402
from tests.contract.sglang_harness import Harness  # noqa: E402
from tests.contract.test_requests import run  # noqa: E402

KEY = "sekret"


@pytest.fixture(scope="module")
def harness() -> Harness:
    return Harness(["--api-key", KEY, "--weight-version", "0"])


@pytest.fixture(scope="module")
def url(harness: Harness) -> Iterator[str]:
    with harness.serve() as base:
        yield base


@contextlib.asynccontextmanager
async def guarded(upstream: str) -> AsyncIterator[str]:
    """The guard in front of ``upstream`` on a free loopback port; yields its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    runner = web.AppRunner(build_guard_app(upstream, api_key=KEY))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def controller(url: str, tmp_path: Path, fence: int) -> InferenceController:
    """A controller holding fencing token ``fence``; its own Redis, so only the engine can refuse it."""
    config = ControllerConfig(namespace=f"g{fence}", num_engines=0, adopt_urls=[url], weights_root=str(tmp_path),
                              log_dir=str(tmp_path / f"logs-{fence}"), engine_api_key=KEY, pause_mode="retract")
    return InferenceController(config, fakeredis.FakeRedis(), fence=fence)


def test_a_deposed_controller_is_refused_by_the_guard_in_front_of_sglangs_real_app(
        harness: Harness, url: str, tmp_path: Path) -> None:
    old, new = controller(url, tmp_path, fence=1), controller(url, tmp_path, fence=2)

    async def scenario() -> dict[str, object]:
        async with guarded(url) as door:
            h_old = old.lifecycle.new_handle("engine-0", door, managed=False, state=EngineState.SERVING)
            h_new = new.lifecycle.new_handle("engine-0", door, managed=False, state=EngineState.SERVING)
            h_old.record.versions = h_new.record.versions = {"default": 0}
            v1 = Target("default", 1, "/w", "0" * 64, "/w/default/v000001")
            async with old.core.operate(h_old):
                first = await old.updater.push(h_old, v1, pause=True)  # before the takeover: it lands
            v2 = Target("default", 2, "/w", "0" * 64, "/w/default/v000002")
            async with new.core.operate(h_new):
                second = await new.updater.push(h_new, v2, pause=True)  # the new leader's first call
            harness.tm.calls.clear()
            v3 = Target("default", 3, "/w", "0" * 64, "/w/default/v000003")
            with pytest.raises(Fenced):  # the guard refused its call: the deposed controller halts, writing nothing
                async with old.core.operate(h_old):
                    await old.updater.push(h_old, v3, pause=True)
            assert old.core.halted and old.core.fence_highest == 2  # told apart from a failure, with the token
            with pytest.raises(Fenced):  # and sends nothing more until its lease is checked
                await old.offload(["kv_cache"], [h_old.engine_id])
            with pytest.raises(EngineHTTPError) as refused:
                await h_old.client.resume_memory_occupation(["kv_cache"])
            health = await check_engine("engine-0", h_old.client, 30.0, with_load=True)  # open: no fence read
            reply = await EngineClient(door, api_key=KEY).generate([1, 2, 3], {"max_new_tokens": 2})
            with pytest.raises(EngineHTTPError) as anonymous:  # the key first: a stranger learns nothing
                await EngineClient(door, fence=9).pause_generation("retract")
            still = await h_new.client.continue_generation()
            return {"first": first, "second": second,
                    "refused": refused.value, "health": health, "reply": reply, "anonymous": anonymous.value,
                    "still": still}

    try:
        out = run(scenario())
    finally:
        old.core.bus.close()
        new.core.bus.close()
    assert out["first"].status == out["second"].status == "applied"  # type: ignore[attr-defined]
    refused = out["refused"]
    assert refused.status == 409 and refused.fenced  # type: ignore[attr-defined]
    assert out["health"].ok  # type: ignore[attr-defined]
    assert out["reply"]["meta_info"]["weight_version"] == "2"  # type: ignore[index]
    assert out["anonymous"].status == 401  # type: ignore[attr-defined]
    # nothing the deposed controller sent reached SGLang: only the health check, the generate call and
    # the new leader's continue did
    methods = [c.method for c in harness.tm.calls]
    assert methods == ["generate_request", "generate_request", "continue_generation"]
    assert harness.tm.weight_version == "2"


def test_the_fence_reply_is_the_cpu_engines(harness: Harness, url: str) -> None:
    async def scenario() -> tuple[int, dict[str, object]]:
        async with guarded(url) as door:
            await EngineClient(door, api_key=KEY, fence=5).continue_generation()
            client = EngineClient(door, api_key=KEY, fence=4)
            async with client.session.post(door + "/pause_generation", json={"mode": "retract"},
                                           headers=client._headers) as resp:
                answer = resp.status, await resp.json()
            assert not [c for c in harness.tm.calls if c.method == "pause_generation"]
            direct = EngineClient(url, api_key=KEY, fence=4)  # SGLang alone: the same stale call lands
            await direct.pause_generation("retract")
            await direct.continue_generation()
            return answer

    status, body = run(scenario())
    assert status == 409
    assert body == {"success": False, "fenced": True, "highest": 5,
                    "message": "fenced: token 4 is older than 5: another controller took over"}
    assert [c.obj.mode for c in harness.tm.calls if c.method == "pause_generation"] == ["retract"]
