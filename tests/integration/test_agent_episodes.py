"""Agent episodes in executors: real redis-server, real engine and executor processes, the executor's
in-process session gateway, and for external agents a gateway of its own and the real ``openai`` client."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis

from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.rollouts import RolloutRequest, SamplingParams
from rollout_bus.events.schema import SessionClosed, SessionTurn
from rollout_bus.events.sessions import SessionStore
from rollout_bus.events.submit import RolloutSubmitter
from rollout_bus.executor.agents import session_id
from rollout_bus.gateway.keys import ClientKey, ClientKeys
from rollout_bus.gateway.tito import digest, trajectory
from rollout_bus.replay.exporter import export_log
from rollout_bus.replay.logfile import LogReader, decode_entries, only_entries
from rollout_bus.replay.payloads import payload_store
from rollout_bus.replay.picture import picture
from rollout_bus.replay.picture_html import render_html
from rollout_bus.replay.picture_png import write_png
from rollout_bus.replay.timeline import render, timeline
from rollout_bus.replay.verify import verify_log
from tests.engine_proc import EngineProcess, call
from tests.support.executor_procs import (
    ExecutorProcess,
    batch_ready,
    events,
    jobs_done,
    register_engines,
    rollout_events,
    train_data,
)
from tests.support.gateway import GatewayThread
from tests.support.procs import wait_for

pytestmark = pytest.mark.timeout(300)

AGENTS_KEY = "external-agents-key-0123"
SAMPLING = SamplingParams(max_new_tokens=8, temperature=1.0)
GUESS = ("--data-source", "rollout_bus.tasks.guess.GuessSource", "--data-source-args",
         '{"low": 1, "high": 16, "max_turns": 3}')


@pytest.fixture(scope="module")
def model(agent_model: Path) -> Path:
    return agent_model


@pytest.fixture(scope="module")
def engine(agent_engine: EngineProcess) -> EngineProcess:
    return agent_engine


def agent_args(model: Path, agent: str, *extra: str) -> list[str]:
    return ["--agent", agent, "--agent-model-path", str(model), *extra]


@pytest.fixture()
def executors() -> Iterator[list[ExecutorProcess]]:
    started: list[ExecutorProcess] = []
    yield started
    for proc in started:
        proc.kill()


def export(client: redis.Redis, keys: Keys, path: Path) -> Path:
    """The namespace's event log with its batch payloads, as `rollout-bus replay export` writes it."""
    store = payload_store(client, keys)
    try:
        export_log(client, keys, path, payloads=store)
    finally:
        store.close()
    return path


def sessions_closed(client: redis.Redis, keys: Keys) -> list[SessionClosed]:
    return [e for e in events(client, keys.session_stream) if isinstance(e, SessionClosed)]


