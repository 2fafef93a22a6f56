"""The session gateway end to end: real redis-server, real CPU engines serving a random HF Llama, the
gateway's real HTTP server, and the real ``openai`` client pointed at a session's base URL."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from rollout_bus.events.connection import connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.registry import EngineState
from rollout_bus.events.schema import SessionClosed, SessionTurn, decode
from rollout_bus.events.sessions import SessionStore
from rollout_bus.gateway.keys import ClientKey, ClientKeys
from rollout_bus.gateway.tito import trajectory, trajectory_digest
from tests.engine_proc import EngineProcess, call, wait_until
from tests.support.gateway import CHATML_TOOLS_TEMPLATE, GatewayThread, register, set_state
from tests.support.models import copy_dir, llama_dir

pytestmark = pytest.mark.timeout(300)

KEY = "gw-test-key"
"""The engines' key: the gateway holds it, no client does."""
CLIENT = "tenant-a-key-0123456789"
OTHER = "tenant-b-key-0123456789"
CLIENT_KEYS = ClientKeys([ClientKey("a", CLIENT), ClientKey("b", OTHER, frozenset({"other"}))])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama_dir(tmp_path_factory.mktemp("llama") / "v0", seed=3)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    s = RedisServer().start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[list[EngineProcess]]:
    procs = [EngineProcess(model_dir, extra_args=["--api-key", KEY]) for _ in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture()
def setup(server: RedisServer, engines: list[EngineProcess], model_dir: Path) -> Iterator[tuple[GatewayThread, Keys]]:
    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    register(server.url, keys, [("e0", engines[0].url), ("e1", engines[1].url)])
    with GatewayThread(server.url, keys, model_dir, engine_key=KEY, client_keys=CLIENT_KEYS) as gw:
        yield gw, keys


def client_for(gw: GatewayThread, sid: str, key: str = CLIENT) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.session_url(sid), api_key=key, max_retries=0)


def open_session(gw: GatewayThread, sid: str, **kw: object) -> dict:
    status, body = call(gw.url + "/sessions", "POST", {"session_id": sid, **kw},
                        headers={"Authorization": f"Bearer {CLIENT}"})
    assert status == 200, body
    return body


def chat(client: openai.OpenAI, messages: list[dict], **kw: object):  # type: ignore[no-untyped-def]
    return client.chat.completions.create(model="default", messages=messages, max_tokens=kw.pop("max_tokens", 8),
                                          temperature=kw.pop("temperature", 1.0), **kw)


def episode(client: openai.OpenAI, turns: int, extra: str = "") -> tuple[list[dict], list[dict]]:
    """``turns`` user/assistant exchanges; the messages and each reply's ``rollout_bus`` part."""
    messages: list[dict] = [{"role": "system", "content": "you are terse"}]
    parts = []
    for k in range(turns):
        messages.append({"role": "user", "content": f"turn {k}: what is {k}+{k}?{extra}"})
        reply = chat(client, messages)
        parts.append(reply.model_extra["rollout_bus"])
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    return messages, parts


def stored(gw: GatewayThread, keys: Keys, sid: str) -> dict:
    state = SessionStore(gw.client, keys).get(sid)
    assert state is not None
    return state


def events(gw: GatewayThread, keys: Keys) -> list:
    return [decode(fields) for _, fields in gw.client.xrange(keys.session_stream)]


