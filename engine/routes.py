"""HTTP endpoints in SGLang's native shapes (see /work/shared reference and the module docs).

Handlers parse and validate on the event loop, hand work to the scheduler thread as commands, and
await the results. Weight files are read on a worker thread so the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from rollout_bus.engine.errors import BadRequest, EngineError, Unavailable
from rollout_bus.engine.http_client import FENCE_HEADER
from rollout_bus.engine.protocol import (
    BASE_WEIGHT_SET,
    SamplingParams,
    SequenceSpec,
    get_bool,
    get_str,
    get_version,
    parse_generate,
    parse_json,
    parse_memory_tags,
    parse_pause_mode,
    reject_unknown,
)
from rollout_bus.engine.replies import generate_reply
from rollout_bus.engine.runtime import ENGINE_VERSION, Engine
from rollout_bus.engine.sequence import Progress, Seq
from rollout_bus.engine.weights import WeightUpdate, read_weights
from rollout_bus.lm.tokenizer import BOS_ID

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0
FENCE_SEEN = web.AppKey("fence_seen", dict)
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


@web.middleware
async def fence_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A call carrying a controller's fencing token older than the highest seen is refused (409)."""
    raw = request.headers.get(FENCE_HEADER)
    if raw is None:
        return await handler(request)
    try:
        token = int(raw)
    except ValueError:
        return web.json_response({"error": {"message": f"{FENCE_HEADER} must be an integer, got {raw!r}"}},
                                 status=400)
    seen = request.app[FENCE_SEEN]
    if token < seen["highest"]:
        return web.json_response({"success": False, "message": f"fenced: token {token} is older than "
                                  f"{seen['highest']}: another controller took over"}, status=409)
    seen["highest"] = token
    return await handler(request)


