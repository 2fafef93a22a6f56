"""A session's turns on the gateway's fast path and off it: served by one gateway (its kept state used), moved
to a second gateway, back to the first (its kept state stale), to a restarted gateway, and taken over by a
retried episode; every turn's tokens are what a full render of the recorded session gives. Real
redis-server, a stub engine process answering in SGLang's shape, the gateways' real HTTP servers."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.sessions import SessionStore
from rollout_bus.gateway import tito
from rollout_bus.gateway.chat import HFChat
from tests.engine_proc import call, wait_until
from tests.support.gateway import GatewayThread, register
from tests.support.models import llama_dir

pytestmark = pytest.mark.timeout(300)

STUB = """
import json, sys
from aiohttp import web
ids = json.loads(sys.argv[2])
async def generate(request):
    body = await request.json()
    out = ids[: 3 + len(body["input_ids"]) % (len(ids) - 3)] + ids[-1:]  # replies of several lengths
    return web.json_response({"text": "", "output_ids": out, "meta_info": {
        "id": "x", "finish_reason": {"type": "stop", "matched": out[-1]}, "prompt_tokens": len(body["input_ids"]),
        "completion_tokens": len(out), "cached_tokens": 0, "weight_version": "0",
        "output_token_logprobs": [[-0.5, t, None] for t in out]}})
app = web.Application()
app.router.add_post("/generate", generate)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama_dir(tmp_path_factory.mktemp("llama") / "v0", seed=3)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    s = RedisServer().start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine_url(model_dir: Path) -> Iterator[str]:
    fmt = HFChat(str(model_dir))
    reply = fmt.encode("Sure: the next step, then the one after it.") + list(fmt.stop_token_ids[:1])
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-c", STUB, str(port), json.dumps(reply)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until("the stub engine answers", lambda: _answers(url))
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _answers(url: str) -> bool:
    try:
        return call(url + "/generate", "POST", {"input_ids": [1, 2, 3]})[0] == 200
    except OSError:
        return False


class Counting:
    """Counts the memos built from a state read whole (``tito.Memo.of``): a call off the fast path."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = tito.Memo.of.__func__  # type: ignore[attr-defined]

        def of(cls: type[tito.Memo], state: Any) -> tito.Memo | None:
            self.count += 1
            return original(cls, state)  # type: ignore[no-any-return]

        monkeypatch.setattr(tito.Memo, "of", classmethod(of))

    def taken(self) -> int:
        n, self.count = self.count, 0
        return n


def turn(gw: GatewayThread, sid: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    status, body = call(gw.session_url(sid) + "/chat/completions", "POST",
                        {"messages": messages, "max_tokens": 32, "temperature": 1.0})
    assert status == 200, body
    messages.append(body["choices"][0]["message"])
    return dict(body["rollout_bus"])


def full_path_ids(fmt: HFChat, state: dict[str, Any], bodies: list[list[dict[str, Any]]]) -> list[list[int]]:
    """Each turn's appended ids as a full render of the recorded session before it gives them (no memo)."""
    out = []
    for k, messages in enumerate(bodies):
        before = {**state, "turns": state["turns"][:k], "position": k}
        plan = tito.plan_chat(fmt, before, messages, tools=None, digest=state["turns"][k]["params"])
        out.append(plan.new_ids)
    return out