def test_exact_tokens_mask_and_logprobs(setup: tuple[GatewayThread, Keys], model_dir: Path) -> None:
    gw, keys = setup
    open_session(gw, "exact")
    client = client_for(gw, "exact")
    messages, parts = episode(client, 4)
    state = stored(gw, keys, "exact")
    t = trajectory(state)
    # the sample is every engine input and output, concatenated, in order
    want: list[int] = []
    for p in parts:
        want += p["input_token_ids"] + p["output_token_ids"]
    assert t.prompt_ids + t.response_ids == want
    # the mask is 1 on exactly the engine's tokens
    mask = [0] * len(t.prompt_ids) + t.loss_mask
    made = []
    for p in parts:
        made += [0] * len(p["input_token_ids"]) + [1] * len(p["output_token_ids"])
    assert mask == made and sum(made) > 0 and 0 in t.loss_mask
    # what the client added after the first turn was rendered as the template renders it: the session's
    # text is the template's text of the whole conversation
    fmt = gw.fmt
    assert fmt.decode(want).startswith(fmt.render(messages[:2], add_generation_prompt=True))
    # the engine saw exactly these tokens: a forward pass over the sample gives the engine's log-probs
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([want])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    positions = [i for i, m in enumerate(mask) if m]
    recomputed = [float(logp[i - 1, want[i]]) for i in positions]
    engine = [lp for p in parts for lp in p["output_token_logprobs"]]
    assert len(recomputed) == len(engine)
    assert max(abs(a - b) for a, b in zip(recomputed, engine, strict=True)) < 1e-3
    # a session event per turn, with the token counts
    turns = [e for e in events(gw, keys) if isinstance(e, SessionTurn)]
    assert [e.turn for e in turns] == [0, 1, 2, 3]
    assert [e.output_tokens for e in turns] == [len(p["output_token_ids"]) for p in parts]
    # closing writes the reward and the sample's digest
    status, body = call(gw.url + "/sessions/exact/close", "POST", {"reward": 0.5},
                        headers={"Authorization": f"Bearer {CLIENT}"})
    assert status == 200 and body["status"] == "closed" and body["reward"] == 0.5
    closed = [e for e in events(gw, keys) if isinstance(e, SessionClosed)]
    assert len(closed) == 1 and closed[0].digest == trajectory_digest(t) and closed[0].turns == 4


def test_history_mismatch_is_refused_with_position(setup: tuple[GatewayThread, Keys]) -> None:
    gw, keys = setup
    open_session(gw, "edited")
    client = client_for(gw, "edited")
    messages, parts = episode(client, 2)
    edited = [dict(m) for m in messages] + [{"role": "user", "content": "and now?"}]
    edited[1]["content"] = "turn 0: what is 5+5?"
    with pytest.raises(openai.ConflictError) as caught:
        chat(client, edited)
    error = caught.value.body
    assert error["code"] == "history_mismatch" and error["param"] == "messages[1]"
    assert error["position"] == 0  # message 1 is in the first turn's block, which starts the session
    # an assistant reply the engine did not write
    forged = [dict(m) for m in messages]
    forged[2]["content"] = forged[2]["content"] + " (edited)"
    with pytest.raises(openai.ConflictError) as caught:
        chat(client, forged + [{"role": "user", "content": "x"}])
    assert caught.value.body["param"] == "messages[2]"
    assert caught.value.body["position"] == len(parts[0]["input_token_ids"])
    # nothing was lost: the untouched history goes on
    reply = chat(client, messages + [{"role": "user", "content": "go on"}])
    assert reply.model_extra["rollout_bus"]["turn"] == 2
    assert stored(gw, keys, "edited")["position"] == 3


def test_pinned_to_one_engine_and_moved_when_it_stops_serving(setup: tuple[GatewayThread, Keys],
                                                              server: RedisServer) -> None:
    gw, keys = setup
    open_session(gw, "pinned")
    client = client_for(gw, "pinned")
    messages, parts = episode(client, 3)
    first = parts[0]["engine_id"]
    assert [p["engine_id"] for p in parts] == [first] * 3
    # the prefix cache's view: the engine reports the earlier turns' tokens as cached, when it has one
    other = "e1" if first == "e0" else "e0"
    set_state(server.url, keys, first, EngineState.STOPPED)
    wait_until("the gateway sees the stop", lambda: gw.call(gw.gateway.pinner.records(force=True))[first].state
               == EngineState.STOPPED)
    reply = chat(client, messages + [{"role": "user", "content": "still there?"}])
    assert reply.model_extra["rollout_bus"]["engine_id"] == other
    state = stored(gw, keys, "pinned")
    assert state["switches"] == 1 and state["engine_id"] == other
    # the new engine re-prefilled the whole session: its tokens are the recorded ones plus this turn's
    t = trajectory(state)
    assert len(t.prompt_ids) + len(t.response_ids) == sum(
        len(p["input_token_ids"]) + len(p["output_token_ids"]) for p in parts) + len(
        reply.model_extra["rollout_bus"]["input_token_ids"]) + len(reply.model_extra["rollout_bus"]["output_token_ids"])
    set_state(server.url, keys, first, EngineState.SERVING)