class Routes:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler
        self.store = engine.store

    def add_to(self, app: web.Application) -> None:
        post, get = web.post, web.get
        app.add_routes([
            post("/generate", self.generate),
            get("/health", self.health),
            get("/health_generate", self.health_generate),
            get("/ready", self.health),
            get("/model_info", self.model_info),
            get("/get_model_info", self.model_info),
            get("/server_info", self.server_info),
            get("/get_server_info", self.server_info),
            get("/flush_cache", self.flush_cache),
            post("/flush_cache", self.flush_cache),
            post("/update_weights_from_disk", self.update_weights_from_disk),
            post("/update_weight_version", self.update_weight_version),
            post("/pause_generation", self.pause_generation),
            post("/continue_generation", self.continue_generation),
            post("/abort_request", self.abort_request),
            post("/release_memory_occupation", self.release_memory),
            post("/resume_memory_occupation", self.resume_memory),
        ])

    # generation
    async def generate(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_generate(await _body(request), self.store.config_for)
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
            for seq in seqs:
                if seq.rid not in finals:
                    self.scheduler.abort(seq.rid, "the client went away", exact=True)
        replies = [self._reply(finals[s.rid]) for s in seqs]
        return web.json_response(replies if parsed.batched else replies[0])

    async def _stream(
        self,
        request: web.Request,
        seqs: list[Seq],
        updates: asyncio.Queue[Progress],
        finals: dict[str, Progress],
        batched: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
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
        reply = generate_reply(progress)
        if self.engine.args.skip_tokenizer_init:
            del reply["text"]
        return reply

    # health and info
    async def health(self, request: web.Request) -> web.Response:
        """``/health`` and ``/ready``: 200 while the scheduler runs."""
        return web.Response(status=200 if self.scheduler.alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Runs one real greedy token through the scheduler; 503 when it cannot run now."""
        if self.scheduler.paused is not None:
            raise Unavailable(f"generation is paused (mode {self.scheduler.paused})")
        if self.scheduler.released & {"weights", "kv_cache"}:
            raise Unavailable(f"memory is released: {sorted(self.scheduler.released)}")
        spec = SequenceSpec(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            input_ids=(BOS_ID,),
            params=SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True),
            weight_set=BASE_WEIGHT_SET,
            seed=0,
            return_logprob=False,
            return_text_in_logprobs=False,
        )
        updates: asyncio.Queue[Progress] = asyncio.Queue()
        await asyncio.wrap_future(self.scheduler.submit([Seq(spec, _sink(updates))]))
        try:
            progress = await asyncio.wait_for(updates.get(), HEALTH_TIMEOUT_S)
        except TimeoutError:
            self.scheduler.abort(spec.rid, "health check timed out", exact=True)
            raise Unavailable(f"no token generated within {HEALTH_TIMEOUT_S} s") from None
        if progress.finish is None or progress.finish["type"] == "abort":
            raise Unavailable(f"health generation did not finish: {progress.finish}")
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        base = self.store.get(BASE_WEIGHT_SET)
        return web.json_response({
            "model_path": base.source,
            "tokenizer_path": None,
            "served_model_name": self.engine.args.model_name,
            "is_generation": True,
            "weight_version": base.version,
            "weight_versions": self.store.versions(),
            "load_format": "safetensors",
            "model_type": "tiny_lm",
            "architectures": ["TinyLM"],
            "config": base.config.to_dict(),
        })

    async def server_info(self, request: web.Request) -> web.Response:
        state = await asyncio.wrap_future(self.scheduler.snapshot())
        versions = self.store.versions()
        state["weight_versions"] = versions
        args = self.engine.args.to_dict()
        args.update(served_model_name=self.engine.args.model_name, weight_version=versions[BASE_WEIGHT_SET])
        return web.json_response({**args, "version": ENGINE_VERSION, "internal_states": [state]})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if await asyncio.wrap_future(self.scheduler.flush_cache()):
            return web.Response(text="Cache flushed.\n")
        return web.Response(status=400, text="Cache not flushed: there are running or waiting requests.\n")

    # weights
    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request)
            reject_unknown(
                body,
                {"model_path", "load_format", "weight_version", "flush_cache", "abort_all_requests", "lora_name"},
                "/update_weights_from_disk",
            )
            model_path = get_str(body, "model_path", None)
            if not model_path:
                raise BadRequest("model_path is required: a weights directory or a .safetensors file")
            load_format = get_str(body, "load_format", None)
            if load_format not in (None, "auto", "safetensors"):
                raise BadRequest(f"load_format {load_format!r} is not supported; use 'safetensors' or leave it out")
            get_bool(body, "flush_cache", True)  # no prefix cache here: nothing to flush
            abort_all = get_bool(body, "abort_all_requests", False)
            name = get_str(body, "lora_name", None) or BASE_WEIGHT_SET
            version = get_version(body, "weight_version")
            state, config = await asyncio.get_running_loop().run_in_executor(None, read_weights, model_path)
            update = WeightUpdate(name, state, config, version, model_path)
            carried = await asyncio.wrap_future(self.scheduler.update_weights(update, abort_all))
        except EngineError as exc:
            logger.warning("weight update rejected: %s", exc)
            return web.json_response({"success": False, "message": str(exc)}, status=exc.status)
        return web.json_response({
            "success": True,
            "message": f"Succeeded to update model weights of set {name!r} from {model_path}.",
            "num_paused_requests": carried,
        })

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request)
            reject_unknown(body, {"new_version", "abort_all_requests", "lora_name"}, "/update_weight_version")
            version = get_version(body, "new_version")
            if version is None:
                raise BadRequest("new_version is required")
            name = get_str(body, "lora_name", None) or BASE_WEIGHT_SET
            self.store.get(name)
            abort_all = get_bool(body, "abort_all_requests", True)
            await asyncio.wrap_future(self.scheduler.set_version(name, version, abort_all))
        except EngineError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=exc.status)
        return web.json_response(
            {"success": True, "message": f"Weight version of set {name!r} is now {version}.", "new_version": version}
        )

    # scheduling control
    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = parse_pause_mode(await _body(request))
        count = await asyncio.wrap_future(self.scheduler.pause(mode))
        return web.json_response({"message": f"Generation paused (mode {mode}, {count} in flight).", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        body = await _body(request)
        reject_unknown(body, set(), "/continue_generation")
        await asyncio.wrap_future(self.scheduler.unpause())
        return web.json_response({"message": "Generation continued.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _body(request)
        reject_unknown(body, {"rid", "abort_all", "finished_reason", "abort_message"}, "/abort_request")
        rid = get_str(body, "rid", None) or None
        abort_all = get_bool(body, "abort_all", False)
        message = get_str(body, "abort_message", None) or "aborted by /abort_request"
        if rid is None and not abort_all:
            raise BadRequest("send a rid to abort, or abort_all: true")
        await asyncio.wrap_future(self.scheduler.abort(None if abort_all else rid, message))
        return web.Response(status=200)

    async def release_memory(self, request: web.Request) -> web.Response:
        return await self._memory(request, release=True)

    async def resume_memory(self, request: web.Request) -> web.Response:
        return await self._memory(request, release=False)

    async def _memory(self, request: web.Request, release: bool) -> web.Response:
        where = "/release_memory_occupation" if release else "/resume_memory_occupation"
        try:
            tags = parse_memory_tags(await _body(request), where)
            action = self.scheduler.release_memory if release else self.scheduler.resume_memory
            await asyncio.wrap_future(action(tags))
        except EngineError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=exc.status)
        verb = "Released" if release else "Resumed"
        return web.json_response({"success": True, "message": f"{verb} memory: {list(tags)}."})


def build_app(engine: Engine) -> web.Application:
    app = web.Application(middlewares=[fence_middleware, error_middleware], client_max_size=16 * 1024 * 1024)
    app[FENCE_SEEN] = {"highest": 0}
    Routes(engine).add_to(app)

    async def start(_: web.Application) -> None:
        engine.start()

    async def stop(_: web.Application) -> None:
        engine.stop()  # aborts what is in flight, so open /generate calls answer before the loop closes

    app.on_startup.append(start)
    app.on_shutdown.append(stop)
    return app


async def _body(request: web.Request) -> dict[str, Any]:
    return parse_json(await request.read())


def _sink(updates: asyncio.Queue[Progress]) -> Callable[[Progress], None]:
    loop = asyncio.get_running_loop()

    def deliver(progress: Progress) -> None:
        loop.call_soon_threadsafe(updates.put_nowait, progress)

    return deliver