def test_a_session_moved_between_gateways_keeps_the_full_renders_tokens(
        server: RedisServer, engine_url: str, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    register(server.url, keys, [("e0", engine_url)])
    counting = Counting(monkeypatch)
    sid = "moves"
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be terse"}]
    bodies: list[list[dict[str, Any]]] = []
    parts: list[dict[str, Any]] = []
    slow: list[int] = []

    def next_turn(gw: GatewayThread, k: int) -> None:
        messages.append({"role": "user", "content": f"turn {k}: what now?"})
        bodies.append(list(messages))
        parts.append(turn(gw, sid, messages))
        slow.append(counting.taken())

    first = GatewayThread(server.url, keys, model_dir)
    second = GatewayThread(server.url, keys, model_dir)
    try:
        call(first.url + "/sessions", "POST", {"session_id": sid})
        next_turn(first, 0)
        next_turn(first, 1)  # the first gateway's kept state
        next_turn(second, 2)  # another gateway: reads the session whole
        next_turn(first, 3)  # back: the kept state is stale (the second wrote since), read whole
        next_turn(first, 4)
    finally:
        second.close()
        first.close()
    with GatewayThread(server.url, keys, model_dir) as restarted:  # nothing kept
        next_turn(restarted, 5)
        next_turn(restarted, 6)
        state = SessionStore(restarted.client, keys).get(sid)
    assert slow == [1, 0, 1, 1, 0, 1, 0]
    assert state is not None and state["position"] == 7
    assert [p["input_token_ids"] for p in parts] == [t["new_ids"] for t in state["turns"]]
    assert full_path_ids(restarted.fmt, state, bodies) == [t["new_ids"] for t in state["turns"]]  # type: ignore[arg-type]
    assert len({len(p["output_token_ids"]) for p in parts}) > 1  # replies of several lengths were appended


def test_a_taken_over_session_replays_its_journal_then_goes_on_with_the_same_tokens(
        server: RedisServer, engine_url: str, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    register(server.url, keys, [("e0", engine_url)])
    counting = Counting(monkeypatch)
    sid = "retried"
    with GatewayThread(server.url, keys, model_dir) as gw:
        gw.gateway.open(sid, "default")
        first_try: list[dict[str, Any]] = []
        for k in range(3):
            first_try.append({"role": "user", "content": f"step {k}"})
            turn(gw, sid, first_try)
        assert sid in gw.gateway.kept
        gw.gateway.open(sid, "default", takeover=True)  # the retried job: the journal replays from turn 0
        assert sid not in gw.gateway.kept
        counting.taken()
        again: list[dict[str, Any]] = []
        bodies: list[list[dict[str, Any]]] = []
        journal: list[bool] = []
        slow: list[int] = []
        for k in range(5):
            again.append({"role": "user", "content": f"step {k}" + (", after the retry" if k >= 3 else "")})
            bodies.append(list(again))
            journal.append(turn(gw, sid, again)["from_journal"])
            slow.append(counting.taken())
        state = SessionStore(gw.client, keys).get(sid)
    assert journal == [True, True, True, False, False]
    assert slow == [1, 1, 1, 1, 0]  # journal answers are not kept; the turn after the first new one is
    assert state is not None and state["position"] == 5 and state["attempt"] == 2
    assert full_path_ids(gw.fmt, state, bodies) == [t["new_ids"] for t in state["turns"]]  # type: ignore[arg-type]


def test_a_call_on_a_locked_session_is_refused_even_with_a_kept_state(
        server: RedisServer, engine_url: str, model_dir: Path) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    register(server.url, keys, [("e0", engine_url)])
    sid = "locked"
    with GatewayThread(server.url, keys, model_dir) as gw:
        gw.gateway.open(sid, "default")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "first"}]
        turn(gw, sid, messages)
        assert sid in gw.gateway.kept
        assert gw.client.set(keys.session_busy(sid), "another-call", px=60_000)  # another gateway's call runs
        messages.append({"role": "user", "content": "second"})
        status, body = call(gw.session_url(sid) + "/chat/completions", "POST",
                            {"messages": messages, "max_tokens": 32, "temperature": 1.0})
        assert status == 409 and body["error"]["code"] == "session_busy"
        assert gw.client.get(keys.session_busy(sid)) == b"another-call"  # its lock untouched
        assert SessionStore(gw.client, keys).get(sid)["position"] == 1  # type: ignore[index]
        gw.client.delete(keys.session_busy(sid))
        assert turn(gw, sid, messages)["turn"] == 1
        state = SessionStore(gw.client, keys).get(sid)
    assert state is not None and state["position"] == 2
    assert full_path_ids(gw.fmt, state, [messages[:1], messages[:3]]) == [t["new_ids"] for t in state["turns"]]  # type: ignore[arg-type]
