"""HTTP endpoints in SGLang's native shapes: generation, health and information (control: ``control.py``).

Handlers parse and validate on the event loop, hand work to the scheduler thread as commands, and
await the results. With ``--api-key`` every route but ``/health*``, ``/ready`` and ``/metrics`` (and
any OPTIONS request) needs ``Authorization: Bearer KEY``, as SGLang's middleware does. The controller's
fencing token is read on those same routes only, after the key.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from rollout_bus.engine.control import Control
from rollout_bus.engine.errors import BadRequest, EngineError, Unavailable
from rollout_bus.engine.http_client import FENCE_HEADER
from rollout_bus.engine.protocol import Limits, SamplingParams, SequenceSpec, parse_generate, parse_json
from rollout_bus.engine.replies import generate_reply
from rollout_bus.engine.runtime import ENGINE_VERSION, Engine
from rollout_bus.engine.sequence import Progress, Seq
from rollout_bus.events.settings import env_seconds

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0
"""How long ``/health_generate`` waits for the engine to show progress (SGLang's ``SGLANG_HEALTH_CHECK_TIMEOUT``,
read from the same environment variable)."""
HEALTH_POLL_S = 0.25
OPEN_PREFIXES = ("/health", "/ready", "/metrics")
FENCE_SEEN = web.AppKey("fence_seen", dict)
MAX_FENCE_CHARS = 20
"""A fencing token is a Redis counter (a signed 64-bit integer): at most 20 characters."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except EngineError as exc:
        return web.json_response({"error": {"message": str(exc)}}, status=exc.status)
    except web.HTTPException:
        raise
    except Exception as exc:
        logger.exception("%s %s failed", request.method, request.path)
        return web.json_response({"error": {"message": f"internal error: {exc!r}"}}, status=500)


def health_timeout_s() -> float:
    """``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds when set (above 0), else ``HEALTH_TIMEOUT_S``; a bad value is an
    ``InvalidRequest`` naming the variable (SGLang, too, fails on one)."""
    return env_seconds("SGLANG_HEALTH_CHECK_TIMEOUT", HEALTH_TIMEOUT_S)


def guard_middleware(key: str | None) -> Any:
    """The API key, then the fence, on every route but the open ones (``OPEN_PREFIXES`` and OPTIONS).

    The fence header is read only after the key is checked, so an anonymous caller can never raise the
    highest token seen and lock the controller out. A fenced call answers 409 with ``fenced: true`` and
    the ``highest`` token seen, which the controller tells apart from an engine failure."""
    expected = key.encode() if key else None

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "OPTIONS" or request.path.startswith(OPEN_PREFIXES):
            return await handler(request)
        if expected is not None:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
                return web.json_response({"error": "Unauthorized"}, status=401)
        refused = check_fence(request)
        return refused if refused is not None else await handler(request)

    return check


def check_fence(request: web.Request) -> web.Response | None:
    """None when the call may go on (no token, or one no older than the highest seen, which it raises)."""
    raw = request.headers.get(FENCE_HEADER)
    if raw is None:
        return None
    try:
        token = int(raw) if len(raw) <= MAX_FENCE_CHARS else None
    except ValueError:
        token = None
    if token is None:
        return web.json_response({"error": {"message": f"{FENCE_HEADER} must be an integer, got {raw[:40]!r}"}},
                                 status=400)
    seen = request.app[FENCE_SEEN]
    if token < seen["highest"]:
        highest = seen["highest"]
        return web.json_response({"success": False, "fenced": True, "highest": highest,
                                  "message": f"fenced: token {token} is older than {highest}: "
                                             "another controller took over"}, status=409)
    seen["highest"] = token
    return None


