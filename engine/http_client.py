"""An async client for SGLang's native HTTP API, shared by the controller and the executors.

One ``aiohttp.ClientSession`` per event loop (``shared_session``) pools connections to
every engine; ``EngineClient`` is a cheap per-engine view over it. Every failure becomes
``EngineHTTPError`` with the HTTP status (``0`` when no reply came: refused, reset or
timed out) and the engine's message, so callers branch on ``status`` and ``rejected``
instead of on aiohttp's exception zoo. With an ``api_key`` every call carries
``Authorization: Bearer <key>`` (SGLang's ``--api-key``).

Two 400s mean something else than "refused, nothing changed": ``unflushed`` (SGLang loaded the
weights, could not flush the cache of requests held by an ``in_place`` pause, and kept reporting
the old version) and ``unknown_adapter`` (a ``lora_path`` the engine does not have, which is what a
stale routing table sends after an adapter swap).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import aiohttp

from rollout_bus.events.errors import Failure

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
UNFLUSHED_PREFIX = "Weights were updated, but the cache was not flushed"
UNKNOWN_ADAPTER_MARKS = ("has never been loaded", "Failed to implicitly load LoRA adapter")
"""SGLang's 400s for a ``lora_path`` it does not hold (``TokenizerManager._resolve_lora_path``): a name it
never loaded, and one it unloaded and could not load again (its files are gone)."""
FENCE_HEADER = "X-Rollout-Bus-Fence"
_OLDER_THAN = re.compile(r"fenced: token -?\d+ is older than (\d{1,18})\b")
"""The controller's fencing token on every call it makes; the CPU engine refuses (409) one older than the
highest it has seen (SGLang ignores the header)."""
_sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = (
    weakref.WeakKeyDictionary())


class EngineHTTPError(Failure):
    """An engine call that failed: ``status`` is the HTTP status, 0 when no reply came."""

    def __init__(self, url: str, path: str, status: int, message: str, *, timed_out: bool = False,
                 fence_highest: int | None = None) -> None:
        super().__init__(f"{url}{path}: {status or 'no reply'}: {message}")
        self.url = url
        self.path = path
        self.status = status
        self.message = message
        self.timed_out = timed_out
        self.fence_highest = fence_highest
        """For a fenced refusal: the highest token the engine has seen (None when its reply did not say)."""

    @property
    def transport(self) -> bool:
        """No HTTP reply at all: the engine is down, unreachable or hung."""
        return self.status == 0

    @property
    def rejected(self) -> bool:
        """The engine answered and refused (a 4xx): it is alive (and, but for ``unflushed``, unchanged)."""
        return 400 <= self.status < 500

    @property
    def overloaded(self) -> bool:
        """A 429: the engine's queue is full now; another engine, or this one later, can serve the call."""
        return self.status == 429

    @property
    def unflushed(self) -> bool:
        """SGLang's 400 after a weight load it could not follow with a cache flush: the new weights ARE
        loaded, the reported version is still the old one."""
        return self.status == 400 and self.message.startswith(UNFLUSHED_PREFIX)

    @property
    def unknown_adapter(self) -> bool:
        """A 400 for a ``lora_path`` the engine has not loaded (or unloaded, and cannot load again)."""
        return self.status == 400 and any(mark in self.message for mark in UNKNOWN_ADAPTER_MARKS)

    @property
    def fenced(self) -> bool:
        """The engine refused a call whose fencing token is older than one it has seen: not an engine failure,
        and not a refused version; what it means is the controller's to decide (``controller.runner``)."""
        return self.status == 409 and (self.fence_highest is not None or self.message.startswith("fenced"))


def shared_session() -> aiohttp.ClientSession:
    """The pooled session of the running event loop, created on first use."""
    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        connector = aiohttp.TCPConnector(limit=1024, limit_per_host=256, keepalive_timeout=30.0)
        session = aiohttp.ClientSession(connector=connector)
        _sessions[loop] = session
    return session


async def close_shared_session() -> None:
    """Close the running loop's pooled session (call once at shutdown)."""
    session = _sessions.pop(asyncio.get_running_loop(), None)
    if session is not None and not session.closed:
        await session.close()


