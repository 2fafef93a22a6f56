"""The gateway's HTTP face: OpenAI's API under a per-session base URL, and the session routes.

```
POST /sessions                                {policy, session_id?, item?, max_context?}  open a session
GET  /sessions/{sid}                          the session: status, turns, engine, reward
POST /sessions/{sid}/close                    {reward, status?: closed|failed, reason?}
POST /sessions/claim                          {policy}: an offered session, for an external agent
POST /sessions/{sid}/v1/chat/completions      OpenAI chat completions (stream, tools)
POST /sessions/{sid}/v1/completions           OpenAI completions
GET  /sessions/{sid}/v1/models                the session's policy as a model
GET  /health                                  200
```

An OpenAI client works unchanged with ``base_url=http://HOST:PORT/sessions/<sid>/v1``. Errors have
OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``. With client keys configured
(``gateway.keys``: one per tenant, never the engines' key), every route but ``/health`` wants one as a
bearer token; a session is bound to the tenant that opened or claimed it, and another tenant's key gets
404 for it, as for a session that does not exist; a key opens and claims sessions only of the policies
it allows (403 naming the policy otherwise). Without client keys (a gateway on a loopback address only),
every caller sees every session.
Each reply carries what a trainer needs beside OpenAI's fields, under ``rollout_bus``: the turn, the
appended and generated token ids, their log-probs and weight versions, the engine, and whether the
journal answered. A client that disconnects mid-generation cancels the handler, and the engine request
is aborted.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from rollout_bus.events.sessions import CLOSED, SessionError
from rollout_bus.gateway.chat import ChatError
from rollout_bus.gateway.keys import ClientKey, ClientKeys
from rollout_bus.gateway.service import Gateway, TurnReply
from rollout_bus.gateway.tito import CHAT

log = logging.getLogger(__name__)

GATEWAY_KEY = web.AppKey("gateway", Gateway)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_body(message: str, *, code: str, param: str | None = None, status: int = 400,
               position: int | None = None) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            409: "conflict_error", 503: "service_unavailable"}.get(status, "server_error")
    error: dict[str, Any] = {"message": message, "type": kind, "param": param, "code": code}
    if position is not None:
        error["position"] = position
    return {"error": error}


def error_response(message: str, *, code: str, param: str | None = None, status: int = 400,
                   position: int | None = None) -> web.Response:
    return web.json_response(error_body(message, code=code, param=param, status=status, position=position),
                             status=status)


TENANT_KEY = web.RequestKey("tenant", ClientKey)


def auth_middleware(keys: ClientKeys | None) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if keys and request.path != "/health":
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            found = keys.match(given.strip()) if scheme.lower() == "bearer" else None
            if found is None:
                return error_response("a valid API key is needed: send 'Authorization: Bearer <key>' with your "
                                      "gateway key", code="invalid_api_key", status=401)
            request[TENANT_KEY] = found
        return await handler(request)

    return check


def tenant_of(request: web.Request) -> str | None:
    """The caller's tenant (None on a gateway without client keys: the caller sees every session)."""
    key = request.get(TENANT_KEY)
    return None if key is None else key.tenant


def check_policy(request: web.Request, policy: str) -> None:
    key = request.get(TENANT_KEY)
    if key is not None and not key.allows(policy):
        raise ChatError(f"this key (tenant {key.tenant!r}) may not open or claim sessions of policy {policy!r}",
                        param="policy", code="policy_not_allowed", status=403)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    gateway: Gateway = request.app[GATEWAY_KEY]
    try:
        return await handler(request)
    except ChatError as exc:
        gateway.metrics.refused.labels(exc.code).inc()
        return error_response(str(exc), code=exc.code, param=exc.param, status=exc.status, position=exc.position)
    except SessionError as exc:
        gateway.metrics.refused.labels(exc.code).inc()
        return error_response(str(exc), code=exc.code, status=exc.status)
    except web.HTTPException as exc:
        if exc.status >= 400:
            return error_response(exc.reason or "error", code="not_found" if exc.status == 404 else "http_error",
                                  status=exc.status)
        raise


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        raise ChatError("the request body must be a JSON object", param=None) from None
    if not isinstance(body, dict):
        raise ChatError("the request body must be a JSON object", param=None)
    return body


