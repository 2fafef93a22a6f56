"""A ``verifiers`` environment run unchanged through the session gateway: real redis-server, a real tiny-LM
engine process, the gateway's real HTTP server, the real ``openai`` client at a session's base URL, and
verifiers' own rollout (its interception server, its harness, its rubric)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.schema import SessionClosed, decode
from rollout_bus.events.sessions import SessionStore
from rollout_bus.gateway.keys import ClientKey, ClientKeys
from rollout_bus.gateway.tito import trajectory
from rollout_bus.launch.config import RunConfig
from rollout_bus.launch.job import run_job
from rollout_bus.tasks.guess import answer, first_number, score
from rollout_bus.tasks.verifiers_env import API_KEY_ENV, VerifiersSource, episode, make_env, rollout, task_of
from tests.engine_proc import EngineProcess, call
from tests.support.executor_procs import register_engines
from tests.support.gateway import GatewayThread

pytest.importorskip("verifiers")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

GAME = {"low": 1, "high": 16, "max_turns": 4, "seed": 0}
GAMES = 6
VF_KEY = "verifiers-agents-key-0123"
"""The verifiers agents' gateway key (read from $ROLLOUT_BUS_GATEWAY_API_KEY), never the engines'."""
VF_KEYS = ClientKeys([ClientKey("vf", VF_KEY)])


@pytest.fixture(scope="module")
def model(agent_model: Path) -> Path:
    return agent_model


@pytest.fixture()
def gateway_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, VF_KEY)


@pytest.fixture(scope="module")
def engine(agent_engine: EngineProcess) -> EngineProcess:
    return agent_engine


def open_session(gateway: GatewayThread, sid: str) -> openai.AsyncOpenAI:
    status, body = call(gateway.url + "/sessions", "POST", {"policy": "p", "session_id": sid},
                        headers={"Authorization": f"Bearer {VF_KEY}"})
    assert status == 200, body
    return openai.AsyncOpenAI(base_url=body["base_url"], api_key=VF_KEY, max_retries=0)


def replies(state: dict[str, Any]) -> list[str]:
    return [turn["reply"].get("content") or "" for turn in state["turns"][: state["position"]]]


def test_a_verifiers_environment_plays_its_games_through_sessions(redis_client: redis.Redis, redis_server: RedisServer,
                                                                  keys: Keys, engine: EngineProcess,
                                                                  model: Path, gateway_key: None) -> None:
    register_engines(redis_client, keys, {"e0": engine.url})
    source = VerifiersSource(**GAME)
    store = SessionStore(redis_client, keys)
    multi_turn = 0
    with GatewayThread(redis_server.url, keys, model, client_keys=VF_KEYS) as gateway:
        for index in range(GAMES):
            sid = f"vf-{index}"
            client = open_session(gateway, sid)
            item = source.item(index)
            env = make_env("guess", source.taskset)
            result = gateway.call(rollout(env, task_of(env, item), client))
            assert result.ok, [e.message for t in result.traces for e in t.errors]
            (trace,) = result.traces
            state = store.get(sid)
            assert state is not None and state["status"] == "open"
            # every model call of verifiers' rollout is a turn of the session, with the reply it got
            said = replies(state)
            assert [m.content or "" for m in trace.assistant_messages] == said
            assert state["engine_calls"] == len(said) >= 1
            # the environment answered each guess as tasks.guess does, and the rubric scores as it does
            secret = int(item["label"])
            guesses = [first_number(text) for text in said]
            for turn, guess in zip(state["turns"][1:state["position"]], guesses, strict=False):
                assert turn["messages"] == [{"role": "user", "content": answer(guess, secret)}]
            assert len(said) == GAME["max_turns"] or secret in guesses
            assert trace.reward == pytest.approx(score(guesses, secret, GAME["low"], GAME["high"]))
            assert set(trace.rewards) == {"won", "closeness"}
            # the session is the episode's sample: the environment's answers are untrained tokens
            t = trajectory(state)
            assert 1 in t.loss_mask
            if len(said) > 1:
                multi_turn += 1
                assert 0 in t.loss_mask
                first_env = t.loss_mask.index(0)
                assert t.log_probs[first_env] == 0.0 and t.versions[first_env] == -1
    assert multi_turn >= 1  # random weights rarely hit the number at once: most games take several turns


def test_the_agent_function_returns_the_rubrics_reward(redis_client: redis.Redis, redis_server: RedisServer,
                                                       keys: Keys, engine: EngineProcess, model: Path,
                                                       gateway_key: None) -> None:
    register_engines(redis_client, keys, {"e0": engine.url})
    source = VerifiersSource(**GAME)
    store = SessionStore(redis_client, keys)
    with GatewayThread(redis_server.url, keys, model, client_keys=VF_KEYS) as gateway:
        items = [source.item(index) for index in range(3)]
        clients = [open_session(gateway, f"ag-{i}") for i in range(3)]

        async def play() -> list[float]:  # three episodes at once on one loop, as an executor runs them
            return list(await asyncio.gather(*(episode(c, it) for c, it in zip(clients, items, strict=True))))

        rewards = gateway.call(play())
    for i, (item, reward) in enumerate(zip(items, rewards, strict=True)):
        state = store.get(f"ag-{i}")
        assert state is not None
        guesses = [first_number(text) for text in replies(state)]
        assert reward == pytest.approx(score(guesses, int(item["label"]), GAME["low"], GAME["high"]))


def test_a_run_trains_on_verifiers_episodes(tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis,
                                            keys: Keys) -> None:
    config = RunConfig(agent="verifiers-guess", steps=3, n_groups=2, n_samples=2, seed=0, out=str(tmp_path / "out"),
                       redis_url=redis_server.url, namespace=keys.namespace, progress=False, plot=False,
                       timeout_s=240.0)
    result = run_job(config)
    assert result.summaries["p0"]["steps"] == 3
    closed = [e for e in (decode(f) for _, f in page(redis_client, keys.session_stream))
              if isinstance(e, SessionClosed)]
    assert len(closed) >= 3 * 2 * 2  # every sample of every trained batch was an episode
    assert {e.status for e in closed} == {"closed"}  # no episode raised
    assert all(0.0 <= e.reward <= 1.0 for e in closed)
    store = SessionStore(redis_client, keys)
    for event in closed:  # each session played a verifiers task, and was scored by its rubric
        state = store.get(event.session_id)
        assert state is not None and state["item"]["metadata"]["env"] == "guess"
        secret = int(state["item"]["metadata"]["task"]["secret"])
        guesses = [first_number(text) for text in replies(state)]
        assert event.reward == pytest.approx(score(guesses, secret, GAME["low"], GAME["high"]))
