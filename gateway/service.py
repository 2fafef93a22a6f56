"""The session gateway's work, without HTTP: open, serve a turn, close, claim.

Every call takes the session's lock on the bus, works, and commits the new state in one script
(``events.sessions``); the bus holds the whole session, so any instance serves any session. Each turn
publishes ``SessionTurn`` (in the same script as its commit: one round trip) and each ending
``SessionClosed`` on the sessions stream.

What a gateway keeps in memory is a copy, never the truth: for each session whose last turn it served, the
state its commit wrote and the ``tito.Memo`` derived from it (recorded messages, tokens, and the template's
text of the history, rendered after the reply went out). The next call passes that commit to
``SessionStore.begin``; only while the session is still at it (no other gateway, takeover or restart wrote
since) is the kept state used, otherwise the state is read whole and planned from scratch, to the same
tokens. The round trips overlap the work around them: while the lock's script runs, the call is planned
from the kept state and its engine call sent (``Ahead``: dropped, the engine request aborted, unless the
bus confirms the kept state); while the commit's script runs, the reply is shaped for the caller, and
returned only once the commit went through.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import OrderedDict
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
    BadState,
    Held,
    SessionError,
    SessionNotFound,
    SessionStore,
    check_state,
    new_state,
    pack_turn,
)
from rollout_bus.gateway.chat import ChatError, ChatFormat, canonical, check_tools, parse_tool_calls
from rollout_bus.gateway.engines import NoEngine, Pinner, TurnOutput
from rollout_bus.gateway.metrics import GatewayMetrics
from rollout_bus.gateway.tito import (
    CHAT,
    ContextOverflow,
    Memo,
    Plan,
    apply_turn,
    memo_after,
    model_versions,
    params_digest,
    plan_chat,
    plan_completion,
    replay_journal,
    tools_key,
    trajectory,
    trajectory_digest,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
KEEP_SESSIONS = 1024
"""Sessions whose last committed state a gateway keeps (the least recently served are dropped first)."""
Planner = Callable[[dict[str, Any], "Memo | None"], Plan]
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "stop", "seed", "frequency_penalty",
                  "presence_penalty", "ignore_eos")


@dataclass
class Kept:
    """A session's state as this gateway's last commit on it wrote it, and what the next call derives from it."""

    held: Held
    memo: Memo | None


@dataclass
class Early:
    """A call planned from the kept state before the lock's reply came: the plan, or what planning raised,
    given (``result``) only when the bus says the kept state is still the session's."""

    made: Plan | None
    error: Exception | None

    @classmethod
    def plan(cls, planner: Planner, kept: Kept | None) -> Early | None:
        if kept is None or kept.memo is None or not kept.memo.fits(kept.held.state):
            return None
        try:
            return cls(planner(kept.held.state, kept.memo), None)
        except Exception as exc:  # raised again if this plan is the one that counts
            return cls(None, exc)

    def result(self) -> Plan:
        if self.error is not None:
            raise self.error
        assert self.made is not None
        return self.made


