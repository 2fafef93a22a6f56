"""The gateway's own client keys, tenants bound to sessions, and engines that report SGLang's ``"default"``
weight version: real redis-server, real CPU engine processes, the gateway's real HTTP server, the real
``openai`` client."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from rollout_bus.events.connection import connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.sessions import SessionStore
from rollout_bus.executor.agents import EXTERNAL, AgentConfig, AgentRunner, fill_sample
from rollout_bus.executor.sample import Sample
from rollout_bus.gateway.chat import load_format
from rollout_bus.gateway.keys import ClientKey, ClientKeys, KeysError
from rollout_bus.gateway.server import make_gateway, serve
from tests.engine_proc import EngineProcess, call
from tests.support.gateway import GatewayThread, register

pytestmark = pytest.mark.timeout(300)

ENGINE_KEY = "engine-key-0123456789abcdef"
A_KEY = "tenant-a-key-0123456789"
B_KEY = "tenant-b-key-0123456789"
TENANTS = ClientKeys([ClientKey("a", A_KEY), ClientKey("b", B_KEY, frozenset({"other"}))])


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    s = RedisServer().start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed_engine(agent_model: Path) -> Iterator[EngineProcess]:
    """An engine that takes the engines' key and reports ``"default"``, as SGLang without ``--weight-version``."""
    proc = EngineProcess(agent_model, weight_version="default", extra_args=["--api-key", ENGINE_KEY])
    yield proc
    proc.stop()


@pytest.fixture()
def gw(server: RedisServer, keyed_engine: EngineProcess, agent_model: Path) -> Iterator[GatewayThread]:
    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    register(server.url, keys, [("e0", keyed_engine.url)], version=7)
    with GatewayThread(server.url, keys, agent_model, engine_key=ENGINE_KEY, client_keys=TENANTS) as g:
        yield g


def post(gw: GatewayThread, path: str, body: dict, key: str) -> tuple[int, dict]:
    return call(gw.url + path, "POST", body, headers={"Authorization": f"Bearer {key}"})


def get(gw: GatewayThread, path: str, key: str) -> tuple[int, dict]:
    return call(gw.url + path, headers={"Authorization": f"Bearer {key}"})


def client(gw: GatewayThread, sid: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.session_url(sid), api_key=key, max_retries=0)


def turn(c: openai.OpenAI, messages: list[dict]) -> dict:
    reply = c.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=1.0)
    messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    return dict(reply.model_extra["rollout_bus"])


def test_a_three_turn_session_on_an_engine_reporting_default_records_the_registry_version(
        gw: GatewayThread, keyed_engine: EngineProcess) -> None:
    status, info = call(keyed_engine.url + "/model_info", headers={"Authorization": f"Bearer {ENGINE_KEY}"})
    assert status == 200 and info["weight_version"] == "default"  # what the gateway is given
    assert post(gw, "/sessions", {"session_id": "dflt"}, A_KEY)[0] == 200
    c = client(gw, "dflt", A_KEY)
    messages: list[dict] = []
    parts = []
    for k in range(3):
        messages.append({"role": "user", "content": f"turn {k}"})
        parts.append(turn(c, messages))
    assert [p["turn"] for p in parts] == [0, 1, 2]
    assert all(p["weight_versions"] == [7] * len(p["output_token_ids"]) for p in parts)
    state = SessionStore(gw.client, gw.keys).get("dflt")
    assert state is not None and state["position"] == 3
    sample = fill_sample(Sample(group_index=0, index=0, prompt="", prompt_ids=[], label=None), state)
    assert sample.weight_versions == [7] and sample.metadata["unknown_version_tokens"] == 0


def test_a_session_is_found_only_with_the_key_of_its_tenant(gw: GatewayThread) -> None:
    assert post(gw, "/sessions", {"session_id": "mine", "policy": "default"}, A_KEY)[0] == 200
    messages = [{"role": "user", "content": "hi"}]
    turn(client(gw, "mine", A_KEY), messages)
    never = get(gw, "/sessions/never-opened", B_KEY)
    for status, body in (get(gw, "/sessions/mine", B_KEY), get(gw, "/sessions/mine/v1/models", B_KEY),
                         post(gw, "/sessions/mine/close", {"reward": 1.0}, B_KEY)):
        assert status == 404 and body["error"]["code"] == never[1]["error"]["code"] == "session_not_found"
        assert "journal" not in str(body) and "turns" not in body
    with pytest.raises(openai.NotFoundError) as caught:
        turn(client(gw, "mine", B_KEY), [*messages, {"role": "user", "content": "mine now"}])
    assert caught.value.body["code"] == "session_not_found"
    # another tenant cannot take the id over either, and its calls never held the session's lock
    assert post(gw, "/sessions", {"session_id": "mine", "policy": "other"}, B_KEY)[0] == 404
    assert gw.client.exists(gw.keys.session_busy("mine")) == 0
    status, body = get(gw, "/sessions/mine", A_KEY)
    assert status == 200 and body["turns"] == 1 and body["status"] == "open"
    assert turn(client(gw, "mine", A_KEY), [*messages, {"role": "user", "content": "again"}])["turn"] == 1


