"""SGLang's ``--api-key``: the project's clients send it as a bearer token, and the CPU engine leaves
open exactly the routes SGLang's middleware leaves open."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from tests.contract.lane import require_sglang

require_sglang()

from rollout_bus.engine.http_client import EngineClient, EngineHTTPError, close_shared_session  # noqa: E402
from tests.contract.sglang_harness import Harness  # noqa: E402
from tests.engine_proc import EngineProcess, call, make_weights_dir  # noqa: E402

KEY = "sekret"
ROUTES = [("GET", "/health"), ("GET", "/health_generate"), ("GET", "/ready"), ("GET", "/metrics"),
          ("GET", "/model_info"), ("GET", "/server_info"), ("GET", "/v1/loads"), ("GET", "/v1/models"),
          ("GET", "/flush_cache"), ("POST", "/generate"), ("POST", "/update_weights_from_disk"),
          ("POST", "/abort_request"), ("POST", "/pause_generation"), ("POST", "/load_lora_adapter"),
          ("GET", "/no_such_route")]


@pytest.fixture(scope="module")
def harness() -> Harness:
    return Harness(["--api-key", KEY])


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with EngineProcess(make_weights_dir(tmp_path_factory.mktemp("tiny") / "m"), extra_args=["--api-key", KEY]) as proc:
        yield proc


def test_the_same_routes_are_open_without_a_key(harness: Harness, engine: EngineProcess) -> None:
    sglang = harness.client()
    for method, path in ROUTES:
        theirs = sglang.request(method, path, json={}).status_code
        ours = call(engine.url + path, method, {} if method == "POST" else None)[0]
        assert (theirs == 401) == (ours == 401), f"{method} {path}: SGLang {theirs}, CPU engine {ours}"
    assert sglang.get("/model_info", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert sglang.get("/model_info", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_the_client_sends_the_key_as_a_bearer_token(harness: Harness) -> None:
    async def scenario(url: str) -> tuple[Any, int]:
        try:
            reply = await EngineClient(url, api_key=KEY).generate([1, 2], {"max_new_tokens": 2})
            with pytest.raises(EngineHTTPError) as refused:
                await EngineClient(url).model_info()
            return reply, refused.value.status
        finally:
            await close_shared_session()

    with harness.serve() as url:
        reply, refused = asyncio.run(scenario(url))
    assert len(reply["output_ids"]) == 2 and refused == 401