@dataclass
class Ahead:
    """An engine call started from the kept state before the lock's reply (``Gateway._call_ahead``)."""

    plan: Plan
    params: dict[str, Any]
    task: asyncio.Future[TurnOutput]
    started: float

    async def drop(self) -> None:
        """Cancel the call (the engine aborts the request) and wait until it is gone."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@dataclass
class TurnReply:
    """A served turn, for the HTTP layer to shape."""

    session: dict[str, Any]
    turn: dict[str, Any]
    plan: Plan
    from_journal: bool
    usage: dict[str, int] = field(default_factory=dict)
    shaped: Any = None
    """What the caller's ``shape`` made of this reply while its commit was on its way (None: not made)."""


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
                 metrics: GatewayMetrics | None = None, instance: str | None = None,
                 keep_sessions: int = KEEP_SESSIONS) -> None:
        self.store = store
        self.publisher = publisher
        self.pinner = pinner
        self.fmt = fmt
        self.metrics = metrics or GatewayMetrics()
        self.instance = instance or f"{os.uname().nodename}-{os.getpid()}"
        self.keys = store.keys
        self.keep_sessions = keep_sessions
        self.kept: OrderedDict[str, Kept] = OrderedDict()
        """Per session this gateway served last: its committed state and memo (a copy: see the module docstring)."""
        self._prerender = bool(getattr(fmt, "deterministic", False))

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
        self.kept.pop(sid, None)
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
        self.kept.pop(sid, None)

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
                   on_tokens: Callable[[list[int], list[float]], Awaitable[None]] | None = None,
                   shape: Callable[[TurnReply], Any] | None = None) -> TurnReply:
        """One chat turn of session ``sid``. ``shape``: what the caller will make of the reply (its HTTP body),
        made while the turn's commit is on its way (``TurnReply.shaped``); the reply is returned only once
        the commit went through."""
        tools = check_tools(body.get("tools"))
        if tools and not self.fmt.supports_tools:
            raise ChatError("this model's chat template does not support tools: leave 'tools' out, or serve a "
                            "model whose template renders them", param="tools")
        digest = params_digest({k: body.get(k) for k in (*_SAMPLING_KEYS, "max_tokens", "max_completion_tokens",
                                                            "tools", "tool_choice")})

        def planner(state: dict[str, Any], memo: Memo | None) -> Plan:
            return plan_chat(self.fmt, state, body.get("messages"), tools=tools, digest=digest,
                             memo=memo if memo is not None else Memo.of(state))

        return await self._turn(sid, body, planner, on_tokens, tenant, tools=tools, shape=shape)

    async def completion(self, sid: str, body: Mapping[str, Any], *, tenant: str | None = None,
                         on_tokens: Callable[[list[int], list[float]], Awaitable[None]] | None = None,
                         shape: Callable[[TurnReply], Any] | None = None) -> TurnReply:
        digest = params_digest({k: body.get(k) for k in (*_SAMPLING_KEYS, "max_tokens")})
        return await self._turn(sid, body, lambda state, _: plan_completion(self.fmt, state, body.get("prompt"),
                                                                             digest=digest), on_tokens, tenant,
                                shape=shape)

    async def _turn(self, sid: str, body: Mapping[str, Any], planner: Planner,
                    on_tokens: Callable[[list[int], list[float]], Awaitable[None]] | None,
                    tenant: str | None, tools: list[dict[str, Any]] | None = None,
                    shape: Callable[[TurnReply], Any] | None = None) -> TurnReply:
        _check_sid(sid)
        arrived_ms = _now_ms()
        kept = self.kept.pop(sid, None)
        pending = self.store.send_begin(sid, uuid.uuid4().hex, tenant=tenant,
                                        known=kept.held if kept is not None else None)
        ahead: Ahead | None = None
        got: Held | None = None
        try:
            try:
                early = Early.plan(planner, kept)  # from the kept state, while Redis takes the lock
                if early is not None and on_tokens is None and kept is not None and tenant in (None, kept.held.tenant):
                    ahead = self._call_ahead(sid, body, kept.held.state, early)
                    if ahead is not None:
                        await asyncio.sleep(0)  # the engine call goes out before this waits for the lock's reply
            finally:
                got = pending.held()  # read whatever happened, so the connection stays in step
        except BaseException:
            if got is not None:
                self.store.release(sid, got.token)
            if ahead is not None:
                await ahead.drop()
            raise
        held = got
        committed = False
        try:
            state = held.state
            memo = kept.memo if kept is not None and kept.memo is not None and kept.memo.fits(state) else None
            if memo is None and ahead is not None:
                await ahead.drop()  # planned from a state that is no longer the session's
                ahead = None
            if state["status"] != OPEN:
                raise SessionError(f"session {sid!r} is {state['status']}"
                                   f"{': ' + state['reason'] if state['reason'] else ''}; open a new session",
                                   code="session_closed", status=409)
            try:
                plan = early.result() if early is not None and memo is not None else planner(state, memo)
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
            if ahead is not None and (ahead.plan is not plan or ahead.params != params):
                await ahead.drop()
                ahead = None
            try:
                if ahead is not None:
                    started = ahead.started
                    out = await ahead.task
                else:
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
            packed = _turns_packed(plan, new_state_)
            sent = self.store.send_commit(held, new_state_, publish=self._turn_event(new_state_, turn, plan.turn, False),
                                          turns_packed=packed)
            try:  # while Redis runs the commit: what follows it, kept aside until it went through
                keep = self._to_keep(held, new_state_, plan, turn, packed)
                reply = TurnReply(new_state_, turn, plan, False, _usage(plan, turn))
                if shape is not None:
                    reply.shaped = shape(reply)
            finally:
                sent.done()
            committed = True
            if keep is not None:
                keep.held.rev = held.rev  # the commit's revision
                self._keep(keep, tools)
            self.metrics.turns.labels("engine").inc()
            self.metrics.generation_s.observe(gen_s)
            if env_ms:
                self.metrics.environment_s.observe(env_ms / 1000)
            self.metrics.new_tokens.observe(len(plan.new_ids))
            self.metrics.output_tokens.observe(len(out.output_ids))
            self.metrics.overhead_s.observe(max((_now_ms() - arrived_ms) / 1000 - gen_s, 0.0))
            return reply
        finally:
            if not committed:
                self.store.release(sid, held.token)
            if ahead is not None and not ahead.task.done():
                await ahead.drop()

    def _call_ahead(self, sid: str, body: Mapping[str, Any], state: dict[str, Any], early: Early) -> Ahead | None:
        """The engine call of a turn planned from the kept state, started before the lock's reply: used only if
        the bus then says the kept state is the session's (``begin``), dropped (and aborted on the engine)
        otherwise. Only a plain engine turn: none for a journal answer, a refused call, a streamed one."""
        plan = early.made
        if plan is None or plan.journal is not None or plan.repeat:
            return None
        try:
            params = sampling_from_request(body, state["sampling"], state["max_context"] - len(plan.context))
        except ChatError:
            return None
        task = asyncio.ensure_future(self.pinner.generate(
            state["policy"], state["engine_id"], plan.context, params, rid=f"{sid}-{state['attempt']}-{plan.turn}"))
        return Ahead(plan, params, task, time.perf_counter())

    def _to_keep(self, held: Held, state: dict[str, Any], plan: Plan, turn: Mapping[str, Any],
                 packed: list[bytes] | None) -> Kept | None:
        """What to keep of ``state``, being committed by ``held``'s call, for the session's next call on this
        gateway (``_keep``, once the commit went through): only a state that passes ``check_state`` (the
        earlier turns passed it before), as a full read would check it; with the memo of a chat turn."""
        try:
            check_state(held.sid, state, from_turn=plan.turn)
        except BadState:
            return None
        return Kept(Held(held.sid, held.token, held.rev, state, held.tenant),  # its revision set once committed
                    memo_after(state, plan, turn, packed=packed))

    def _keep(self, keep: Kept, tools: list[dict[str, Any]] | None) -> None:
        """Keep ``keep``, whose commit went through, and render its history for the next call once the reply
        has gone out."""
        self.kept[keep.held.sid] = keep
        while len(self.kept) > self.keep_sessions:
            self.kept.popitem(last=False)
        if keep.memo is not None and self._prerender:
            asyncio.get_running_loop().call_soon(self._render_history, keep.memo, tools)

    def _render_history(self, memo: Memo, tools: list[dict[str, Any]] | None) -> None:
        """The template's text of a kept session's history, for its next call (run once the reply went out)."""
        key = tools_key(tools)
        if key in memo.rendered or len(memo.rendered) >= 4:
            return
        try:
            memo.rendered[key] = self.fmt.render(memo.history, tools=tools, add_generation_prompt=False)
        except ChatError:
            return  # the next call renders it again and says why

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


def _turns_packed(plan: Plan, state: Mapping[str, Any]) -> list[bytes] | None:
    """``state``'s turns packed for its commit, the earlier ones as the memo's last commit packed them (packed
    now, once, for a memo of a state read whole); None without a memo."""
    memo = plan.memo
    if memo is None or len(state["turns"]) != plan.turn + 1:
        return None
    if memo.packed is None or len(memo.packed) != plan.turn:
        memo.packed = [pack_turn(t) for t in memo.state["turns"][:plan.turn]]
    return [*memo.packed, pack_turn(state["turns"][-1])]


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
