"""Sessions pinned to engines, and one turn's generate call with fail-over.

All turns of a session go to its pinned engine, so the engine's prefix cache serves the earlier turns. A
session without an engine (its first turn), or whose engine no longer serves its policy (dead, stopped,
drained), gets the least-loaded engine serving the policy: the load the controller's registry reports plus
this gateway's own calls in flight there. Moving re-prefills the session from its tokens on the new engine
(the whole context is sent on every turn; nothing lives only on an engine) and counts an engine switch.

A turn is one SGLang ``/generate`` with ``input_ids`` and log-probs. A transport error or a 5xx moves the
turn to another engine; an ``abort`` finish (a weight update pausing in abort mode) continues the reply
from its tokens. Every output token records the weight version that made it: the version spans the engine
reports (``meta_info.weight_versions``) or its one version, or, for a LoRA policy, the adapter's version in
its name. A version that is not a number (SGLang started without ``--weight-version`` reports
``"default"``) is the version the controller recorded for the engine in the registry, else
``UNKNOWN_VERSION`` (-1): a session never fails over a version.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_bus.engine.http_client import EngineClient, EngineHTTPError, parse_version
from rollout_bus.events.registry import EngineRecord, Registry, parse_adapter_name
from rollout_bus.events.sessions import UNKNOWN_VERSION

log = logging.getLogger(__name__)


class NoEngine(Exception):
    """No engine serves the session's policy (within the wait)."""


@dataclass
class TurnOutput:
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str = ""
    engine_id: str = ""
    cached_tokens: int = 0
    calls: int = 0
    switched: bool = False


class Pinner:
    """Engine choice for sessions, on the gateway's event loop."""

    def __init__(self, registry: Registry, *, api_key: str | None = None, refresh_s: float = 0.5,
                 wait_s: float = 30.0, call_timeout_s: float = 300.0, max_failovers: int = 4) -> None:
        self.registry = registry
        self.api_key = api_key
        self.refresh_s = refresh_s
        self.wait_s = wait_s
        self.call_timeout_s = call_timeout_s
        self.max_failovers = max_failovers
        self.in_flight: dict[str, int] = {}
        self._records: dict[str, EngineRecord] = {}
        self._checked = float("-inf")
        self._generation = -1
        self._clients: dict[str, EngineClient] = {}
        self._lock = asyncio.Lock()
        self._cooling: dict[str, float] = {}

    async def records(self, *, force: bool = False) -> dict[str, EngineRecord]:
        async with self._lock:
            now = time.monotonic()
            if force or now - self._checked > self.refresh_s:
                self._checked = now
                generation = await asyncio.to_thread(self.registry.engines_generation)
                if force or generation != self._generation:
                    self._records = await asyncio.to_thread(self.registry.engines)
                    self._generation = generation
        return self._records

    async def choose(self, policy: str, pinned: str, avoid: set[str]) -> EngineRecord:
        deadline = time.monotonic() + self.wait_s
        force = False
        while True:
            records = await self.records(force=force)
            now = time.monotonic()
            record = records.get(pinned)
            if record is not None and pinned not in avoid and record.serves(policy):
                return record
            serving = [r for r in records.values() if r.serves(policy) and r.engine_id not in avoid
                       and self._cooling.get(r.engine_id, 0.0) <= now]
            steady = [r for r in serving if policy not in r.updating] or serving
            if steady:
                return min(steady, key=lambda r: (r.load + self.in_flight.get(r.engine_id, 0), random.random()))
            if now >= deadline:
                raise NoEngine(f"no engine serves policy {policy!r} (waited {self.wait_s:.0f}s)")
            force = True
            await asyncio.sleep(0.2)

    def client(self, record: EngineRecord) -> EngineClient:
        url = record.generate_url or record.url
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = EngineClient(url, timeout_s=self.call_timeout_s, api_key=self.api_key)
        return client

    async def generate(self, policy: str, pinned: str, context: Sequence[int], params: dict[str, Any], *,
                       rid: str, on_tokens: Any = None) -> TurnOutput:
        """One turn: the reply to ``context``; ``on_tokens(ids, logprobs)`` is called as tokens arrive (a
        streamed call) or once at the end."""
        out = TurnOutput()
        avoid: set[str] = set()
        failovers = aborts = 0
        max_new = int(params.get("max_new_tokens", 128))
        while True:
            record = await self.choose(policy, pinned, avoid)
            if out.engine_id and record.engine_id != out.engine_id or pinned and record.engine_id != pinned:
                out.switched = True
            out.engine_id = pinned = record.engine_id
            lora = record.lora_path(policy)
            adapter = parse_adapter_name(lora) if lora is not None else None
            call_params = {**params, "max_new_tokens": max_new - len(out.output_ids)}
            self.in_flight[record.engine_id] = self.in_flight.get(record.engine_id, 0) + 1
            call_rid = f"{rid}.{out.calls}"
            try:
                out.calls += 1
                ids, lps, versions, finish, cached = await self._call(
                    record, [*context, *out.output_ids], call_params, call_rid, lora, on_tokens)
            except EngineHTTPError as exc:
                if exc.rejected and not exc.overloaded and not exc.unknown_adapter:
                    raise
                failovers += 1
                self._cooling[record.engine_id] = time.monotonic() + 2.0
                avoid.add(record.engine_id)
                if failovers > self.max_failovers:
                    raise
                log.warning("turn %s failed on engine %s (%s); moving the session", rid, record.engine_id, exc)
                continue
            except asyncio.CancelledError:  # the client went away: stop the engine's work too
                await self._abort(record, call_rid)
                raise
            finally:
                self.in_flight[record.engine_id] = max(self.in_flight.get(record.engine_id, 1) - 1, 0)
            if adapter is not None:
                versions = [adapter[1]] * len(ids)
            else:
                versions = known_versions(versions, record.versions.get(policy))
            if not out.output_ids:
                out.cached_tokens = cached
            out.output_ids += ids
            out.logprobs += lps
            out.versions += versions
            if finish == "abort" and len(out.output_ids) < max_new and aborts < 16:
                aborts += 1
                await asyncio.sleep(min(0.05 * aborts, 1.0))
                await self.records(force=True)
                continue
            out.finish = "length" if finish == "abort" else finish
            return out

    async def _abort(self, record: EngineRecord, rid: str) -> None:
        try:
            await asyncio.shield(self.client(record).abort_request(rid))
        except Exception as exc:  # the engine may be gone; the request dies with it
            log.info("abort of %s on %s failed: %s", rid, record.engine_id, exc)

    async def _call(self, record: EngineRecord, ids: list[int], params: dict[str, Any], rid: str,
                    lora: str | None, on_tokens: Any) -> tuple[list[int], list[float], list[int], str, int]:
        client = self.client(record)
        if on_tokens is None:
            reply = await client.generate(ids, params, return_logprob=True, rid=rid, lora_path=lora,
                                          timeout_s=self.call_timeout_s)
            return read_reply(reply)
        last: Any = None
        sent = 0
        async for chunk in client.generate_stream(ids, params, rid=rid, lora_path=lora,
                                                  timeout_s=self.call_timeout_s):
            last = chunk
            got = chunk.get("output_ids") or []
            entries = (chunk.get("meta_info") or {}).get("output_token_logprobs") or []
            if len(got) > sent and len(entries) >= len(got):
                await on_tokens(list(got[sent:]), [float(e[0]) for e in entries[sent:len(got)]])
                sent = len(got)
        if last is None:
            raise EngineHTTPError(client.url, "/generate", 502, "the stream ended without a reply")
        return read_reply(last)