def test_new_sessions_go_to_the_least_loaded_engine(setup: tuple[GatewayThread, Keys]) -> None:
    gw, keys = setup
    gw.gateway.pinner.in_flight["e0"] = 5  # e0 busy with this gateway's calls
    try:
        for i in range(3):
            open_session(gw, f"fresh{i}")
            reply = chat(client_for(gw, f"fresh{i}"), [{"role": "user", "content": "hi"}])
            assert reply.model_extra["rollout_bus"]["engine_id"] == "e1"
    finally:
        gw.gateway.pinner.in_flight["e0"] = 0


def test_engine_death_moves_the_session(server: RedisServer, model_dir: Path) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    doomed = EngineProcess(model_dir)
    spare = EngineProcess(model_dir)
    try:
        register(server.url, keys, [("a", doomed.url)])
        with GatewayThread(server.url, keys, model_dir, wait_s=5) as gw:
            open_session_plain(gw, "dies")
            client = openai.OpenAI(base_url=gw.session_url("dies"), api_key="none", max_retries=0)
            messages, parts = episode(client, 2)
            assert {p["engine_id"] for p in parts} == {"a"}
            doomed.kill()
            assert doomed.proc is not None and doomed.proc.poll() is not None  # the engine is dead
            register(server.url, keys, [("b", spare.url)])  # the controller's replacement
            reply = chat(client, messages + [{"role": "user", "content": "after the crash"}])
            assert reply.model_extra["rollout_bus"]["engine_id"] == "b"
            state = SessionStore(gw.client, keys).get("dies")
            assert state is not None and state["switches"] == 1 and state["position"] == 3
    finally:
        doomed.stop()
        spare.stop()


def open_session_plain(gw: GatewayThread, sid: str) -> None:
    status, body = call(gw.url + "/sessions", "POST", {"session_id": sid})
    assert status == 200, body


def test_a_session_spans_a_weight_update_with_per_token_versions(setup: tuple[GatewayThread, Keys],
                                                                 server: RedisServer,
                                                                 engines: list[EngineProcess]) -> None:
    gw, keys = setup
    register(server.url, keys, [("e0", engines[0].url)], version=0)
    client_ = connect(server.url)
    client_.hdel(keys.engine_registry, "e1")
    client_.close()
    open_session(gw, "spans")
    client = client_for(gw, "spans")
    messages, parts = episode(client, 2)
    assert {v for p in parts for v in p["weight_versions"]} == {0}
    status, _ = call(engines[0].url + "/update_weight_version", "POST", {"new_version": "1"},
                     headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200
    try:
        register(server.url, keys, [("e0", engines[0].url)], version=1)
        reply = chat(client, messages + [{"role": "user", "content": "after the update"}])
        assert set(reply.model_extra["rollout_bus"]["weight_versions"]) == {1}
        state = stored(gw, keys, "spans")
        t = trajectory(state)
        model_versions = [v for v, m in zip(t.versions, t.loss_mask, strict=True) if m]
        assert set(model_versions) == {0, 1} and model_versions[-1] == 1
        call(gw.url + "/sessions/spans/close", "POST", {"reward": 1.0}, headers={"Authorization": f"Bearer {CLIENT}"})
        closed = [e for e in events(gw, keys) if isinstance(e, SessionClosed)]
        assert closed[-1].oldest_version == 0 and closed[-1].newest_version == 1  # staleness: the oldest token
    finally:
        call(engines[0].url + "/update_weight_version", "POST", {"new_version": "0"},
             headers={"Authorization": f"Bearer {KEY}"})


def test_streaming_gives_the_same_reply(setup: tuple[GatewayThread, Keys]) -> None:
    gw, keys = setup
    open_session(gw, "streamed")
    client = client_for(gw, "streamed")
    stream = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "count"}],
                                            max_tokens=12, temperature=1.0, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    state = stored(gw, keys, "streamed")
    assert state["position"] == 1 and state["turns"][0]["reply"]["content"] == text
    # the streamed reply, echoed back, is the recorded history
    reply = chat(client, [{"role": "user", "content": "count"}, {"role": "assistant", "content": text},
                          {"role": "user", "content": "more"}])
    assert reply.model_extra["rollout_bus"]["turn"] == 1