def test_an_agent_run_makes_one_sample_per_episode(redis_server: RedisServer, redis_client: redis.Redis,
                                                   keys: Keys, engine: EngineProcess, model: Path,
                                                   executors: list[ExecutorProcess], tmp_path: Path) -> None:
    register_engines(redis_client, keys, {"e0": engine.url})
    request = RolloutRequest.create("p", 0, 2, 2, sampling=SAMPLING, timeout_s=120)
    RolloutSubmitter(redis_client, keys).submit(request)
    executors.append(ExecutorProcess(redis_server.url, keys.namespace, 0,
                                     agent_args(model, "rollout_bus.tasks.guess.episode", *GUESS)))
    wait_for("the batch", lambda: jobs_done(redis_client, [request.request_id]), timeout_s=120)
    (ready,) = batch_ready(redis_client, keys)
    data = train_data(redis_client, keys, ready)
    assert len(data) == 4
    closed = {e.session_id: e for e in sessions_closed(redis_client, keys)}
    assert len(closed) == 4 and {e.status for e in closed.values()} == {"closed"}
    sessions = data.metadata["sessions"]
    store = SessionStore(redis_client, keys)
    for view, record in zip(data.samples(), sessions, strict=True):
        sid = record["session_id"]
        assert sid == session_id(request.request_id, record["index"])
        ids = [int(t) for t in view.tokens]
        mask = [0] * int(view.prompt_length) + [int(m) for m in view.loss_mask]
        # the sample is the session's journal, token for token
        assert digest(ids, mask) == closed[sid].digest == record["digest"]
        t = trajectory(store.get(sid))  # type: ignore[arg-type]
        assert t.prompt_ids + t.response_ids == ids
        # the environment's answers are in the sample, untrained
        if record["turns"] > 1:
            assert 0 in [int(m) for m in view.loss_mask] and 1 in [int(m) for m in view.loss_mask]
        assert float(data.raw_reward[record["index"] - data.sample_indices.min().item()]) == pytest.approx(closed[sid].reward)
    metrics = rollout_events(redis_client, keys, "RolloutCompleted")[0].metrics
    assert metrics["turns_mean"] >= 1 and "environment_s" in metrics
    # the log replays: the timeline draws every session and its turns, verify finds each sample is its journal
    log_path = export(redis_client, keys, tmp_path / "run.rblog")
    assert verify_log(log_path) == []
    with LogReader(log_path) as reader:
        text = render(timeline(decode_entries(only_entries(reader))), max_batches=0)
    assert "SESSIONS (closed=4" in text and all(sid in text for sid in closed)
    with LogReader(log_path) as reader:  # and the picture marks every turn and every ending
        pic = picture(reader.entries())
    assert len(pic.turns) == sum(r["turns"] for r in sessions) and len(pic.sessions_closed) == 4
    html = render_html(pic)
    assert html.count('class="turn"') == len(pic.turns) and html.count('class="session-end"') == 4
    assert write_png(pic, tmp_path / "run.png").stat().st_size > 0
    # a sample that is not its journal is caught: the session closes again with another digest
    forged = dataclasses.replace(next(iter(closed.values())), digest="0" * 16, event_id=uuid.uuid4().hex, seq=0)
    Publisher(redis_client, keys, forged.producer).publish(keys.session_stream, forged)
    problems = verify_log(export(redis_client, keys, tmp_path / "forged.rblog"))
    assert [p.kind for p in problems] == ["session_mismatch"] and forged.session_id in problems[0].message


def test_an_agent_that_raises_fails_its_session_not_the_batch(redis_server: RedisServer, redis_client: redis.Redis,
                                                              keys: Keys, engine: EngineProcess, model: Path,
                                                              executors: list[ExecutorProcess]) -> None:
    register_engines(redis_client, keys, {"e0": engine.url})
    request = RolloutRequest.create("p", 0, 1, 2, sampling=SAMPLING, timeout_s=120)
    RolloutSubmitter(redis_client, keys).submit(request)
    executors.append(ExecutorProcess(redis_server.url, keys.namespace, 0,
                                     agent_args(model, "tests.support.executor_plugins.raising_episode")))
    wait_for("the batch", lambda: jobs_done(redis_client, [request.request_id]), timeout_s=120)
    closed = sessions_closed(redis_client, keys)
    assert len(closed) == 2 and {e.status for e in closed} == {"failed"}
    assert all("RuntimeError: the sandbox fell over" in e.reason for e in closed)
    (ready,) = batch_ready(redis_client, keys)
    data = train_data(redis_client, keys, ready)
    assert all(int(v.loss_mask.sum()) == 0 for v in data.samples())  # recorded, never trained