def test_a_key_opens_and_claims_only_the_policies_it_allows(gw: GatewayThread) -> None:
    for path, body in (("/sessions", {"session_id": "b1", "policy": "default"}),
                       ("/sessions/claim", {"policy": "default"})):
        status, reply = post(gw, path, body, B_KEY)
        assert status == 403, reply
        assert reply["error"]["code"] == "policy_not_allowed" and "'default'" in reply["error"]["message"]
    assert gw.client.exists(gw.keys.session("b1")) == 0
    assert post(gw, "/sessions", {"session_id": "b2", "policy": "other"}, B_KEY)[0] == 200


def test_a_claimed_session_belongs_to_the_tenant_that_claimed_it(gw: GatewayThread) -> None:
    gw.gateway.open("offered", "default", external=True)  # as an executor opens it for external agents
    gw.gateway.store.offer("default", ["offered"])
    assert get(gw, "/sessions/offered", A_KEY)[0] == 404  # nobody's until claimed
    status, body = post(gw, "/sessions/claim", {"policy": "default"}, A_KEY)
    assert status == 200 and body["session"]["id"] == "offered"
    assert get(gw, "/sessions/offered", A_KEY)[0] == 200
    assert get(gw, "/sessions/offered", B_KEY)[0] == 404
    assert turn(client(gw, "offered", A_KEY), [{"role": "user", "content": "hello"}])["turn"] == 0


def test_the_engines_key_is_no_client_key(gw: GatewayThread) -> None:
    status, body = post(gw, "/sessions", {"session_id": "e"}, ENGINE_KEY)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert ENGINE_KEY not in str(body)
    assert call(gw.url + "/health")[0] == 200


def test_the_gateway_refuses_an_open_address_without_keys_and_a_client_key_that_is_the_engines(
        server: RedisServer, agent_model: Path) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    redis_client = connect(server.url)
    try:
        gateway = make_gateway(redis_client, keys, load_format(str(agent_model)), instance="t", engine_key=ENGINE_KEY)
        with pytest.raises(KeysError, match="without client keys"):
            asyncio.run(serve(gateway, host="0.0.0.0"))
        same = ClientKeys([ClientKey("a", ENGINE_KEY)])
        with pytest.raises(KeysError, match="engines' key") as caught:
            asyncio.run(serve(gateway, host="127.0.0.1", client_keys=same))
        assert ENGINE_KEY not in str(caught.value)
    finally:
        redis_client.close()


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollout_bus", "gateway", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def test_the_cli_refuses_to_start_exposed_without_keys_or_with_the_engines_key(tmp_path: Path) -> None:
    clean = {"ROLLOUT_BUS_GATEWAY_API_KEYS": "", "ROLLOUT_BUS_ENGINE_API_KEY": ENGINE_KEY}
    out = run_cli(["--host", "0.0.0.0", "--redis-url", "redis://127.0.0.1:1/0"], clean)
    assert out.returncode == 2 and "without client keys" in out.stderr
    out = run_cli(["--host", "0.0.0.0", "--redis-url", "redis://127.0.0.1:1/0"],
                  {**clean, "ROLLOUT_BUS_GATEWAY_API_KEYS": f"ops {ENGINE_KEY}"})
    assert out.returncode == 2 and "engines' key" in out.stderr and ENGINE_KEY not in out.stderr
    bad = tmp_path / "keys.json"
    bad.write_text(json.dumps([{"tenant": "a.b", "key": A_KEY}]))
    out = run_cli(["--api-keys-file", str(bad)], clean)
    assert out.returncode == 2 and "'.'" in out.stderr and A_KEY not in out.stderr
    assert "127.0.0.1" in run_cli(["--help"], clean).stdout


def test_an_executors_gateway_takes_its_own_agents_key_and_never_the_engines(
        server: RedisServer, keyed_engine: EngineProcess, agent_model: Path) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    register(server.url, keys, [("e0", keyed_engine.url)], version=2)
    redis_client = connect(server.url)

    async def go() -> None:
        runner = AgentRunner(AgentConfig(EXTERNAL, model_path=str(agent_model)), redis_client, keys, instance="x",
                             engine_key=ENGINE_KEY)
        other = AgentRunner(AgentConfig(EXTERNAL, model_path=str(agent_model)), redis_client, keys, instance="y",
                            engine_key=ENGINE_KEY)
        assert runner.api_key != ENGINE_KEY and runner.api_key != other.api_key  # one random key per process
        running = await runner.start()
        try:
            await asyncio.to_thread(runner.gateway.open, "own", "default", tenant="_executor")
            for key, want in ((ENGINE_KEY, 401), (other.api_key, 401), (runner.api_key, 200)):
                status, _ = await asyncio.to_thread(call, running.url + "/sessions/own",
                                                    headers={"Authorization": f"Bearer {key}"})
                assert status == want, key
            reply = await runner.client("own").chat.completions.create(
                model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            assert reply.model_extra["rollout_bus"]["weight_versions"][0] == 2  # the engine said "default"
            assert os.environ["ROLLOUT_BUS_GATEWAY_API_KEY"] == runner.api_key  # where verifiers reads it
        finally:
            await runner.stop()

    try:
        asyncio.run(go())
    finally:
        redis_client.close()
        os.environ.pop("ROLLOUT_BUS_GATEWAY_API_KEY", None)