def test_completions_endpoint(setup: tuple[GatewayThread, Keys]) -> None:
    gw, keys = setup
    open_session(gw, "plain")
    client = client_for(gw, "plain")
    first = client.completions.create(model="default", prompt="once upon a time", max_tokens=6, temperature=1.0)
    text = "once upon a time" + first.choices[0].text
    second = client.completions.create(model="default", prompt=text + " and then", max_tokens=6, temperature=1.0)
    extra = second.model_extra["rollout_bus"]
    assert extra["turn"] == 1 and gw.fmt.decode(extra["input_token_ids"]) == " and then"
    with pytest.raises(openai.ConflictError):
        client.completions.create(model="default", prompt="twice upon a time", max_tokens=4)


def test_tools_rendered_and_tool_replies_masked(server: RedisServer, engines: list[EngineProcess],
                                                model_dir: Path, tmp_path: Path) -> None:
    tooled = copy_dir(model_dir, tmp_path / "tooled")
    (tooled / "chat_template.jinja").write_text(CHATML_TOOLS_TEMPLATE)
    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    register(server.url, keys, [("e0", engines[0].url)])
    tools = [{"type": "function", "function": {"name": "calculator", "description": "evaluates arithmetic",
                                               "parameters": {"type": "object",
                                                              "properties": {"expr": {"type": "string"}}}}}]
    with GatewayThread(server.url, keys, tooled, engine_key=KEY, client_keys=CLIENT_KEYS) as gw:
        assert gw.fmt.supports_tools
        open_session(gw, "tools")
        client = client_for(gw, "tools")
        messages = [{"role": "user", "content": "what is 12*7? use the calculator"}]
        reply = chat(client, messages, tools=tools)
        first = reply.model_extra["rollout_bus"]
        assert "calculator" in gw.fmt.decode(first["input_token_ids"])
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": "call_1", "content": "84"})
        second = chat(client, messages, tools=tools).model_extra["rollout_bus"]
        assert "<|im_start|>tool\n84<|im_end|>" in gw.fmt.decode(second["input_token_ids"])
        t = trajectory(stored(gw, keys, "tools"))
        start = len(t.response_ids) - len(second["output_token_ids"]) - len(second["input_token_ids"])
        tool_span = t.loss_mask[start:start + len(second["input_token_ids"])]
        assert tool_span and set(tool_span) == {0}


def test_tools_refused_where_the_template_has_none(setup: tuple[GatewayThread, Keys]) -> None:
    gw, _ = setup
    assert not gw.fmt.supports_tools  # the plain ChatML template
    open_session(gw, "notools")
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client_for(gw, "notools"), [{"role": "user", "content": "hi"}],
             tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert caught.value.body["param"] == "tools" and "does not support tools" in caught.value.body["message"]


