"""Agents in executors: each sample is an episode run through the session gateway.

An executor started with ``--agent PATH`` runs the session gateway on its own event loop (on
127.0.0.1, a free port) and replaces its generate and reward plug-ins. That gateway reaches the engines
with the engines' key, and takes from clients one key only: a random one made when the executor starts
(tenant ``_executor``), given to its own agents' clients (and put in ``$ROLLOUT_BUS_GATEWAY_API_KEY``,
where verifiers reads it) and to no one else. Each sample opens a session
named after its request and index, runs ``async def episode(client, item) -> reward`` with an
``openai.AsyncOpenAI`` client already bound to the session's base URL, closes the session with the
reward, and becomes the session's trajectory (``gateway.tito.trajectory``): the first turn's prompt,
then every later token, trained where the engine made it.

A request with ``agent="external"`` (and an executor started with ``--agent external``, which then
needs no agent function) opens the sessions and offers them to external agents instead, which claim
them through any gateway (``POST /sessions/claim``) and close them with their reward; the executor waits
up to the request's ``agent_timeout_s`` and records a session not closed by then as abandoned.

Durable episodes: a session's id depends only on its request and sample index, so when an executor dies
mid-episode and rq retries the job, the retried episode reopens the same session. The agent runs again
from the start, and every call that matches the journal is answered from it, with the same tokens and
without the engine, until the first call that differs; a session the dead attempt had already closed is
used as it is, without running the agent again.

An agent that raises ends its session as ``failed`` with the exception, and its sample is left out of
training (loss mask 0); so is an abandoned one.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import xxhash

from rollout_bus.events.names import Keys
from rollout_bus.events.sessions import ABANDONED, CLOSED, FAILED, OPEN, OVERFLOW, UNKNOWN_VERSION
from rollout_bus.executor.errors import PluginError
from rollout_bus.executor.generate import GenerateContext
from rollout_bus.executor.plugins import load_callable
from rollout_bus.executor.sample import Sample, Status
from rollout_bus.gateway.chat import load_format
from rollout_bus.gateway.keys import EXECUTOR_TENANT, GATEWAY_API_KEY_ENV, ClientKeys
from rollout_bus.gateway.server import Running, make_gateway, serve
from rollout_bus.gateway.tito import model_versions, per_turn, trajectory, trajectory_digest

log = logging.getLogger(__name__)

EXTERNAL = "external"
REWARD_KEY = "episode_reward"
TURNS_KEY = "turn_samples"
TURN_STRIDE = 1024
"""Per-turn samples of sample ``i`` are numbered ``i * TURN_STRIDE + turn``."""


@dataclass
class AgentConfig:
    agent: str
    """Dotted path of ``async def episode(client, item) -> float``, or ``external``."""
    model_path: str | None = None
    """The served model's directory, for the chat template (None: the tiny LM's form)."""
    max_context: int | None = None
    host: str = "127.0.0.1"
    port: int = 0
    poll_s: float = 0.2
    per_turn: bool = False
    """One sample per turn (everything before the turn's reply is its prompt) instead of one per session."""


def session_id(request_id: str, index: int) -> str:
    """The session of sample ``index`` of a request: the same for every attempt of the request."""
    return f"s{xxhash.xxh3_64_hexdigest(request_id.encode())}-{index}"


class AgentRunner:
    """The executor's gateway and its agent; lives on the executor's event loop."""

    def __init__(self, config: AgentConfig, client: Any, keys: Keys, *, instance: str, engine_key: str | None) -> None:
        self.config = config
        self.client_keys = ClientKeys.executor()
        self.api_key = self.client_keys.keys[0].key
        """The agents' key to this gateway (never the engines')."""
        self.episode = None if config.agent == EXTERNAL else load_callable(config.agent, "agent episode",
                                                                              is_async=True)
        try:
            fmt = load_format(config.model_path, max_context=config.max_context)
        except Exception as exc:
            raise PluginError(f"agent: cannot load the chat template of {config.model_path!r}: {exc}") from None
        self.gateway = make_gateway(client, keys, fmt, instance=instance, engine_key=engine_key)
        self.running: Running | None = None
        self._http: Any = None

    async def start(self) -> Running:
        import httpx

        self.running = await serve(self.gateway, host=self.config.host, port=self.config.port,
                                   client_keys=self.client_keys)
        os.environ[GATEWAY_API_KEY_ENV] = self.api_key
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                       limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        log.info("agent gateway on %s", self.running.url)
        return self.running

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        if self.running is not None:
            await self.running.stop()

    def client(self, sid: str) -> Any:
        import openai

        assert self.running is not None
        return openai.AsyncOpenAI(base_url=self.running.session_url(sid), api_key=self.api_key,
                                  max_retries=0, http_client=self._http)

    # --- the executor's plug-ins ------------------------------------------------------------------
    async def generate(self, ctx: GenerateContext, sample: Sample) -> Sample:
        request = ctx.request
        sid = session_id(request.request_id, sample.index)
        item = {"index": sample.group_index, "prompt": sample.prompt, "label": sample.label,
                "metadata": dict(sample.metadata)}
        external = request.agent == EXTERNAL
        if not external and self.episode is None:
            raise PluginError("this executor runs no agent function (started with --agent external): send "
                              "requests with agent='external'")
        sampling = {k: v for k, v in ctx.sampling_params.items() if v is not None}
        state = await asyncio.to_thread(
            self.gateway.open, sid, request.policy, request_id=request.request_id, sample_index=sample.index,
            item=item, sampling=sampling, external=external, takeover=True,
            tenant="" if external else EXECUTOR_TENANT)
        started = time.monotonic()
        if state["status"] == OPEN:
            if external:
                await self._wait_external(sid, request.policy, request.agent_timeout_s)
            else:
                await self._run_episode(sid, item)
        state = await asyncio.to_thread(self.gateway.get, sid)
        fill_sample(sample, state, episode_s=time.monotonic() - started)
        if self.config.per_turn and not sample.remove_sample:
            sample.metadata[TURNS_KEY] = per_turn(state)
        return sample

    def reward(self, sample: Sample) -> float:
        return float(sample.metadata.get(REWARD_KEY) or 0.0)

    async def _run_episode(self, sid: str, item: dict[str, Any]) -> None:
        assert self.episode is not None
        client = self.client(sid)
        try:
            reward = self.episode(client, item)
            if inspect.isawaitable(reward):
                reward = await reward
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("agent episode of session %s raised %s: %s", sid, type(exc).__name__, exc)
            await asyncio.to_thread(self.gateway.close, sid, reward=None, status=FAILED,
                                    reason=f"the agent raised {type(exc).__name__}: {exc}"[:500])
            return
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            await asyncio.to_thread(self.gateway.close, sid, reward=None, status=FAILED,
                                    reason=f"the agent returned {reward!r}; an episode returns a finite reward")
            return
        await asyncio.to_thread(self.gateway.close, sid, reward=float(reward))

    async def _wait_external(self, sid: str, policy: str, timeout_s: float) -> None:
        await asyncio.to_thread(self.gateway.store.offer, policy, [sid])
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                state = await asyncio.to_thread(self.gateway.get, sid)
                if state["status"] != OPEN:
                    return
                await asyncio.sleep(self.config.poll_s)
            await asyncio.to_thread(self.gateway.store.withdraw, policy, [sid])
            await asyncio.to_thread(self.gateway.close, sid, reward=None, status=ABANDONED,
                                    reason=f"no external agent closed it within {timeout_s:g}s")
        except asyncio.CancelledError:
            await asyncio.shield(asyncio.to_thread(self.gateway.store.withdraw, policy, [sid]))
            raise


def split_turns(samples: list[Sample]) -> list[Sample]:
    """Samples whose episode asked for one sample per turn (``AgentConfig.per_turn``), split into them: each
    keeps the episode's reward and group; its prompt is everything before the turn's reply."""
    out: list[Sample] = []
    for s in samples:
        turns = s.metadata.pop(TURNS_KEY, None)
        if not turns:
            out.append(s)
            continue
        for k, t in enumerate(turns[:TURN_STRIDE]):
            meta = {key: value for key, value in s.metadata.items() if key != "digest"}  # the whole session's
            meta["turn"] = k
            out.append(Sample(group_index=s.group_index, index=s.index * TURN_STRIDE + k, prompt=s.prompt,
                              prompt_ids=t.prompt_ids, label=s.label, response_ids=t.response_ids,
                              rollout_log_probs=t.log_probs, loss_mask=t.loss_mask,
                              weight_versions=sorted({v for v in t.versions if v >= 0}), reward=s.reward,
                              status=s.status, metadata=meta))
    return out


def fill_sample(sample: Sample, state: dict[str, Any], *, episode_s: float = 0.0) -> Sample:
    """``sample`` as the session's trajectory, with the episode's reward and what happened in it."""
    t = trajectory(state)
    turns = state["turns"][: state["position"]]
    status = state["status"]
    if t.prompt_ids:
        sample.prompt_ids = t.prompt_ids
        sample.response_ids = t.response_ids
        sample.loss_mask = t.loss_mask
        sample.rollout_log_probs = t.log_probs
    sample.weight_versions = model_versions(state)
    unknown = sum(1 for turn in turns for v in turn["versions"] if v == UNKNOWN_VERSION)
    last_finish = turns[-1]["finish"] if turns else ""
    if status == CLOSED and turns:
        sample.status = Status.TRUNCATED if last_finish == "length" else Status.COMPLETED
    elif status == OVERFLOW and turns:
        sample.status = Status.TRUNCATED
    else:
        sample.status = Status.FAILED
        sample.remove_sample = True
    if not sample.response_ids:
        sample.remove_sample = True
    engines = sorted({turn["engine_id"] for turn in turns if turn["engine_id"]})
    sample.metadata.update({
        REWARD_KEY: float(state["reward"] or 0.0), "session_id": state["id"], "session_status": status,
        "session_reason": state["reason"], "turns": len(turns),
        "tool_calls": sum(len(turn["reply"].get("tool_calls") or []) for turn in turns),
        "generation_s": sum(float(turn["gen_ms"]) for turn in turns) / 1000,
        "environment_s": sum(float(turn["env_ms"]) for turn in turns) / 1000,
        "engine_switches": state["switches"], "engine_ids": engines, "engines": engines, "attempt": state["attempt"],
        "engine_calls": state["engine_calls"], "engine_tokens": state["engine_tokens"],
        "digest": trajectory_digest(t), "episode_s": round(episode_s, 3), "unknown_version_tokens": unknown,
    })
    return sample


__all__ = ["ABANDONED", "AgentConfig", "AgentRunner", "EXTERNAL", "fill_sample", "session_id"]
