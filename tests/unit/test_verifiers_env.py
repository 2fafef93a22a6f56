"""The verifiers adapter against a scripted OpenAI endpoint (a real HTTP server on loopback): the environment's
turn loop, its rubric, the source's items and the errors, without a model."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import openai
import pytest
from aiohttp import web

from rollout_bus.tasks.guess import CLOSENESS_CREDIT, GuessSource, answer, score
from rollout_bus.tasks.verifiers_env import (
    VerifiersSource,
    episode,
    make_env,
    model_context,
    rollout,
    task_of,
)

pytest.importorskip("verifiers")

GAME = {"low": 1, "high": 16, "max_turns": 4, "seed": 0}

Script = Callable[[list[dict[str, Any]]], str]


class Endpoint:
    """``/v1/chat/completions`` answering each call with ``script(messages)``; keeps every request body."""

    def __init__(self, script: Script, status: int = 200) -> None:
        self.script = script
        self.status = status
        self.bodies: list[dict[str, Any]] = []
        self.url = ""

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if self.status != 200:
            return web.json_response({"error": {"message": "the engine fell over", "type": "server_error"}},
                                     status=self.status)
        text = self.script(body["messages"])
        return web.json_response({
            "id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    async def __aenter__(self) -> Endpoint:
        app = web.Application()
        app.router.add_post("/sessions/s0/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/sessions/s0/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url, api_key="none", max_retries=0)


def guesses_in_order(*texts: str) -> Script:
    def script(messages: list[dict[str, Any]]) -> str:
        return texts[sum(1 for m in messages if m["role"] == "assistant")]

    return script


def play(script: Script, index: int, status: int = 200) -> tuple[Any, Endpoint, dict[str, Any]]:
    item = VerifiersSource(**GAME).item(index)

    async def go() -> tuple[Any, Endpoint]:
        async with Endpoint(script, status) as endpoint:
            env = make_env("guess", dict(item["metadata"]["taskset"]))
            return await rollout(env, task_of(env, item), endpoint.client()), endpoint

    result, endpoint = asyncio.run(go())
    return result, endpoint, item


def test_the_source_serves_the_games_of_tasks_guess() -> None:
    source, plain = VerifiersSource(**GAME), GuessSource(**GAME)
    for index in range(5):
        item, want = source.item(index), plain.item(index)
        assert (item["label"], item["prompt"]) == (want["label"], want["prompt"])
        assert item["metadata"]["task"]["secret"] == want["label"]
    assert source.get_samples(2)[1]["index"] == 1


@pytest.mark.parametrize(("options", "fix"), [({"low": 5, "high": 5}, "low < high"),
                                              ({"max_turns": 0}, "max_turns"),
                                              ({"env": "chess"}, "choose one of ['guess']")])
def test_bad_source_options_say_what_to_fix(options: dict[str, Any], fix: str) -> None:
    with pytest.raises(ValueError, match=fix.replace("[", r"\[").replace("]", r"\]")):
        VerifiersSource(**{**GAME, **options})


def test_a_win_pays_one_and_the_environment_answers_each_guess() -> None:
    secret = VerifiersSource(**GAME).item(0)["label"]
    low_guess = 1 if secret != 1 else 2
    result, endpoint, item = play(guesses_in_order("no idea", str(low_guess), str(secret), "unused"), 0)
    assert result.ok
    (trace,) = result.traces
    assert trace.reward == 1.0 == score([None, low_guess, secret], secret, 1, 16)
    assert len(endpoint.bodies) == 3  # the game ends at the win
    sent = [body["messages"][-1]["content"] for body in endpoint.bodies]
    assert sent[0] == item["prompt"]
    assert sent[1:] == [answer(None, secret), answer(low_guess, secret)]
    assert all(body["model"] == "policy" and body["max_tokens"] == 8 for body in endpoint.bodies)


def test_a_lost_game_pays_at_most_the_closeness_credit() -> None:
    secret = VerifiersSource(**GAME).item(1)["label"]
    near = secret + 1 if secret < 16 else secret - 1
    far = 16 if secret < 8 else 1
    result, endpoint, _ = play(guesses_in_order(str(far), str(far), str(far), str(near)), 1)
    (trace,) = result.traces
    assert len(endpoint.bodies) == GAME["max_turns"]
    assert trace.rewards["won"].score == 0.0  # type: ignore[union-attr]
    assert trace.reward == pytest.approx(score([far, far, far, near], secret, 1, 16))
    assert 0.0 < trace.reward <= CLOSENESS_CREDIT
    silent, _, _ = play(guesses_in_order("", "x", "y", "z"), 1)
    assert silent.traces[0].reward == 0.0


def test_the_agent_raises_when_the_endpoint_fails() -> None:
    item = VerifiersSource(**GAME).item(0)

    async def go() -> float:
        async with Endpoint(guesses_in_order("1"), status=500) as endpoint:
            return await episode(endpoint.client(), item)

    with pytest.raises(RuntimeError, match="the verifiers episode failed: .*500"):
        asyncio.run(go())


def test_an_item_without_its_task_is_refused() -> None:
    item = VerifiersSource(**GAME).item(0)
    env = make_env("guess", dict(item["metadata"]["taskset"]))
    broken = {**item, "metadata": {**item["metadata"], "task": {"prompt": "guess", "low": 1}}}
    with pytest.raises(ValueError, match="secret"):
        task_of(env, broken)
    with pytest.raises(ValueError, match="extra"):
        make_env("guess", {**dict(item["metadata"]["taskset"]), "colour": "red"})


def test_a_keyed_client_needs_the_key_where_verifiers_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:1/sessions/s0/v1", api_key="k1", max_retries=0)
    monkeypatch.delenv("ROLLOUT_BUS_GATEWAY_API_KEY", raising=False)
    with pytest.raises(ValueError, match="ROLLOUT_BUS_GATEWAY_API_KEY"):
        model_context(client)
    monkeypatch.setenv("ROLLOUT_BUS_GATEWAY_API_KEY", "k1")
    ctx = model_context(client)
    assert ctx.client.base_url == "http://127.0.0.1:1/sessions/s0/v1" and ctx.model == "policy"


def test_without_verifiers_the_tasks_import_and_the_error_says_how_to_install() -> None:
    code = ("import sys; sys.modules['verifiers'] = None\n"
            "import rollout_bus.tasks.guess, rollout_bus.tasks.verifiers_env as v\n"
            "try:\n    v.VerifiersSource()\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "pip install -e '.[agents]'" in out.stdout



def test_another_verifiers_release_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import verifiers

    monkeypatch.setattr(verifiers, "__version__", "0.1.9")
    with pytest.raises(ImportError, match=r"written for verifiers 0\.4\.x.*installed 0\.1\.9"):
        make_env("guess", {})