def test_any_gateway_serves_any_session(server: RedisServer, engines: list[EngineProcess], model_dir: Path) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    register(server.url, keys, [("e0", engines[0].url)])
    first = GatewayThread(server.url, keys, model_dir, engine_key=KEY, client_keys=CLIENT_KEYS)
    try:
        open_session(first, "roams")
        messages, _ = episode(client_for(first, "roams"), 1)
    finally:
        first.close()  # the first gateway goes away: nothing of the session was in it
    with GatewayThread(server.url, keys, model_dir, engine_key=KEY, client_keys=CLIENT_KEYS) as other:
        reply = chat(client_for(other, "roams"), messages + [{"role": "user", "content": "again"}])
        assert reply.model_extra["rollout_bus"]["turn"] == 1


# --- bad input -----------------------------------------------------------------------------------------

def test_bad_input_each_with_a_clear_error(setup: tuple[GatewayThread, Keys]) -> None:
    gw, keys = setup
    with pytest.raises(openai.NotFoundError) as caught:
        chat(client_for(gw, "nobody"), [{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "session_not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client_for(gw, "bad.id"), [{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "invalid_session_id" and "'.'" in caught.value.body["message"]
    with pytest.raises(openai.AuthenticationError) as caught:
        chat(client_for(gw, "x", key="wrong"), [{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "invalid_api_key"
    open_session(gw, "bad")
    client = client_for(gw, "bad")
    for messages, param in (([{"role": "robot", "content": "hi"}], "messages[0].role"),
                            ([{"role": "user"}], "messages[0].content"),
                            ([], "messages"),
                            ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]")):
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, messages)
        assert caught.value.body["param"] == param, caught.value.body
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, [{"role": "user", "content": "hi"}], n=2)
    assert caught.value.body["param"] == "n"
    # nothing was recorded by the refused calls
    assert stored(gw, keys, "bad")["position"] == 0
    # a closed session
    call(gw.url + "/sessions/bad/close", "POST", {"reward": 0.0}, headers={"Authorization": f"Bearer {CLIENT}"})
    with pytest.raises(openai.ConflictError) as caught:
        chat(client, [{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "session_closed"


def test_a_tool_reply_longer_than_the_context_ends_the_session(setup: tuple[GatewayThread, Keys]) -> None:
    gw, keys = setup
    open_session(gw, "overflow", max_context=200)
    client = client_for(gw, "overflow")
    messages, _ = episode(client, 1)
    messages.append({"role": "tool", "content": "x" * 400})
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, messages)
    assert caught.value.body["code"] == "context_length_exceeded"
    state = stored(gw, keys, "overflow")
    assert state["status"] == "overflow" and "context" in state["reason"] and state["position"] == 1
    closed = [e for e in events(gw, keys) if isinstance(e, SessionClosed)]
    assert closed[-1].session_id == "overflow" and closed[-1].status == "overflow"


def test_two_concurrent_calls_on_one_session(server: RedisServer, model_dir: Path) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    slow = EngineProcess(model_dir, token_delay_ms=40)
    try:
        register(server.url, keys, [("slow", slow.url)])
        with GatewayThread(server.url, keys, model_dir) as gw:
            open_session_plain(gw, "twice")
            client = openai.OpenAI(base_url=gw.session_url("twice"), api_key="none", max_retries=0)
            first: dict = {}

            def long_call() -> None:
                first["reply"] = chat(client, [{"role": "user", "content": "long"}], max_tokens=60,
                                      extra_body={"ignore_eos": True})

            thread = threading.Thread(target=long_call)
            thread.start()
            wait_until("the first call holds the session",
                       lambda: gw.client.exists(keys.session_busy("twice")) == 1)
            with pytest.raises(openai.ConflictError) as caught:
                chat(client, [{"role": "user", "content": "long"}])
            assert caught.value.body["code"] == "session_busy"
            thread.join(60)
            assert first["reply"].model_extra["rollout_bus"]["turn"] == 0
            assert SessionStore(gw.client, keys).get("twice")["position"] == 1  # type: ignore[index]
    finally:
        slow.stop()


def test_a_client_that_disconnects_aborts_the_engine_request(server: RedisServer, model_dir: Path) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    slow = EngineProcess(model_dir, token_delay_ms=50)
    try:
        register(server.url, keys, [("slow", slow.url)])
        with GatewayThread(server.url, keys, model_dir) as gw:
            open_session_plain(gw, "gone")

            def running() -> int:
                return int(call(slow.url + "/v1/loads")[1]["loads"][0]["num_running_reqs"])

            async def hang_up() -> None:
                import aiohttp

                async with aiohttp.ClientSession() as session:
                    task = asyncio.create_task(session.post(
                        gw.session_url("gone") + "/chat/completions",
                        json={"messages": [{"role": "user", "content": "long"}], "max_tokens": 400,
                              "ignore_eos": True}))
                    for _ in range(200):
                        if await asyncio.to_thread(running) == 1:
                            break
                        await asyncio.sleep(0.05)
                    assert await asyncio.to_thread(running) == 1  # the engine is generating for it
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task

            asyncio.run(hang_up())
            wait_until("the engine request is aborted", lambda: running() == 0, timeout_s=10)
            wait_until("the session is free again", lambda: gw.client.exists(keys.session_busy("gone")) == 0)
            state = SessionStore(gw.client, keys).get("gone")
            assert state is not None and state["position"] == 0  # the unanswered turn is not recorded
    finally:
        slow.stop()


def test_gateway_metrics_count_turns(setup: tuple[GatewayThread, Keys]) -> None:
    gw, _ = setup
    open_session(gw, "metered")
    episode(client_for(gw, "metered"), 2)
    from prometheus_client import generate_latest

    text = generate_latest(gw.gateway.metrics.registry).decode()
    assert 'rollout_bus_gateway_turns_total{source="engine"} 2.0' in text
    assert "rollout_bus_gateway_environment_seconds_count 1.0" in text
    _ = time


def test_a_turn_event_goes_out_only_with_its_commit(server: RedisServer) -> None:
    """The turn's event rides in the commit's script: a commit refused (its lock was broken by a takeover)
    appends nothing, one that goes through appends the event with its producer's sequence number."""
    from rollout_bus.events.publish import Publisher
    from rollout_bus.events.schema import Producer
    from rollout_bus.events.sessions import SessionConflict, new_state

    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    client = connect(server.url)
    try:
        store, publisher = SessionStore(client, keys), Publisher(client, keys, Producer("gateway", "t"))

        def turn_event(n: int) -> SessionTurn:
            return SessionTurn(producer=publisher.producer, policy="default", session_id="c1", turn=n,
                               engine_id="e0", new_tokens=1, output_tokens=1, cached_tokens=0, oldest_version=0,
                               newest_version=0, finish="stop", gen_ms=1.0, env_ms=0.0)

        assert store.create(new_state("c1", "default", max_context=64))
        held = store.begin("c1", "dead-attempt")
        store.unlock("c1")  # a retried job took the session over
        assert client.exists(keys.session_busy("c1")) == 0
        with pytest.raises(SessionConflict):
            store.commit(held, held.state, publish=publisher.prepared(keys.session_stream, turn_event(0)))
        assert client.xlen(keys.session_stream) == 0
        held = store.begin("c1", "new-attempt")
        first = turn_event(1)
        store.commit(held, {**held.state, "last_ms": 1}, publish=publisher.prepared(keys.session_stream, first))
        published = events_of(client, keys)
        assert [(e.event_id, e.turn, e.seq) for e in published] == [(first.event_id, 1, 1)]
        assert store.get("c1")["last_ms"] == 1  # type: ignore[index]
        assert client.exists(keys.session_busy("c1")) == 0  # the commit freed the lock
        publisher.publish(keys.session_stream, turn_event(2))  # the producer's numbering goes on from there
        assert [e.seq for e in events_of(client, keys)] == [1, 2]
    finally:
        client.close()


def events_of(client: object, keys: Keys) -> list:
    return [decode(fields) for _, fields in client.xrange(keys.session_stream)]  # type: ignore[attr-defined]