class Routes:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler
        self.model = engine.model
        self.health_timeout_s = health_timeout_s()  # read once: a bad value stops the engine at start

    def add_to(self, app: web.Application) -> None:
        post, get = web.post, web.get
        app.add_routes([
            post("/generate", self.generate),
            web.put("/generate", self.generate),
            get("/health", self.health),
            get("/health_generate", self.health_generate),
            get("/ready", self.ready),
            get("/model_info", self.model_info),
            get("/get_model_info", self.model_info),
            get("/server_info", self.server_info),
            get("/get_server_info", self.server_info),
            get("/v1/loads", self.loads),
            get("/v1/models", self.models),
        ])

    def limits(self) -> Limits:
        return Limits(vocab_size=self.model.vocab_size, max_seq_len=self.model.max_seq_len,
                      encode=self.model.codec.encode, adapters=self.scheduler.usable_adapters(),
                      lora_enabled=self.model.lora.enabled, has_tokenizer=not self.engine.args.skip_tokenizer_init,
                      max_seqs=self.engine.args.max_seqs_per_request)

    # generation
    async def generate(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_generate(parse_json(await request.read()), self.limits())
        updates: asyncio.Queue[Progress] = asyncio.Queue()
        seqs = [Seq(spec, _sink(updates), stream=parsed.stream) for spec in parsed.sequences]
        await asyncio.wrap_future(self.scheduler.submit(seqs))
        finals: dict[str, Progress] = {}
        try:
            if parsed.stream:
                return await self._stream(request, seqs, updates, finals, parsed.batched)
            while len(finals) < len(seqs):
                progress = await updates.get()
                if progress.finish is not None:
                    finals[progress.spec.rid] = progress
        finally:
            unfinished = [seq for seq in seqs if seq.rid not in finals]
            if unfinished:
                self.scheduler.abort_seqs(unfinished, "the client went away")
        replies = [self._reply(finals[s.rid]) for s in seqs]
        return web.json_response(replies if parsed.batched else replies[0])

    async def _stream(self, request: web.Request, seqs: list[Seq], updates: asyncio.Queue[Progress],
                      finals: dict[str, Progress], batched: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        index = {seq.rid: i for i, seq in enumerate(seqs)}
        while len(finals) < len(seqs):
            progress = await updates.get()
            chunk = self._reply(progress)
            if batched:
                chunk["index"] = index[progress.spec.rid]
            if progress.finish is not None:
                finals[progress.spec.rid] = progress
            try:
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            except ConnectionResetError:
                logger.info("stream of %s closed by the client", progress.spec.rid)
                finals.pop(progress.spec.rid, None)
                return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _reply(self, progress: Progress) -> dict[str, Any]:
        reply = generate_reply(progress, self.model.codec)
        if self.engine.args.skip_tokenizer_init:
            del reply["text"]
        return reply

    # health and info
    async def health(self, request: web.Request) -> web.Response:
        """``/health``: 200 while the scheduler runs."""
        return web.Response(status=200 if self.scheduler.alive else 503)

    async def ready(self, request: web.Request) -> web.Response:
        """``/ready``: 503 while paused, as SGLang."""
        return web.Response(status=200 if self.scheduler.alive and self.scheduler.paused is None else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """A real greedy token through the scheduler; 503 when it cannot run now.

        As SGLang's: the check passes once the engine shows progress after it began, its own token or a
        decode step of anything else that finished since. A busy engine's probe waits its turn behind the
        running batch, and an engine decoding a long eval is not taken for a stuck one."""
        if self.scheduler.paused is not None:
            raise Unavailable(f"generation is paused (mode {self.scheduler.paused})")
        if self.scheduler.released & {"weights", "kv_cache"}:
            raise Unavailable(f"memory is released: {sorted(self.scheduler.released)}")
        spec = SequenceSpec(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            input_ids=self.model.codec.health_ids,
            params=SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True),
            lora=None,
            seed=0,
            return_logprob=False,
            return_text_in_logprobs=False,
        )
        updates: asyncio.Queue[Progress] = asyncio.Queue()
        timeout_s = self.health_timeout_s
        steps_before = self.scheduler.steps
        await asyncio.wrap_future(self.scheduler.submit([Seq(spec, _sink(updates))]))
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                progress = await asyncio.wait_for(updates.get(), max(0.0, min(HEALTH_POLL_S, deadline - time.monotonic())))
                break
            except TimeoutError:
                if self.scheduler.steps > steps_before:  # a step finished after the check began
                    self.scheduler.abort(spec.rid, "health check passed on the engine's progress", exact=True)
                    return web.Response(status=200)
                if time.monotonic() >= deadline:
                    self.scheduler.abort(spec.rid, "health check timed out", exact=True)
                    raise Unavailable(f"no token generated and no decode step finished within {timeout_s} s") from None
        if progress.finish is None or progress.finish["type"] == "abort":
            raise Unavailable(f"health generation did not finish: {progress.finish}")
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        """SGLang's keys; ``model_path`` and ``served_model_name`` follow weight updates, as there."""
        model = self.model
        return web.json_response({
            "model_path": model.source,
            "served_model_name": model.served_name or self.engine.args.model_name,
            "tokenizer_path": model.codec.path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": model.version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": model.model_type,
            "architectures": model.architectures,
        })

    async def server_info(self, request: web.Request) -> web.Response:
        """The launch arguments at top level (``weight_version`` stays the launch one, as in SGLang) and
        ``internal_states[0]``; this engine's scheduler figures are under ``internal_states[0].cpu_engine``
        (SGLang reports no request counts here: loads are at ``/v1/loads``)."""
        state = await asyncio.wrap_future(self.scheduler.snapshot())
        args = self.engine.args.to_dict()
        args.update(served_model_name=self.engine.args.model_name)
        internal = {**args, "world_size": 1, "last_gen_throughput": 0.0, "cpu_engine": state}
        return web.json_response({**args, "version": ENGINE_VERSION, "internal_states": [internal]})

    async def loads(self, request: web.Request) -> web.Response:
        """``GET /v1/loads``: SGLang's load snapshot (one data-parallel rank)."""
        raw_rank = request.query.get("dp_rank")
        if raw_rank is not None and not raw_rank.lstrip("-").isdigit():
            raise BadRequest(f"dp_rank must be an integer, got {raw_rank!r}")
        dp_rank = None if raw_rank is None else int(raw_rank)
        running, waiting = self.scheduler.counts
        now = time.time()
        snapshot = {
            "timestamp": now, "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_waiting_uncached_tokens": 0, "num_used_tokens": 0, "num_total_tokens": 0, "num_active_tokens": 0,
            "num_prealloc_ready_tokens": 0, "max_total_num_tokens": 0,
            "max_running_requests": self.engine.args.max_batch_size, "token_usage": 0.0, "gen_throughput": 0.0,
            "cache_hit_rate": round(self.scheduler.cache_hit_rate, 6), "utilization": 0.0, "total_prefill_uncached_tokens": 0,
            "total_prefill_busy_us": 0, "decode_moments": [],
        }
        return web.json_response({
            "timestamp": datetime.fromtimestamp(now, UTC).isoformat(), "version": ENGINE_VERSION,
            "accelerator": None, "num_accelerators": 1,
            "loads": [snapshot] if dp_rank in (None, 0) else [],
        })

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the served model and every loaded LoRA adapter (``root`` is its path)."""
        name = self.engine.args.model_name
        cards = [{"id": name, "object": "model", "owned_by": "rollout-bus", "root": name, "parent": None,
                  "max_model_len": self.model.max_seq_len}]
        cards += [{"id": adapter, "object": "model", "owned_by": "rollout-bus", "root": path, "parent": name,
                   "max_model_len": None} for adapter, path in sorted(self.model.adapter_paths().items())]
        return web.json_response({"object": "list", "data": cards})


def build_app(engine: Engine) -> web.Application:
    middlewares = [guard_middleware(engine.args.api_key), error_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=16 * 1024 * 1024)
    app[FENCE_SEEN] = {"highest": 0}
    Routes(engine).add_to(app)
    Control(engine).add_to(app)

    async def start(_: web.Application) -> None:
        engine.start()

    async def stop(_: web.Application) -> None:
        engine.stop()  # aborts what is in flight, so open /generate calls answer before the loop closes

    app.on_startup.append(start)
    app.on_shutdown.append(stop)
    return app


def _sink(updates: asyncio.Queue[Progress]) -> Callable[[Progress], None]:
    loop = asyncio.get_running_loop()

    def deliver(progress: Progress) -> None:
        loop.call_soon_threadsafe(updates.put_nowait, progress)

    return deliver