def known_versions(versions: list[int], recorded: int | None) -> list[int]:
    """``versions`` with each unknown one (a version string that is no number) as the registry's
    ``recorded`` version of the engine, where it has one."""
    if recorded is None or recorded < 0:
        return versions
    return [recorded if v == UNKNOWN_VERSION else v for v in versions]


def read_reply(reply: Any) -> tuple[list[int], list[float], list[int], str, int]:
    """Output ids, log-probs, per-token versions, finish reason and cached prompt tokens of a reply."""
    if not isinstance(reply, dict) or not isinstance(reply.get("meta_info"), dict):
        raise EngineHTTPError("", "/generate", 502, f"a reply without meta_info: {str(reply)[:200]}")
    meta = reply["meta_info"]
    ids = reply.get("output_ids")
    entries = meta.get("output_token_logprobs")
    if not isinstance(ids, list) or not isinstance(entries, list) or len(entries) != len(ids):
        raise EngineHTTPError("", "/generate", 502, "a reply without output_ids and as many log-probs")
    finish_reason = meta.get("finish_reason")
    finish = finish_reason.get("type") if isinstance(finish_reason, dict) else None
    if finish not in ("stop", "length", "abort"):
        raise EngineHTTPError("", "/generate", 502, f"a reply with finish_reason {finish_reason!r}")
    base = parse_version(meta.get("weight_version"))
    versions = [base if base is not None and base >= 0 else UNKNOWN_VERSION] * len(ids)
    for span in meta.get("weight_versions") or []:
        if isinstance(span, dict):
            v = parse_version(span.get("version"))
            start, end = span.get("start"), span.get("end")
            if v is not None and v >= 0 and isinstance(start, int) and isinstance(end, int):
                for i in range(max(start, 0), min(end, len(ids))):
                    versions[i] = v
    cached = meta.get("cached_tokens")
    return ([int(i) for i in ids], [float(e[0]) for e in entries], versions, str(finish),
            int(cached) if isinstance(cached, int) else 0)
