"""The session gateway's work, without HTTP: open, serve a turn, close, claim.

Every call reads the session from the bus under its lock, works, and commits the new state in one
script (``events.sessions``); the gateway keeps no session in memory, so any instance serves any
session. Each turn publishes ``SessionTurn`` (in the same script as its commit: one round trip) and each
ending ``SessionClosed`` on the sessions stream.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout_bus.engine.http_client import EngineHTTPError
from rollout_bus.events.names import name_problem
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import SessionClosed, SessionStarted, SessionTurn
from rollout_bus.events.sessions import (
    CLOSED,
    FAILED,
    OPEN,
    OVERFLOW,
    STATUSES,
    Held,
    SessionError,
    SessionNotFound,
    SessionStore,
    new_state,
)
from rollout_bus.gateway.chat import ChatError, ChatFormat, canonical, check_tools, parse_tool_calls
from rollout_bus.gateway.engines import NoEngine, Pinner, TurnOutput
from rollout_bus.gateway.metrics import GatewayMetrics
from rollout_bus.gateway.tito import (
    CHAT,
    ContextOverflow,
    Plan,
    apply_turn,
    model_versions,
    params_digest,
    plan_chat,
    plan_completion,
    replay_journal,
    trajectory,
    trajectory_digest,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "stop", "seed", "frequency_penalty",
                  "presence_penalty", "ignore_eos")


@dataclass
class TurnReply:
    """A served turn, for the HTTP layer to shape."""

    session: dict[str, Any]
    turn: dict[str, Any]
    plan: Plan
    from_journal: bool
    usage: dict[str, int] = field(default_factory=dict)


def sampling_from_request(body: Mapping[str, Any], defaults: Mapping[str, Any], room: int) -> dict[str, Any]:
    """SGLang sampling parameters from an OpenAI request, over the session's defaults; ``room`` is the
    context left, which caps ``max_tokens``."""
    params: dict[str, Any] = {k: v for k, v in defaults.items() if k != "max_new_tokens"}
    want = body.get("max_completion_tokens", body.get("max_tokens"))
    if want is None:
        want = defaults.get("max_new_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(want, bool) or not isinstance(want, int) or want <= 0:
        raise ChatError(f"max_tokens must be a positive integer, got {want!r}", param="max_tokens")
    n = body.get("n", 1)
    if n != 1:
        raise ChatError(f"n must be 1: a session is one trajectory (open one session per sample), got {n!r}",
                        param="n")
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise ChatError("ignore_eos must be true or false", param="ignore_eos")
        params["ignore_eos"] = ignore_eos
    for key in _SAMPLING_KEYS:
        value = body.get(key)
        if value is None or key == "ignore_eos":
            continue
        if key == "seed":
            params["sampling_seed"] = value
        elif key == "stop":
            params["stop"] = value
        else:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ChatError(f"{key} must be a number, got {value!r}", param=key)
            params[key] = value
    params["max_new_tokens"] = max(1, min(int(want), room))
    return params


class Gateway:
    def __init__(self, store: SessionStore, publisher: Publisher, pinner: Pinner, fmt: ChatFormat, *,
                 metrics: GatewayMetrics | None = None, instance: str | None = None) -> None:
        self.store = store
        self.publisher = publisher
        self.pinner = pinner
        self.fmt = fmt
        self.metrics = metrics or GatewayMetrics()
        self.instance = instance or f"{os.uname().nodename}-{os.getpid()}"
        self.keys = store.keys

    # --- sessions --------------------------------------------------------------------------------
    def open(self, sid: str, policy: str, *, request_id: str = "", sample_index: int = -1,
             item: Mapping[str, Any] | None = None, sampling: Mapping[str, Any] | None = None,
             max_context: int | None = None, external: bool = False, takeover: bool = False,
             tenant: str | None = None) -> dict[str, Any]:
        """Open session ``sid``, or reopen it for a new attempt of its episode (its journal kept, replayed
        from the first turn). A session already ended is returned as it is. ``takeover``: the caller owns
        the episode (its executor's job was retried), so a call lock left by the dead attempt is broken.
        ``tenant``: the client key's tenant the new session is bound to; a session of another tenant is
        not found (None: a caller that sees every session, as a gateway without client keys)."""
        state = new_state(sid, policy, max_context=max_context or self.fmt.max_context, request_id=request_id,
                          sample_index=sample_index, item=item, sampling=sampling)
        if self.store.create(state, tenant=tenant or ""):
            self.metrics.sessions_opened.inc()
            self._publish_started(state, external)
            return state
        token = uuid.uuid4().hex
        if takeover:
            self.store.unlock(sid)

        def reopen(current: dict[str, Any]) -> dict[str, Any]:
            if current["policy"] != policy:
                raise SessionError(f"session {sid!r} belongs to policy {current['policy']!r}, not {policy!r}",
                                   code="session_conflict", status=409)
            if current["status"] != OPEN:
                return current
            current["attempt"] += 1
            current["position"] = 0
            current["last_ms"] = 0
            return current

        state = self.store.update(sid, token, reopen, tenant=tenant)
        if state["status"] == OPEN:
            self.metrics.sessions_opened.inc()
            self._publish_started(state, external)
        return state

    def _publish_started(self, state: Mapping[str, Any], external: bool) -> None:
        self.publisher.publish(self.keys.session_stream, SessionStarted(
            producer=self.publisher.producer, policy=state["policy"], session_id=state["id"],
            request_id=state["request_id"], attempt=state["attempt"], external=external))

    def get(self, sid: str, *, tenant: str | None = None) -> dict[str, Any]:
        """The session's state; ``SessionNotFound`` when there is none, or it is another tenant's."""
        _check_sid(sid)
        state = self.store.get(sid, tenant=tenant)
        if state is None:
            raise SessionNotFound(sid)
        return state

    def close(self, sid: str, *, reward: float | None, status: str = CLOSED, reason: str = "",
              tenant: str | None = None) -> dict[str, Any]:
        """End an open session with its reward (an ended one is returned unchanged)."""
        _check_sid(sid)
        if status not in STATUSES or status == OPEN:
            raise ChatError(f"status must be one of {', '.join(s for s in STATUSES if s != OPEN)}", param="status")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)
                                   or reward != reward or abs(reward) == float("inf")):
            raise ChatError(f"reward must be a finite number, got {reward!r}", param="reward")
        ended: list[bool] = []

        def end(state: dict[str, Any]) -> dict[str, Any]:
            if state["status"] != OPEN:
                return state
            ended.append(True)
            return _ended(state, status, reason, reward)

        state = self.store.update(sid, uuid.uuid4().hex, end, tenant=tenant)
        if ended:
            self._publish_closed(state)
        return state

    def _publish_closed(self, state: Mapping[str, Any]) -> None:
        t = trajectory(state)
        versions = model_versions(state)
        n_turns = state["position"]
        self.metrics.sessions_closed.labels(state["status"]).inc()
        self.metrics.turns_per_session.observe(n_turns)
        self.publisher.publish(self.keys.session_stream, SessionClosed(
            producer=self.publisher.producer, policy=state["policy"], session_id=state["id"],
            request_id=state["request_id"], status=state["status"], reason=state["reason"][:500], turns=n_turns,
            tokens=len(t.prompt_ids) + len(t.response_ids), model_tokens=sum(t.loss_mask),
            reward=float(state["reward"] or 0.0), oldest_version=versions[0] if versions else -1,
            newest_version=versions[-1] if versions else -1, engine_switches=state["switches"],
            digest=trajectory_digest(t)))

    def claim(self, policy: str, *, tenant: str | None = None) -> dict[str, Any] | None:
        """The oldest session offered to external agents of ``policy`` (None when none waits), bound to
        ``tenant`` from now on."""
        if name_problem("policy", policy) is not None:
            raise ChatError(str(name_problem("policy", policy)), param="policy")
        while True:
            sid = self.store.claim(policy)
            if sid is None:
                return None
            if tenant and not self.store.bind(sid, tenant):
                continue  # gone, or another tenant's: never an offered session, take the next
            try:
                return self.get(sid, tenant=tenant)
            except SessionNotFound:
                continue

    # --- turns -----------------------------------------------------------------------------------
    async def chat(self, sid: str, body: Mapping[str, Any], *, tenant: str | None = None,
                   on_tokens: Callable[[list[int], list[float]], Awaitable[None]] | None = None) -> TurnReply:
        tools = check_tools(body.get("tools"))
        if tools and not self.fmt.supports_tools:
            raise ChatError("this model's chat template does not support tools: leave 'tools' out, or serve a "
                            "model whose template renders them", param="tools")
        digest = params_digest({k: body.get(k) for k in (*_SAMPLING_KEYS, "max_tokens", "max_completion_tokens",
                                                            "tools", "tool_choice")})
        return await self._turn(sid, body, lambda state: plan_chat(self.fmt, state, body.get("messages"),
                                                                    tools=tools, digest=digest), on_tokens, tenant)

    async def completion(self, sid: str, body: Mapping[str, Any], *, tenant: str | None = None,
                         on_tokens: Callable[[list[int], list[float]], Awaitable[None]] | None = None) -> TurnReply:
        digest = params_digest({k: body.get(k) for k in (*_SAMPLING_KEYS, "max_tokens")})
        return await self._turn(sid, body, lambda state: plan_completion(self.fmt, state, body.get("prompt"),
                                                                          digest=digest), on_tokens, tenant)

    async def _turn(self, sid: str, body: Mapping[str, Any], planner: Callable[[dict[str, Any]], Plan],
                    on_tokens: Callable[[list[int], list[float]], Awaitable[None]] | None,
                    tenant: str | None) -> TurnReply:
        _check_sid(sid)
        arrived_ms = _now_ms()
        held = self.store.begin(sid, uuid.uuid4().hex, tenant=tenant)
        committed = False
        try:
            state = held.state
            if state["status"] != OPEN:
                raise SessionError(f"session {sid!r} is {state['status']}"
                                   f"{': ' + state['reason'] if state['reason'] else ''}; open a new session",
                                   code="session_closed", status=409)
            try:
                plan = planner(state)
            except ContextOverflow as exc:
                ended = _ended(state, OVERFLOW, str(exc), None)
                self.store.commit(held, ended)
                committed = True
                self._publish_closed(ended)
                raise
            env_ms = float(arrived_ms - state["last_ms"]) if state["last_ms"] else 0.0
            if plan.repeat and plan.journal is not None:
                self.metrics.turns.labels("repeat").inc()
                return TurnReply(state, plan.journal, plan, True, _usage(plan, plan.journal))
            if plan.journal is not None:
                new_state_ = replay_journal(state, plan)
                new_state_["last_ms"] = _now_ms()
                self.store.commit(held, new_state_, publish=self._turn_event(new_state_, plan.journal, plan.turn, True))
                committed = True
                self.metrics.turns.labels("journal").inc()
                if on_tokens is not None:
                    await on_tokens(list(plan.journal["output_ids"]), list(plan.journal["logprobs"]))
                return TurnReply(new_state_, plan.journal, plan, True, _usage(plan, plan.journal))
            room = state["max_context"] - len(plan.context)
            params = sampling_from_request(body, state["sampling"], room)
            started = time.perf_counter()
            try:
                out = await self.pinner.generate(state["policy"], state["engine_id"], plan.context, params,
                                                 rid=f"{sid}-{state['attempt']}-{plan.turn}", on_tokens=on_tokens)
            except NoEngine as exc:
                raise SessionError(str(exc), code="no_engine", status=503) from None
            except EngineHTTPError as exc:
                if exc.rejected and not exc.overloaded:
                    raise SessionError(f"the engine refused the turn: {exc}", code="engine_rejected",
                                       status=400) from None
                raise SessionError(f"no engine could serve the turn: {exc}", code="engine_failed",
                                   status=502) from None
            gen_s = time.perf_counter() - started
            turn = self._turn_record(plan, out, gen_s * 1000, env_ms)
            new_state_ = apply_turn(state, plan, turn)
            if state["engine_id"] and out.engine_id != state["engine_id"]:
                new_state_["switches"] = state["switches"] + 1
                self.metrics.engine_switches.inc()
            new_state_["engine_id"] = out.engine_id
            new_state_["engine_calls"] = state["engine_calls"] + out.calls
            new_state_["engine_tokens"] = state["engine_tokens"] + len(plan.context) + len(out.output_ids)
            new_state_["last_ms"] = _now_ms()
            self.store.commit(held, new_state_, publish=self._turn_event(new_state_, turn, plan.turn, False))
            committed = True
            self.metrics.turns.labels("engine").inc()
            self.metrics.generation_s.observe(gen_s)
            if env_ms:
                self.metrics.environment_s.observe(env_ms / 1000)
            self.metrics.new_tokens.observe(len(plan.new_ids))
            self.metrics.output_tokens.observe(len(out.output_ids))
            self.metrics.overhead_s.observe(max((_now_ms() - arrived_ms) / 1000 - gen_s, 0.0))
            return TurnReply(new_state_, turn, plan, False, _usage(plan, turn))
        finally:
            if not committed:
                self.store.release(sid, held.token)

    def _turn_record(self, plan: Plan, out: TurnOutput, gen_ms: float, env_ms: float) -> dict[str, Any]:
        text = self.fmt.reply_text(out.output_ids)
        if plan.kind == CHAT:
            content, calls = parse_tool_calls(text)
            reply: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                reply["tool_calls"] = calls
            reply = canonical(reply, "reply")
        else:
            reply = {"text": text}
        return {
            "kind": plan.kind, "messages": plan.new, "new_ids": plan.new_ids, "output_ids": out.output_ids,
            "logprobs": out.logprobs, "versions": out.versions, "engine_id": out.engine_id, "finish": out.finish,
            "reply": reply, "params": _digest_of(plan), "gen_ms": round(gen_ms, 3), "env_ms": round(env_ms, 3),
            "cached_tokens": out.cached_tokens, "ts_ms": _now_ms(), "calls": out.calls,
        }

    def _turn_event(self, state: Mapping[str, Any], turn: Mapping[str, Any], index: int,
                    journal: bool) -> tuple[list[Any], list[Any]]:
        """The turn's ``SessionTurn``, prepared to go out with the turn's commit (one round trip)."""
        versions = [v for v in turn["versions"] if v >= 0]
        return self.publisher.prepared(self.keys.session_stream, SessionTurn(
            producer=self.publisher.producer, policy=state["policy"], session_id=state["id"], turn=index,
            engine_id=turn["engine_id"], new_tokens=len(turn["new_ids"]), output_tokens=len(turn["output_ids"]),
            cached_tokens=int(turn.get("cached_tokens", 0)), oldest_version=min(versions, default=-1),
            newest_version=max(versions, default=-1), finish=turn["finish"], gen_ms=float(turn["gen_ms"]),
            env_ms=float(turn["env_ms"]), from_journal=journal))


def _digest_of(plan: Plan) -> str:
    return str(plan.journal["params"]) if plan.journal is not None else plan.digest


def _ended(state: dict[str, Any], status: str, reason: str, reward: float | None) -> dict[str, Any]:
    state = dict(state)
    state["status"] = status
    state["reason"] = reason
    state["reward"] = None if reward is None else float(reward)
    state["closed_ms"] = _now_ms()
    state["turns"] = state["turns"][: state["position"]]
    return state


def _usage(plan: Plan, turn: Mapping[str, Any]) -> dict[str, int]:
    prompt = len(plan.context)
    completion = len(turn["output_ids"])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _check_sid(sid: str) -> None:
    problem = name_problem("session id", sid)
    if problem is not None:
        raise SessionError(problem, code="invalid_session_id", status=400)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


__all__ = ["FAILED", "Gateway", "Held", "TurnReply"]