class EngineClient:
    """The native API of one engine at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 session: aiohttp.ClientSession | None = None, api_key: str | None = None,
                 fence: int | None = None, on_fenced: Callable[[EngineHTTPError], None] | None = None) -> None:
        """``on_fenced``: called with every fenced refusal before it is raised (the controller's signal)."""
        self.url = url.rstrip("/")
        self.on_fenced = on_fenced
        self.timeout_s = timeout_s
        self._session = session
        headers: dict[str, str] = {}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        if fence is not None:
            headers[FENCE_HEADER] = str(fence)
        self._headers = headers or None

    def __repr__(self) -> str:
        return f"EngineClient({self.url!r})"

    @property
    def session(self) -> aiohttp.ClientSession:
        return self._session if self._session is not None else shared_session()

    async def request(self, method: str, path: str, payload: Mapping[str, Any] | None = None, *,
                      timeout_s: float | None = None) -> Any:
        """One call; the parsed JSON reply (or its text); ``EngineHTTPError`` on any failure."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with self.session.request(
                    method, self.url + path, json=payload, headers=self._headers,
                    timeout=aiohttp.ClientTimeout(total=limit)) as resp:
                body = await resp.read()
                status = resp.status
        except TimeoutError:
            raise EngineHTTPError(self.url, path, 0, f"timed out after {limit:g}s", timed_out=True) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineHTTPError(self.url, path, 0, f"{type(exc).__name__}: {exc}") from None
        data = _parse(body)
        if status >= 400:
            error = EngineHTTPError(self.url, path, status, _message(data), fence_highest=_fence_highest(status, data))
            if error.fenced and self.on_fenced is not None:
                self.on_fenced(error)
            raise error
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineHTTPError(self.url, path, status, _message(data))
        return data

    # --- generation -------------------------------------------------------------------------
    async def generate(self, input_ids: Sequence[int] | Sequence[Sequence[int]],
                       sampling_params: Mapping[str, Any] | None = None, *, return_logprob: bool = False,
                       rid: str | None = None, lora_path: str | None = None,
                       timeout_s: float | None = None, **extra: Any) -> Any:
        """``POST /generate``; a dict per request (a list of them for a batch of prompts)."""
        payload: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params or {}),
                                   "return_logprob": return_logprob, **extra}
        if rid is not None:
            payload["rid"] = rid
        if lora_path is not None:
            payload["lora_path"] = lora_path
        return await self.post_generate(payload, timeout_s=timeout_s)

    async def generate_stream(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], *,
                              rid: str, lora_path: str | None = None, return_logprob: bool = True,
                              timeout_s: float | None = None) -> AsyncIterator[dict[str, Any]]:
        """A streamed ``POST /generate``: each ``data:`` chunk as a dict (SGLang's chunks are cumulative);
        ``EngineHTTPError`` on any failure, as ``request``."""
        payload: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                                   "return_logprob": return_logprob, "stream": True, "rid": rid}
        if lora_path is not None:
            payload["lora_path"] = lora_path
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with self.session.post(self.url + "/generate", json=payload, headers=self._headers,
                                         timeout=aiohttp.ClientTimeout(total=limit)) as resp:
                if resp.status >= 400:
                    raise EngineHTTPError(self.url, "/generate", resp.status, _message(_parse(await resp.read())))
                async for line in resp.content:
                    text = line.strip()
                    if not text.startswith(b"data:"):
                        continue
                    data = text[5:].strip()
                    if data == b"[DONE]":
                        return
                    chunk = _parse(data)
                    if isinstance(chunk, dict):
                        yield chunk
        except TimeoutError:
            raise EngineHTTPError(self.url, "/generate", 0, f"timed out after {limit:g}s", timed_out=True) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineHTTPError(self.url, "/generate", 0, f"{type(exc).__name__}: {exc}") from None

    async def post_generate(self, payload: Mapping[str, Any], *, timeout_s: float | None = None) -> Any:
        return await self.request("POST", "/generate", payload, timeout_s=timeout_s)

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        payload: dict[str, Any] = {"abort_all": abort_all}
        if rid is not None:
            payload["rid"] = rid
        await self.request("POST", "/abort_request", payload)

    # --- health and info ---------------------------------------------------------------------
    async def health(self, *, timeout_s: float | None = None) -> None:
        await self.request("GET", "/health", timeout_s=timeout_s)

    async def health_generate(self, *, timeout_s: float | None = None) -> None:
        """``GET /health_generate``: returns when a one-token generation ran."""
        await self.request("GET", "/health_generate", timeout_s=timeout_s)

    async def model_info(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        return _as_dict(await self.request("GET", "/model_info", timeout_s=timeout_s))

    async def weights_digest(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """``GET /weights_digest`` (the CPU engine's; SGLang has no such route): ``weight_version``, ``digest``
        of the base tensors and ``adapters`` (name -> ``{"path", "digest"}``), as of their loading."""
        return _as_dict(await self.request("GET", "/weights_digest", timeout_s=timeout_s))

    async def server_info(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        return _as_dict(await self.request("GET", "/server_info", timeout_s=timeout_s))

    async def loads(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """``GET /v1/loads``: SGLang's load snapshot (``loads[].num_running_reqs`` and ``num_waiting_reqs``)."""
        return _as_dict(await self.request("GET", "/v1/loads", timeout_s=timeout_s))

    async def models(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """``GET /v1/models``: the served model and every loaded LoRA adapter (``id`` its name, ``root`` its path)."""
        return _as_dict(await self.request("GET", "/v1/models", timeout_s=timeout_s))

    async def flush_cache(self, *, timeout_s: float | None = None) -> None:
        await self.request("POST", "/flush_cache", timeout_s=timeout_s)

    # --- weights -----------------------------------------------------------------------------
    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | int | None = None,
                                       load_format: str | None = None, abort_all_requests: bool = False,
                                       flush_cache: bool = True, timeout_s: float | None = None) -> dict[str, Any]:
        """Load new base weights. A 400 leaves the engine on its previous weights, except ``unflushed``."""
        payload: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests,
                                   "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        if load_format is not None:
            payload["load_format"] = load_format
        return _as_dict(await self.request("POST", "/update_weights_from_disk", payload, timeout_s=timeout_s))

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, *, group_name: str, backend: str,
                                        timeout_s: float | None = None) -> dict[str, Any]:
        """Join a weight-update group (SGLang's route; returns once every rank joined)."""
        payload = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                   "world_size": world_size, "group_name": group_name, "backend": backend}
        return _as_dict(await self.request("POST", "/init_weights_update_group", payload, timeout_s=timeout_s))

    async def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]], *, group_name: str,
                                              weight_version: str | int | None = None, flush_cache: bool = True,
                                              timeout_s: float | None = None) -> dict[str, Any]:
        """Receive one bucket of tensors from rank 0 of ``group_name``."""
        payload: dict[str, Any] = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                                   "group_name": group_name, "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return _as_dict(await self.request("POST", "/update_weights_from_distributed", payload, timeout_s=timeout_s))

    async def destroy_weights_update_group(self, group_name: str, *,
                                           timeout_s: float | None = None) -> dict[str, Any]:
        return _as_dict(await self.request("POST", "/destroy_weights_update_group", {"group_name": group_name},
                                           timeout_s=timeout_s))

    async def update_weight_version(self, new_version: str | int, *, abort_all_requests: bool = False,
                                    timeout_s: float | None = None) -> dict[str, Any]:
        payload = {"new_version": str(new_version), "abort_all_requests": abort_all_requests}
        return _as_dict(await self.request("POST", "/update_weight_version", payload, timeout_s=timeout_s))

    async def load_lora_adapter(self, lora_name: str, lora_path: str, *,
                                timeout_s: float | None = None) -> dict[str, Any]:
        """Load a PEFT LoRA adapter under ``lora_name`` (what ``/generate`` then names as ``lora_path``)."""
        payload = {"lora_name": lora_name, "lora_path": lora_path}
        return _as_dict(await self.request("POST", "/load_lora_adapter", payload, timeout_s=timeout_s))

    async def unload_lora_adapter(self, lora_name: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Unload an adapter; the engine finishes the requests that use it first."""
        payload = {"lora_name": lora_name}
        return _as_dict(await self.request("POST", "/unload_lora_adapter", payload, timeout_s=timeout_s))

    async def pause_generation(self, mode: str = "abort", *, timeout_s: float | None = None) -> dict[str, Any]:
        return _as_dict(await self.request("POST", "/pause_generation", {"mode": mode}, timeout_s=timeout_s))

    async def continue_generation(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        return _as_dict(await self.request("POST", "/continue_generation", {}, timeout_s=timeout_s))

    # --- memory --------------------------------------------------------------------------------
    async def release_memory_occupation(self, tags: Sequence[str] | None = None, *,
                                        timeout_s: float | None = None) -> dict[str, Any]:
        payload = {"tags": list(tags) if tags is not None else None}
        return _as_dict(await self.request("POST", "/release_memory_occupation", payload, timeout_s=timeout_s))

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None, *,
                                       timeout_s: float | None = None) -> dict[str, Any]:
        payload = {"tags": list(tags) if tags is not None else None}
        return _as_dict(await self.request("POST", "/resume_memory_occupation", payload, timeout_s=timeout_s))


def parse_version(value: Any) -> int | None:
    """An engine-reported weight version as an int; None for absent or placeholder ones ("default")."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def _parse(body: bytes) -> Any:
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")


def _fence_highest(status: int, data: Any) -> int | None:
    """The highest token of a fenced refusal: its body's ``highest`` (``{"fenced": true, "highest": N}``), or
    for an engine that only says so in words, the N of "fenced: token T is older than N"; None for any other."""
    if status != 409 or not isinstance(data, dict):
        return None
    highest = data.get("highest")
    if data.get("fenced") is True and isinstance(highest, int) and not isinstance(highest, bool) and highest >= 0:
        return highest
    said = _OLDER_THAN.match(str(data.get("message", "")))
    return int(said.group(1)) if said else None


def _message(data: Any) -> str:
    if isinstance(data, dict):
        for key in ("message", "error_message", "error", "detail"):
            value = data.get(key)
            if isinstance(value, dict):
                value = value.get("message", value)
            if value:
                return str(value)
        return json.dumps(data)[:500]
    return str(data)[:500] if data is not None else ""


def _as_dict(data: Any) -> dict[str, Any]:
    return data if isinstance(data, dict) else {"message": data}
