"""SGLang's real HTTP layer with a recording stand-in for its tokenizer manager (sglang==0.5.23 only).

``Harness(argv)`` parses ``argv`` with SGLang's own ``prepare_server_args`` (resolved for a CPU device,
on a directory holding only a Llama ``config.json``), installs a ``Recorder`` as the tokenizer manager
of SGLang's FastAPI ``app`` with ``set_global_state``, and wraps the app in SGLang's API-key
middleware when a key is set. ``serve()`` runs it on a loopback port (uvicorn in a thread), so the
project's own aiohttp client can talk to it. Request parsing, validation (pydantic, msgspec, the
/generate contract gate, ``normalize_batch_and_arguments``, ``SamplingParams.verify``), response
wrapping and authentication are SGLang's; only what happens behind the tokenizer manager is modelled,
from a reading of ``tokenizer_manager.py``, ``scheduler.py`` and ``weight_updater.py`` of 0.5.23:

- replies come prompt-major; n > 1 samples get fresh ids; an aborted request answers an empty abort;
- ``/update_weights_from_disk`` waits for running requests unless paused; under an ``in_place`` pause
  with requests held, the flush after loading is refused: 400, the weights are in, the reported
  version stays;
- release while not idle, and resume of a tag never released, are where the real scheduler dies:
  recorded in ``scheduler_deaths`` (and answered 400 here, so a test can go on and show it).

Private sglang internals are used (pinned version): ``http_server.app``/``set_global_state``/
``_GlobalState``, ``runtime_context.publish``/``get_context``, ``server_args.prepare_server_args``,
``utils.auth.add_api_key_middleware``, ``io_struct``, ``LoRARef``, ``LoadSnapshot``, ``ServerStatus``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import tempfile
import threading
import time
import types
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import sglang.srt.entrypoints.http_server as http_server
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX
    from sglang.srt.lora.lora_registry import LoRARef
    from sglang.srt.managers.io_struct import FlushCacheReqOutput, LoRAUpdateOutput
    from sglang.srt.managers.load_snapshot import LoadSnapshot
    from sglang.srt.managers.tokenizer_manager import ServerStatus
    from sglang.srt.runtime_context import get_context, publish
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import prepare_server_args

SGLANG_VERSION = "0.5.23"
ALL_TAGS = ("weights", "kv_cache", "cuda_graph")
RELEASE_ASSERT = "release_memory_occupation should be called only when server is idle."
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 259,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "float32", "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False,
}


def config_only_model_dir() -> str:
    """A directory with a Llama ``config.json`` only: enough for ServerArgs resolution and /model_info."""
    path = tempfile.mkdtemp(prefix="sglang-contract-model-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(LLAMA_CONFIG, f)
    return path


class SchedulerDeath(RuntimeError):
    """Where SGLang's scheduler process would die (an assert or an uncaught KeyError)."""


@dataclass
class Call:
    method: str
    obj: Any = None
    kwargs: dict[str, Any] = field(default_factory=dict)


