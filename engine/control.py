"""HTTP control endpoints in SGLang's shapes: weights, versions, pause, aborts, memory, LoRA adapters.

As in SGLang, each body must be a JSON object (no body is a 400) and unknown keys are ignored.
Weight files and adapters are read and vetted on a worker thread, so the event loop keeps serving;
the swap itself runs on the scheduler thread between two steps. With ``--weights-root`` an engine
loads weights and adapters only from directories inside it (links resolved) or from the model it
started with: a caller cannot make it serve any directory of its host.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from rollout_bus.engine.errors import BadRequest, EngineError
from rollout_bus.engine.protocol import (
    get_bool,
    get_int,
    get_str,
    get_version,
    parse_json,
    parse_memory_tags,
    parse_pause_mode,
)
from rollout_bus.engine.runtime import Engine
from rollout_bus.engine.scheduler import FLUSH_REFUSED, FLUSHED
from rollout_bus.engine.served import WeightUpdate
from rollout_bus.engine.weight_sync import WeightGroups
from rollout_bus.events.names import adapter_name_problem
from rollout_bus.lm.files import DIGEST_ALGORITHM
from rollout_bus.lm.hf import state_digest

logger = logging.getLogger(__name__)

FLUSH_RETRY_S = 0.05
"""How often ``/flush_cache?timeout=S`` asks again while requests run."""


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        raise BadRequest(f"{request.path} needs a JSON object body (send {{}} for the defaults)")
    return parse_json(raw)


def _required_str(body: dict[str, Any], name: str) -> str:
    value = get_str(body, name, None)
    if not value:
        raise BadRequest(f"{name} is required")
    return value


def _required_int(body: dict[str, Any], name: str) -> int:
    if body.get(name) is None:
        raise BadRequest(f"{name} is required")
    return get_int(body, name, 0)


def _required_list(body: dict[str, Any], name: str) -> list[Any]:
    value = body.get(name)
    if not isinstance(value, list):
        raise BadRequest(f"{name} is required (a list)")
    return value


def _inside(path: str, root: Path) -> bool:
    try:
        return Path(path).resolve().is_relative_to(root)
    except (OSError, RuntimeError, ValueError):  # a link loop, a NUL byte: not a path it loads
        return False


class Control:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler
        self.model = engine.model
        root = engine.args.weights_root
        self.weights_root = Path(root).resolve() if root else None
        self.start_model = Path(engine.args.model_path).resolve()
        self.groups = WeightGroups(self.model.reference, self.model.device, engine.args.dist_timeout)

    def check_source(self, field: str, path: str) -> None:
        """``BadRequest`` unless the engine may load from ``path`` (see ``--weights-root``)."""
        root = self.weights_root
        if root is None or _inside(path, root):
            return
        try:
            if Path(path).resolve() == self.start_model:
                return
        except (OSError, RuntimeError, ValueError):
            pass
        raise BadRequest(f"{field} {path!r} is outside this engine's --weights-root {str(root)!r}: it loads only "
                         "published weights from there (or the model it started with)")

    def add_to(self, app: web.Application) -> None:
        post, get = web.post, web.get
        app.add_routes([
            get("/flush_cache", self.flush_cache),
            post("/flush_cache", self.flush_cache),
            post("/update_weights_from_disk", self.update_weights_from_disk),
            post("/update_weight_version", self.update_weight_version),
            post("/init_weights_update_group", self.init_weights_update_group),
            post("/update_weights_from_distributed", self.update_weights_from_distributed),
            post("/destroy_weights_update_group", self.destroy_weights_update_group),
            post("/pause_generation", self.pause_generation),
            post("/continue_generation", self.continue_generation),
            post("/abort_request", self.abort_request),
            post("/release_memory_occupation", self.release_memory),
            post("/resume_memory_occupation", self.resume_memory),
            get("/release_memory_occupation", self.release_memory),
            get("/resume_memory_occupation", self.resume_memory),
            post("/load_lora_adapter", self.load_lora_adapter),
            post("/unload_lora_adapter", self.unload_lora_adapter),
            get("/weights_digest", self.weights_digest),
        ])

    async def flush_cache(self, request: web.Request) -> web.Response:
        """Drop the prefix cache, as SGLang's route: 200 with its text, or 400 while requests run (or queue,
        unpaused). ``?timeout=S`` tries again until idle, for at most ``S`` seconds."""
        raw = request.query.get("timeout", "0")
        try:
            timeout_s = float(raw)
        except ValueError:
            timeout_s = -1.0
        if not 0 <= timeout_s < float("inf"):
            raise BadRequest(f"timeout must be a number of seconds >= 0, got {raw[:40]!r}")
        deadline = time.monotonic() + timeout_s
        while True:
            done, running, waiting = await asyncio.wrap_future(self.scheduler.flush_cache())
            if done:
                return web.Response(text=FLUSHED)
            if time.monotonic() >= deadline:
                logger.warning("cache not flushed: %d running, %d waiting", running, waiting)
                return web.Response(status=400, text=("Cache not flushed because there are pending requests. "
                                                      f"#queue-req: {waiting}, #running-req: {running}\n"))
            await asyncio.sleep(min(FLUSH_RETRY_S, max(deadline - time.monotonic(), 0.0)))

    # weights
    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request)
            model_path = _required_str(body, "model_path")
            self.check_source("model_path", model_path)
            load_format = get_str(body, "load_format", None)
            if load_format not in (None, "auto", "safetensors"):
                raise BadRequest(f"load_format {load_format!r} is not supported; use 'safetensors' or leave it out")
            flush = get_bool(body, "flush_cache", True)
            abort_all = get_bool(body, "abort_all_requests", False)
            version = get_version(body, "weight_version")
            loop = asyncio.get_running_loop()
            state = await loop.run_in_executor(None, self.model.read_update, model_path)
            digest = await loop.run_in_executor(None, state_digest, state)
            outcome = await asyncio.wrap_future(
                self.scheduler.update_weights(WeightUpdate(state, version, model_path, digest), abort_all, flush))
        except EngineError as exc:
            logger.warning("weight update rejected: %s", exc)
            return web.json_response({"success": False, "message": str(exc), "num_paused_requests": 0},
                                     status=exc.status)
        if not outcome.flushed:
            return web.json_response({"success": False, "message": FLUSH_REFUSED,
                                      "num_paused_requests": outcome.carried}, status=400)
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": outcome.carried})

    # weights by collective (engine.weight_sync)
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request)
            address = _required_str(body, "master_address")
            port, rank, world = (_required_int(body, name) for name in ("master_port", "rank_offset", "world_size"))
            name = get_str(body, "group_name", None) or "weight_update_group"
            backend = get_str(body, "backend", None) or "nccl"
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.groups.open, address, port, rank, world, name, backend)
        except EngineError as exc:
            logger.warning("weight update group not opened: %s", exc)
            return web.json_response({"success": False, "message": str(exc)}, status=exc.status)
        return web.json_response({"success": True, "message": f"Succeeded to initialize custom process group {name}."})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        try:
            name = get_str(await _body(request), "group_name", None) or "weight_update_group"
            self.groups.destroy(name)
        except EngineError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=exc.status)
        return web.json_response({"success": True, "message": f"Succeeded to destroy custom process group {name}."})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """One bucket: received and staged; the last one of a version swaps the whole set in (``engine.weight_sync``)."""
        try:
            body = await _body(request)
            names, dtypes, shapes = (_required_list(body, field) for field in ("names", "dtypes", "shapes"))
            name = get_str(body, "group_name", None) or "weight_update_group"
            flush = get_bool(body, "flush_cache", True)
            abort_all = get_bool(body, "abort_all_requests", False)
            version = get_version(body, "weight_version")
            load_format = get_str(body, "load_format", None)
            if load_format not in (None, "auto"):
                raise BadRequest(f"load_format {load_format!r} is not supported here; leave it out")
            loop = asyncio.get_running_loop()
            staged = await loop.run_in_executor(None, self.groups.receive, name, names, dtypes, shapes, version)
            if staged.state is None:
                return web.json_response({"success": True, "message": (
                    f"Received {staged.received} tensors; {staged.staged} of {staged.total} staged for weight "
                    f"version {version}: the served weights change once all have arrived.")})
            update = WeightUpdate(staged.state, version, self.model.source, staged.digest, collective=True)
            outcome = await asyncio.wrap_future(self.scheduler.update_weights(update, abort_all, flush))
        except EngineError as exc:
            logger.warning("weights from group rejected: %s", exc)
            return web.json_response({"success": False, "message": str(exc)}, status=exc.status)
        if not outcome.flushed:
            return web.json_response({"success": False, "message": FLUSH_REFUSED}, status=400)
        message = "Succeeded to update parameter online."
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request)
            version = get_version(body, "new_version")
            if version is None:
                raise BadRequest("new_version is required (a string)")
            abort_all = get_bool(body, "abort_all_requests", True)
            await asyncio.wrap_future(self.scheduler.set_version(version, abort_all))
        except EngineError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=exc.status)
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": version})

    async def weights_digest(self, request: web.Request) -> web.Response:
        """``GET /weights_digest`` (needs the API key): the digest of the weights this engine serves, computed
        when they were loaded (``lm.files.tensors_digest`` / ``lm.hf.state_digest``), never on request."""
        version, digest, adapters = self.model.digests()
        return web.json_response({"algorithm": DIGEST_ALGORITHM, "weight_version": version,
                                  "model_path": self.model.source, "digest": digest, "adapters": adapters})

    # scheduling control
    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = parse_pause_mode(await _body(request))
        await asyncio.wrap_future(self.scheduler.pause(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        get_bool(await _body(request), "torch_empty_cache", True)
        await asyncio.wrap_future(self.scheduler.unpause())
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        """SGLang: an empty rid without ``abort_all`` is ignored; a rid not in flight aborts nothing."""
        body = await _body(request)
        rid = get_str(body, "rid", None) or None
        abort_all = get_bool(body, "abort_all", False)
        message = get_str(body, "abort_message", None) or "aborted by /abort_request"
        if abort_all or rid is not None:
            await asyncio.wrap_future(self.scheduler.abort(None if abort_all else rid, message))
        return web.Response(status=200)

    async def release_memory(self, request: web.Request) -> web.Response:
        tags = parse_memory_tags(await _body(request), request.path)
        await asyncio.wrap_future(self.scheduler.release_memory(tags))
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        tags = parse_memory_tags(await _body(request), request.path)
        await asyncio.wrap_future(self.scheduler.resume_memory(tags))
        return web.json_response(None)

    # adapters
    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request)
            name, path = _required_str(body, "lora_name"), _required_str(body, "lora_path")
            problem = adapter_name_problem(name)
            if problem is not None:
                raise BadRequest(problem)
            self.check_source("lora_path", path)
            get_bool(body, "pinned", False)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.model.check_adapter, name, path)
            digest = await loop.run_in_executor(None, self.model.adapter_digest, path)
            await asyncio.wrap_future(self.scheduler.load_adapter(name, path, digest))
        except EngineError as exc:
            logger.warning("adapter load rejected: %s", exc)
            return self._lora_reply(str(exc), exc.status)
        return self._lora_reply(None, 200)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        try:
            name = _required_str(await _body(request), "lora_name")
            done = await asyncio.wrap_future(self.scheduler.unload_adapter(name))
            await asyncio.wrap_future(done)
        except EngineError as exc:
            return self._lora_reply(str(exc), exc.status)
        return self._lora_reply(None, 200)

    def _lora_reply(self, error: str | None, status: int) -> web.Response:
        return web.json_response({"rid": None, "http_worker_ipc": None, "success": error is None,
                                  "error_message": error, "loaded_adapters": self.model.adapter_paths()},
                                 status=status)