def session_view(state: dict[str, Any], base: str) -> dict[str, Any]:
    return {
        "id": state["id"], "policy": state["policy"], "status": state["status"], "reason": state["reason"],
        "turns": state["position"], "journal_turns": len(state["turns"]), "attempt": state["attempt"],
        "engine_id": state["engine_id"], "engine_switches": state["switches"], "reward": state["reward"],
        "item": state["item"], "request_id": state["request_id"],
        "base_url": f"{base}/sessions/{state['id']}/v1",
    }


class Routes:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    @staticmethod
    def _base(request: web.Request) -> str:
        return f"{request.scheme}://{request.host}"

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def open(self, request: web.Request) -> web.Response:
        body = await _json(request)
        policy = body.get("policy", "default")
        sid = body.get("session_id") or f"s{time.time_ns():x}"
        max_context = body.get("max_context")
        if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                        or max_context <= 0):
            raise ChatError("max_context must be a positive integer", param="max_context")
        item = body.get("item") or {}
        if not isinstance(item, dict):
            raise ChatError("item must be an object", param="item")
        for field, value in (("policy", policy), ("session_id", sid)):
            if not isinstance(value, str):
                raise ChatError(f"{field} must be a string", param=field)
        check_policy(request, policy)
        try:
            state = self.gateway.open(sid, policy, item=item, max_context=max_context, external=True,
                                      tenant=tenant_of(request))
        except ValueError as exc:
            raise ChatError(str(exc), param="session_id") from None
        return web.json_response(session_view(state, self._base(request)))

    async def show(self, request: web.Request) -> web.Response:
        state = self.gateway.get(request.match_info["sid"], tenant=tenant_of(request))
        return web.json_response(session_view(state, self._base(request)))

    async def close(self, request: web.Request) -> web.Response:
        body = await _json(request)
        reason = body.get("reason", "")
        if not isinstance(reason, str):
            raise ChatError("reason must be a string", param="reason")
        state = self.gateway.close(request.match_info["sid"], reward=body.get("reward"),
                                   status=body.get("status", CLOSED), reason=reason, tenant=tenant_of(request))
        return web.json_response(session_view(state, self._base(request)))

    async def claim(self, request: web.Request) -> web.Response:
        body = await _json(request)
        policy = body.get("policy", "default")
        if not isinstance(policy, str):
            raise ChatError("policy must be a string", param="policy")
        check_policy(request, policy)
        state = self.gateway.claim(policy, tenant=tenant_of(request))
        if state is None:
            return web.json_response({"session": None})
        return web.json_response({"session": session_view(state, self._base(request))})

    async def models(self, request: web.Request) -> web.Response:
        state = self.gateway.get(request.match_info["sid"], tenant=tenant_of(request))
        return web.json_response({"object": "list", "data": [
            {"id": state["policy"], "object": "model", "created": 0, "owned_by": "rollout-bus"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        sid = request.match_info["sid"]
        body = await _json(request)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ChatError("stream must be true or false", param="stream")
        chosen = self.gateway.chat if kind == CHAT else self.gateway.completion
        serve = functools.partial(chosen, tenant=tenant_of(request))
        if not stream:
            reply = await serve(sid, body, shape=lambda r: json.dumps(reply_body(self.gateway, r, kind)))
            text = reply.shaped if reply.shaped is not None else json.dumps(reply_body(self.gateway, reply, kind))
            return web.Response(text=text, content_type="application/json")  # as web.json_response writes it
        return await self._stream(request, sid, body, kind, serve)

    async def _stream(self, request: web.Request, sid: str, body: dict[str, Any], kind: str,
                      serve: Any) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        made: list[int] = []
        sent_text = ""
        created = int(time.time())
        chunk_id = f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{sid}-{time.time_ns():x}"
        buffer_text = bool(body.get("tools")) and kind == CHAT  # tool calls are known only at the end

        async def start() -> web.StreamResponse:
            nonlocal response
            if response is None:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                                       "Cache-Control": "no-cache"})
                await response.prepare(request)
                if kind == CHAT:
                    await _send(response, _chunk(chunk_id, created, sid, kind, {"role": "assistant", "content": ""}))
            return response

        async def on_tokens(ids: list[int], logprobs: list[float]) -> None:
            nonlocal sent_text
            out = await start()
            made.extend(ids)
            if buffer_text:
                return
            text = self.gateway.fmt.reply_text(made)
            if text.startswith(sent_text) and len(text) > len(sent_text) and not text.endswith("\ufffd"):
                delta, sent_text = text[len(sent_text):], text
                await _send(out, _chunk(chunk_id, created, sid, kind,
                                        {"content": delta} if kind == CHAT else delta))

        try:
            reply = await serve(sid, body, on_tokens=on_tokens)
        except (ChatError, SessionError) as exc:
            if response is None:
                raise
            code = getattr(exc, "code", "error")
            await _send(response, error_body(str(exc), code=code, status=getattr(exc, "status", 500)))
            await response.write_eof()
            return response
        out = await start()
        final = reply_body(self.gateway, reply, kind)
        choice = final["choices"][0]
        if kind == CHAT:
            message = choice["message"]
            delta: dict[str, Any] = {}
            rest = (message.get("content") or "")[len(sent_text):] if not buffer_text else message.get("content")
            if rest:
                delta["content"] = rest
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            last = _chunk(chunk_id, created, sid, kind, delta, finish=choice["finish_reason"])
        else:
            rest = choice["text"][len(sent_text):]
            last = _chunk(chunk_id, created, sid, kind, rest, finish=choice["finish_reason"])
        last["usage"] = final["usage"]
        last["rollout_bus"] = final["rollout_bus"]
        await _send(out, last)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


async def _send(response: web.StreamResponse, data: dict[str, Any]) -> None:
    await response.write(f"data: {json.dumps(data)}\n\n".encode())


def _chunk(chunk_id: str, created: int, sid: str, kind: str, delta: Any, finish: str | None = None) -> dict[str, Any]:
    if kind == CHAT:
        return {"id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": sid,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
    return {"id": chunk_id, "object": "text_completion", "created": created, "model": sid,
            "choices": [{"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}]}


def reply_body(gateway: Gateway, reply: TurnReply, kind: str) -> dict[str, Any]:
    turn = reply.turn
    state = reply.session
    finish = "length" if turn["finish"] == "length" else "stop"
    extra = {
        "session_id": state["id"], "turn": reply.plan.turn, "from_journal": reply.from_journal,
        "engine_id": turn["engine_id"], "input_token_ids": list(turn["new_ids"]),
        "output_token_ids": list(turn["output_ids"]), "output_token_logprobs": list(turn["logprobs"]),
        "weight_versions": list(turn["versions"]), "cached_tokens": turn.get("cached_tokens", 0),
    }
    created = int(turn.get("ts_ms", 0) / 1000)
    if kind == CHAT:
        message = dict(turn["reply"])
        if message.get("tool_calls"):
            finish = "tool_calls" if finish == "stop" else finish
            if not message.get("content"):
                message["content"] = None
        return {"id": f"chatcmpl-{state['id']}-{reply.plan.turn}", "object": "chat.completion", "created": created,
                "model": state["policy"], "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                                       "logprobs": None}],
                "usage": reply.usage, "rollout_bus": extra}
    return {"id": f"cmpl-{state['id']}-{reply.plan.turn}", "object": "text_completion", "created": created,
            "model": state["policy"], "choices": [{"index": 0, "text": turn["reply"]["text"],
                                                   "finish_reason": finish, "logprobs": None}],
            "usage": reply.usage, "rollout_bus": extra}


def build_app(gateway: Gateway, *, client_keys: ClientKeys | None = None) -> web.Application:
    app = web.Application(middlewares=[auth_middleware(client_keys), errors_middleware],
                          client_max_size=64 << 20)
    app[GATEWAY_KEY] = gateway
    routes = Routes(gateway)
    app.router.add_get("/health", routes.health)
    app.router.add_post("/sessions", routes.open)
    app.router.add_post("/sessions/claim", routes.claim)
    app.router.add_get("/sessions/{sid}", routes.show)
    app.router.add_post("/sessions/{sid}/close", routes.close)
    app.router.add_get("/sessions/{sid}/v1/models", routes.models)
    app.router.add_post("/sessions/{sid}/v1/chat/completions", routes.chat)
    app.router.add_post("/sessions/{sid}/v1/completions", routes.completions)
    return app