def test_a_durable_episode_resumes_from_its_journal(redis_server: RedisServer, redis_client: redis.Redis,
                                                   keys: Keys, engine: EngineProcess, model: Path,
                                                   executors: list[ExecutorProcess]) -> None:
    register_engines(redis_client, keys, {"e0": engine.url})
    request = RolloutRequest.create("p", 0, 1, 1, sampling=SAMPLING, timeout_s=180)
    RolloutSubmitter(redis_client, keys).submit(request)
    sid = session_id(request.request_id, 0)
    agent = agent_args(model, "tests.support.executor_plugins.steady_episode")
    executors.append(ExecutorProcess(redis_server.url, keys.namespace, 0, agent))

    def turns_seen() -> list[SessionTurn]:
        return [e for e in events(redis_client, keys.session_stream)
                if isinstance(e, SessionTurn) and e.session_id == sid]

    wait_for("turn 3 of the episode", lambda: len(turns_seen()) >= 3, timeout_s=120, every_s=0.01)
    executors[0].kill()
    assert executors[0].proc.returncode is not None  # the executor is dead mid-episode
    store = SessionStore(redis_client, keys)
    before = store.get(sid)
    assert before is not None and before["status"] == "open" and 3 <= before["position"] < 6
    k = before["position"]
    executors.append(ExecutorProcess(redis_server.url, keys.namespace, 1, agent))
    wait_for("the retried job's batch", lambda: jobs_done(redis_client, [request.request_id]), timeout_s=120)
    after = store.get(sid)
    assert after is not None and after["status"] == "closed" and after["attempt"] == 2 and after["position"] == 6
    seen = turns_seen()
    replayed = [e.turn for e in seen if e.from_journal]
    assert replayed == list(range(k))  # every journaled turn answered from the journal...
    assert after["engine_calls"] == 6  # ...and the engine made each turn once
    assert [e.turn for e in seen if not e.from_journal] == list(range(6))
    (ready,) = batch_ready(redis_client, keys)  # exactly one sample
    data = train_data(redis_client, keys, ready)
    assert len(data) == 1
    (view,) = list(data.samples())
    t = trajectory(after)
    assert [int(x) for x in view.tokens] == t.prompt_ids + t.response_ids
    assert [e.attempt for e in rollout_events(redis_client, keys, "RolloutStarted")] == [1, 2]


def test_external_agents_claim_sessions_and_abandoned_ones_are_recorded(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys, engine: EngineProcess, model: Path,
        executors: list[ExecutorProcess]) -> None:
    register_engines(redis_client, keys, {"e0": engine.url})
    request = RolloutRequest.create("p", 0, 1, 3, sampling=SAMPLING, timeout_s=120, agent="external",
                                    agent_timeout_s=4.0)
    RolloutSubmitter(redis_client, keys).submit(request)
    executors.append(ExecutorProcess(redis_server.url, keys.namespace, 0, agent_args(model, "external")))
    claimed: list[str] = []
    agents = ClientKeys([ClientKey("agents", AGENTS_KEY, frozenset({"p"}))])
    auth = {"Authorization": f"Bearer {AGENTS_KEY}"}
    with GatewayThread(redis_server.url, keys, model, client_keys=agents) as gateway:  # `rollout-bus gateway`
        def agent() -> None:
            while len(claimed) < 2:
                status, body = call(gateway.url + "/sessions/claim", "POST", {"policy": "p"}, headers=auth)
                assert status == 200
                session = body["session"]
                if session is None:
                    time.sleep(0.05)
                    continue
                claimed.append(session["id"])
                client = openai.OpenAI(base_url=session["base_url"], api_key=AGENTS_KEY, max_retries=0)
                messages = [{"role": "user", "content": session["item"]["prompt"]}]
                reply = client.chat.completions.create(model="p", messages=messages, max_tokens=4)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                             {"role": "user", "content": "higher."}]
                client.chat.completions.create(model="p", messages=messages, max_tokens=4)
                call(gateway.url + f"/sessions/{session['id']}/close", "POST", {"reward": 0.25}, headers=auth)

        thread = threading.Thread(target=agent)
        thread.start()
        thread.join(120)
        wait_for("the batch", lambda: jobs_done(redis_client, [request.request_id]), timeout_s=60)
    closed = {e.session_id: e for e in sessions_closed(redis_client, keys)}
    assert sorted(e.status for e in closed.values()) == ["abandoned", "closed", "closed"]
    abandoned = next(e for e in closed.values() if e.status == "abandoned")
    assert abandoned.session_id not in claimed and "within 4s" in abandoned.reason
    (ready,) = batch_ready(redis_client, keys)
    data = train_data(redis_client, keys, ready)
    trained = sorted(int(v.loss_mask.sum()) > 0 for v in data.samples())
    assert trained == [False, True, True]
    assert sorted(float(r) for r in data.raw_reward) == [0.0, 0.25, 0.25]