class Recorder:
    """The tokenizer manager as SGLang's routes see it; records every parsed request object."""

    def __init__(self, server_args: Any) -> None:
        self.server_args = server_args
        ctx = get_context()
        self.model_path = ctx.config_leaf("model_path")
        self.served_model_name = ctx.config_leaf("served_model_name") or self.model_path
        self.weight_version = ctx.config_leaf("weight_version")
        self.load_format = ctx.config_leaf("load_format")
        self.enable_lora = bool(ctx.config_leaf("enable_lora"))
        self.skip_tokenizer_init = bool(ctx.config_leaf("skip_tokenizer_init"))
        with open(os.path.join(str(self.model_path), "config.json")) as f:
            config = json.load(f)
        self.vocab_size = int(config["vocab_size"])
        self.model_config = types.SimpleNamespace(
            hf_config=types.SimpleNamespace(model_type=config["model_type"], architectures=config["architectures"]),
            is_image_understandable_model=False, is_audio_understandable_model=False, embedding_model_spec=None,
            context_len=int(config["max_position_embeddings"]))
        self.is_generation = True
        self.gracefully_exit = False
        self.server_status = ServerStatus.Up
        self.last_receive_tstamp = 0.0
        self.rid_to_state: dict[str, Any] = {}
        self.startup_time = time.time()
        self.loras: dict[str, LoRARef] = {r.lora_name: r for r in (ctx.config_leaf("lora_paths") or [])
                                          if isinstance(r, LoRARef)}
        self.lora_registry = types.SimpleNamespace(get_all_adapters=lambda: dict(self.loras))
        self.paused: str | None = None
        self.released: set[str] = set()
        self.inflight: set[str] = set()
        self.aborted: set[str] = set()
        self.hold = threading.Event()  # set: generate calls stay in flight until cleared or aborted
        self.calls: list[Call] = []
        self.scheduler_deaths: list[str] = []

    def calls_of(self, method: str) -> list[Call]:
        return [c for c in self.calls if c.method == method]

    def config_value(self, name: str) -> Any:
        values = {"weight_version": self.weight_version, "load_format": self.load_format,
                  "model_path": self.model_path, "served_model_name": self.served_model_name}
        return values[name] if name in values else get_context().config_leaf(name)

    def is_ready(self) -> bool:
        return self.paused is None and self.server_status == ServerStatus.Up

    def _idle(self, ignore_waiting: bool) -> bool:
        """Scheduler.is_fully_idle: requests in flight run, unless a retract pause moved them to the queue."""
        return not self.inflight or (ignore_waiting and self.paused == "retract")

    def _die(self, why: str) -> None:
        self.scheduler_deaths.append(why)
        raise SchedulerDeath(why)

    # --- generation -------------------------------------------------------------------------
    async def generate_request(self, obj: Any, request: Any = None) -> Any:
        obj.normalize_batch_and_arguments()
        health = isinstance(obj.rid, str) and obj.rid.startswith(HEALTH_CHECK_RID_PREFIX)
        self.calls.append(Call("generate_request", obj, {"health": health}))
        if obj.lora_path:
            self._check_lora(obj.lora_path)
        rows = self._rows(obj)
        for _rid, _ids, params, _sample in rows:
            checked = SamplingParams(**dict(params))
            if self.skip_tokenizer_init:
                checked.normalize(None)
            checked.verify(self.vocab_size)
        rids = [r[0] for r in rows]
        self.inflight.update(rids)
        try:
            while (self.paused in ("retract", "in_place") or (self.hold.is_set() and not health)) \
                    and not all(r in self.aborted for r in rids):
                await asyncio.sleep(0.01)
            outs = [self._aborted(rid) if rid in self.aborted else self._reply(obj, rid, ids, params)
                    for rid, ids, params, _ in rows]
            self.last_receive_tstamp = time.time()
            if getattr(obj, "stream", False):
                for index, out in enumerate(outs):
                    if not obj.is_single:
                        out["index"] = index
                    yield out
            else:
                yield outs[0] if obj.is_single else outs
        finally:
            self.inflight.difference_update(rids)
            self.aborted.difference_update(rids)

    def _check_lora(self, lora_path: Any) -> None:
        names = [lora_path] if isinstance(lora_path, str) else lora_path
        if not self.enable_lora:
            raise ValueError(f"LoRA adapter '{next(n for n in names if n)}' was requested, but LoRA is not enabled. "
                             "Please launch the server with --enable-lora flag.")
        for name in names:
            if name is not None and name not in self.loras:
                raise ValueError(f"Got LoRA adapter that has never been loaded: {name}\n"
                                 f"All loaded adapters: {self.loras.keys()}.")

    def _rows(self, obj: Any) -> list[tuple[str, Any, Any, int]]:
        """(rid, input_ids, sampling_params, sample) in the order SGLang answers: prompt-major."""
        if obj.is_single:
            return [(obj.rid, obj.input_ids, obj.sampling_params, 0)]
        n = obj.parallel_sample_num
        if n == 1:
            return [(obj.rid[i], obj.input_ids[i], obj.sampling_params[i], 0) for i in range(obj.batch_size)]
        return [(uuid.uuid4().hex, obj.input_ids[i], obj.sampling_params[i], s)
                for i in range(obj.batch_size) for s in range(n)]

    def _aborted(self, rid: str) -> dict[str, Any]:
        out: dict[str, Any] = {"output_ids": [], "meta_info": {
            "id": rid, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "weight_version": self.weight_version, "e2e_latency": 0.001, "completion_tokens": 0}}
        return out if self.skip_tokenizer_init else {"text": "", **out}

    def _reply(self, obj: Any, rid: str, ids: Any, params: Any) -> dict[str, Any]:
        n = min(int((params or {}).get("max_new_tokens") or 16), 16)
        output = [(sum(ids or []) + 3 * k + 5) % self.vocab_size for k in range(n)]
        meta: dict[str, Any] = {"id": rid, "finish_reason": {"type": "length", "length": n},
                                "prompt_tokens": len(ids or []), "weight_version": self.weight_version,
                                "num_retractions": 0}
        logprob = obj.return_logprob[0] if isinstance(obj.return_logprob, list) else obj.return_logprob
        if logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[-0.5, t, None] for t in output]
            meta["output_token_logprobs_length"] = n
        meta.update(reasoning_tokens=0, completion_tokens=n, cached_tokens=0, e2e_latency=0.001)
        out: dict[str, Any] = {"output_ids": output, "meta_info": meta}
        return out if self.skip_tokenizer_init else {"text": " ".join(map(str, output)), **out}

    def create_abort_task(self, obj: Any) -> None:
        return None

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.calls.append(Call("abort_request", None, {"rid": rid, "abort_all": abort_all}))
        if abort_all:
            self.aborted |= self.inflight
        elif rid and rid in self.inflight:
            self.aborted.add(rid)

    # --- weights -------------------------------------------------------------------------------
    async def update_weights_from_disk(self, obj: Any, request: Any = None) -> tuple[bool, str, int]:
        if obj.load_format is None:
            obj.load_format = self.load_format
        self.calls.append(Call("update_weights_from_disk", obj))
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        if self.paused is None:  # the writer lock waits for running requests
            while self.inflight:
                await asyncio.sleep(0.01)
        held = len(self.inflight)
        if obj.flush_cache and not self._idle(ignore_waiting=self.paused in ("retract", "in_place")):
            return False, FLUSH_REFUSED, held  # the weights are in; the reported version stays
        self.model_path = self.served_model_name = obj.model_path
        message = "Succeeded to update model weights."
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
            message += f" Weight version updated to {obj.weight_version}."
        return True, message, held

    async def init_weights_update_group(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        self.calls.append(Call("init_weights_update_group", obj))
        return True, "Succeeded to initialize custom process group."

    async def update_weights_from_distributed(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        self.calls.append(Call("update_weights_from_distributed", obj))
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
        return True, "Succeeded to update parameter online."

    async def destroy_weights_update_group(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        self.calls.append(Call("destroy_weights_update_group", obj))
        return True, "Succeeded to destroy custom process group."

    async def update_weight_version(self, obj: Any) -> None:
        self.calls.append(Call("update_weight_version", obj))
        self.weight_version = obj.new_version

    async def pause_generation(self, obj: Any) -> None:
        self.calls.append(Call("pause_generation", obj))
        self.paused = obj.mode
        if obj.mode == "abort":
            self.abort_request(abort_all=True)
            while self.inflight:  # SGLang waits until no generate call holds the model lock
                await asyncio.sleep(0.01)

    async def continue_generation(self, obj: Any) -> None:
        self.calls.append(Call("continue_generation", obj))
        self.paused = None

    async def release_memory_occupation(self, obj: Any, request: Any = None) -> None:
        self.calls.append(Call("release_memory_occupation", obj))
        if not self._idle(ignore_waiting=self.paused in ("retract", "in_place")):
            self._die(RELEASE_ASSERT)
        self.released |= set(obj.tags or ALL_TAGS)

    async def resume_memory_occupation(self, obj: Any, request: Any = None) -> None:
        self.calls.append(Call("resume_memory_occupation", obj))
        for tag in obj.tags or ALL_TAGS:
            if tag not in self.released:
                self._die(f"KeyError: {tag!r} (offload_tags.remove of a tag never released)")
        self.released -= set(obj.tags or ALL_TAGS)

    async def flush_cache(self, timeout_s: Any = None) -> Any:
        """Scheduler.flush_cache: only when fully idle, waiting requests ignored while paused."""
        success = self._idle(ignore_waiting=self.paused is not None)
        self.calls.append(Call("flush_cache", None, {"timeout_s": timeout_s, "success": success}))
        return FlushCacheReqOutput(success=success)

    # --- adapters ---------------------------------------------------------------------------------
    async def load_lora_adapter(self, obj: Any, request: Any = None) -> Any:
        self.calls.append(Call("load_lora_adapter", obj))
        if not self.enable_lora:
            return LoRAUpdateOutput(success=False, error_message="LoRA is not enabled. Please set `--enable-lora`.")
        if obj.lora_name in self.loras:
            return LoRAUpdateOutput(success=False, error_message=(
                f"Failed to load LoRA adapter {obj.lora_name} because it is already loaded"))
        self.loras[obj.lora_name] = LoRARef(lora_name=obj.lora_name, lora_path=obj.lora_path, pinned=obj.pinned)
        return LoRAUpdateOutput(success=True, loaded_adapters={k: v.lora_path for k, v in self.loras.items()})

    async def unload_lora_adapter(self, obj: Any, request: Any = None) -> Any:
        self.calls.append(Call("unload_lora_adapter", obj))
        if obj.lora_name not in self.loras:
            return LoRAUpdateOutput(success=False, error_message=(
                f"LoRA with name {obj.lora_name} does not exist. Loaded LoRAs: {self.loras.keys()}"))
        del self.loras[obj.lora_name]
        return LoRAUpdateOutput(success=True, loaded_adapters={k: v.lora_path for k, v in self.loras.items()})

    # --- information ----------------------------------------------------------------------------------
    async def get_internal_state(self) -> list[dict[str, Any]]:
        state = get_context().resolved_server_args_dict()
        state.update(world_size=1, last_gen_throughput=0.0, effective_max_running_requests_per_dp=1024,
                     memory_usage={"weight": 0.0, "kvcache": 0.0, "graph": {}, "token_capacity": 4096})
        return [state]

    async def get_loads(self, include: Any = None, dp_rank: Any = None) -> list[Any]:
        if dp_rank not in (None, 0):
            return []
        waiting = len(self.inflight) if self.paused == "retract" else 0
        return [LoadSnapshot(timestamp=time.time(), dp_rank=0, num_running_reqs=len(self.inflight) - waiting,
                             num_waiting_reqs=waiting, num_total_tokens=4096, max_total_num_tokens=4096,
                             max_running_requests=1024)]


class Harness:
    """ServerArgs from ``argv`` (SGLang's parser), a ``Recorder`` behind SGLang's app."""

    def __init__(self, argv: list[str] | None = None) -> None:
        argv = list(argv or [])
        if "--model-path" not in argv:
            argv = ["--model-path", config_only_model_dir(), *argv]
        if "--device" not in argv:
            argv += ["--device", "cpu"]  # resolution asks for an accelerator otherwise
        root = logging.getLogger()
        saved = root.handlers[:], root.level
        try:  # prepare_server_args configures logging with force=True: keep pytest's handlers
            self.server_args = prepare_server_args(argv)
        finally:
            root.handlers[:] = saved[0]
            root.setLevel(saved[1])
        self.server_args.resolve_once()
        self.server_args.check_server_args()
        publish(self.server_args, role="tokenizer")
        self.tm = Recorder(self.server_args)
        http_server.set_global_state(http_server._GlobalState(
            tokenizer_manager=self.tm, template_manager=None,
            scheduler_info={"status": "ready", "max_total_num_tokens": 4096, "max_req_input_len": 4090,
                            "startup_time": self.tm.startup_time}))
        serving = get_context().config_bag("serving")
        self.app = self._with_auth(http_server.app, serving.api_key, serving.admin_api_key)

    @staticmethod
    def _with_auth(app: Any, api_key: str | None, admin_api_key: str | None) -> Any:
        """SGLang's API-key middleware around the app (built around it, the shared app is not changed)."""
        if not (api_key or admin_api_key):
            return app
        from sglang.srt.utils.auth import add_api_key_middleware

        captured: dict[str, Any] = {}

        class Grab:
            def add_middleware(self, cls: Any, **kwargs: Any) -> None:
                captured.update(cls=cls, kwargs=kwargs)

        add_api_key_middleware(Grab(), api_key=api_key, admin_api_key=admin_api_key)
        return captured["cls"](app, **{**captured["kwargs"], "fastapi_app": app})

    def client(self) -> Any:
        from fastapi.testclient import TestClient

        return TestClient(self.app, raise_server_exceptions=False)  # no `with`: no lifespan, no warm-up thread

    @contextlib.contextmanager
    def serve(self) -> Iterator[str]:
        """The app on 127.0.0.1:<free port> (uvicorn in a thread, lifespan off); yields its URL."""
        import uvicorn

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, lifespan="off",
                                               log_level="warning", loop="asyncio"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join(10)


def plain(obj: Any) -> Any:
    """A recorded request object as plain data (dataclass or msgspec struct)."""
    import dataclasses

    import msgspec

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, msgspec.Struct):
        return msgspec.structs.asdict(obj)
    return obj


