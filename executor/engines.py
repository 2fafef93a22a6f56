"""Routing generate calls to the engines serving a policy, and failing over when one breaks.

The router reads the controller's registry (a snapshot refreshed every ``refresh_s``) and
picks, among the engines *serving* the policy, the one with the least load: the load the
registry reports plus this executor's own calls in flight there. Engines of the eval pool
(``EngineRecord.evaluates``) serve eval requests alone: a training call never takes one, and an
eval call takes one whenever one serves the policy. Engines whose weights
are being updated for the policy (``updating``) are used only when no other engine
serves it; an engine that failed a call is left alone for ``cooldown_s``.

``EngineCaller.generate`` is one logical generate call. A policy that is not an engine's
base policy is a LoRA adapter: the call names it with ``lora_path`` (the adapter name the
registry gives, ``<policy>@v<version>``), and the version of the tokens it makes is the one
in that name (SGLang reports only the base weights' version). It retries on another engine
after a connection error, timeout, 5xx, or a 400 for an adapter the engine no longer has
(a stale registry snapshot after an adapter swap); after an ``abort`` finish (a pause in abort
mode during a weight update) it continues the partial response from its tokens (miles'
partial rollout) or, with ``partial_rollout`` off, starts the response again. With pause
modes ``in_place`` and ``retract`` the engine holds requests in flight, so the call
simply waits. ``$ROLLOUT_BUS_ENGINE_API_KEY`` is sent as a bearer token to every engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rollout_bus.engine.http_client import EngineClient, EngineHTTPError, parse_version
from rollout_bus.events.registry import EngineRecord, Registry, parse_adapter_name
from rollout_bus.executor.errors import EngineRejected, EnginesFailed, NoServingEngine
from rollout_bus.executor.sample import Generation

ENGINE_API_KEY_ENV = "ROLLOUT_BUS_ENGINE_API_KEY"

log = logging.getLogger(__name__)


@dataclass
class RouterConfig:
    refresh_s: float = 0.5
    """How often a call asks whether the registry changed (its generation) and re-reads it if so."""
    max_age_s: float = 10.0
    """The snapshot is re-read at least this often, changed or not."""
    cooldown_s: float = 2.0
    """How long an engine that failed a call is skipped."""
    wait_poll_s: float = 0.2
    """Poll interval while no engine serves the policy."""
    call_timeout_s: float = 120.0
    max_failovers: int = 8
    """Failed engine calls one logical generate call may take before the request is retried by rq."""
    max_aborts: int = 16
    partial_rollout: bool = True
    api_key: str | None = field(default_factory=lambda: os.environ.get(ENGINE_API_KEY_ENV) or None)
    """SGLang's ``--api-key`` of the engines, sent as a bearer token."""


class EngineTime:
    """Wall time during which at least one engine call is in flight (the union of the calls)."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.calls = 0
        self._in_flight = 0
        self._since = 0.0

    @contextmanager
    def call(self) -> Iterator[None]:
        if self._in_flight == 0:
            self._since = time.perf_counter()
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1
            self.calls += 1
            if self._in_flight == 0:
                self.busy_s += time.perf_counter() - self._since


class EngineRouter:
    """Chooses an engine per call; lives on the executor's event loop."""

    def __init__(self, registry: Registry, config: RouterConfig | None = None) -> None:
        self.registry = registry
        self.config = config or RouterConfig()
        self.in_flight: dict[str, int] = {}
        self._cooling: dict[str, float] = {}
        self._records: list[EngineRecord] = []
        self._read_at = float("-inf")
        self._checked_at = float("-inf")
        self._generation = -1
        self._lock = asyncio.Lock()
        self._clients: dict[str, EngineClient] = {}
        self.starved_since: dict[str, float] = {}
        """Per policy: since when calls wait because no engine serves it (cleared when one does)."""

    async def snapshot(self, *, force: bool = False) -> list[EngineRecord]:
        """The engine records, re-read only when the registry's generation moved (one ``HGET`` every
        ``refresh_s``; every record only after a write), or at least every ``max_age_s``."""
        async with self._lock:
            now = time.monotonic()
            if force or now - self._checked_at > self.config.refresh_s:
                self._checked_at = now
                generation = await asyncio.to_thread(self.registry.engines_generation)
                if force or generation != self._generation or now - self._read_at > self.config.max_age_s:
                    records = await asyncio.to_thread(self.registry.engines)
                    self._records = list(records.values())
                    self._read_at, self._generation = now, generation
        return self._records

    def choose(self, records: Sequence[EngineRecord], policy: str, avoid: set[str], *,
               evaluating: bool = False) -> EngineRecord | None:
        """The engine for one call: a training call never takes an eval engine (``EngineRecord.evaluates``);
        an eval call takes only eval engines while any is registered for the policy (it waits for one that is
        updating), else any engine."""
        now = time.monotonic()
        serving = [r for r in records if r.serves(policy) and self._cooling.get(r.engine_id, 0.0) <= now]
        if evaluating:  # the eval engines while any is registered for the policy (even mid-update or still
            # launching: one of its base pool with no weights yet counts), else any
            own = any(r.evaluates and (policy in r.versions or r.base_policy == policy) for r in records)
            serving = [r for r in serving if r.evaluates] if own else serving
        else:
            serving = [r for r in serving if not r.evaluates]
        fresh = [r for r in serving if r.engine_id not in avoid] or serving
        steady = [r for r in fresh if policy not in r.updating] or fresh
        if not steady:
            return None
        return min(steady, key=lambda r: (r.load + self.in_flight.get(r.engine_id, 0), random.random()))

    async def acquire(self, policy: str, *, deadline: float | None, avoid: set[str],
                      evaluating: bool = False) -> EngineRecord:
        """An engine for one call (its in-flight count taken); waits up to ``deadline`` (monotonic)."""
        started = time.monotonic()
        record = self.choose(await self.snapshot(), policy, avoid, evaluating=evaluating)
        if record is None:
            self.starved_since.setdefault(policy, started)
        while record is None:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise NoServingEngine(f"no engine served policy {policy!r} within the deadline "
                                      f"(waited {now - started:.1f}s)")
            pause = self.config.wait_poll_s if deadline is None else min(self.config.wait_poll_s, deadline - now)
            await asyncio.sleep(max(pause, 0.0))
            record = self.choose(await self.snapshot(force=True), policy, avoid, evaluating=evaluating)
        self.starved_since.pop(policy, None)
        self.in_flight[record.engine_id] = self.in_flight.get(record.engine_id, 0) + 1
        return record

    def release(self, engine_id: str) -> None:
        self.in_flight[engine_id] = max(self.in_flight.get(engine_id, 1) - 1, 0)

    def failed(self, engine_id: str) -> None:
        self._cooling[engine_id] = time.monotonic() + self.config.cooldown_s
        self.refresh_soon()

    def refresh_soon(self) -> None:
        """Re-read the registry on the next call."""
        self._read_at = float("-inf")

    def client(self, record: EngineRecord) -> EngineClient:
        """The client for the engine's ``/generate`` (straight to SGLang when it sits behind a guard)."""
        url = record.generate_url or record.url
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = EngineClient(url, timeout_s=self.config.call_timeout_s,
                                                       api_key=self.config.api_key)
        return client


class EngineCaller:
    """One logical ``/generate`` with fail-over and abort handling."""

    def __init__(self, router: EngineRouter) -> None:
        self.router = router
        self.config = router.config

    async def generate(self, policy: str, input_ids: Sequence[int], sampling_params: dict[str, Any], *,
                       rid: str, deadline: float | None, timer: EngineTime, evaluating: bool = False) -> Generation:
        max_new = int(sampling_params.get("max_new_tokens", 1))
        out_ids: list[int] = []
        log_probs: list[float] = []
        versions: set[int] = set()
        engines: list[str] = []
        avoid: set[str] = set()
        calls = failovers = aborts = 0
        while True:
            record = await self.router.acquire(policy, deadline=deadline, avoid=avoid, evaluating=evaluating)
            params = {**sampling_params, "max_new_tokens": max_new - len(out_ids)}
            timeout = self.config.call_timeout_s
            if deadline is not None:
                # a little past the deadline, so that the request's own deadline fires first
                timeout = max(min(timeout, deadline - time.monotonic() + 1.0), 0.001)
            lora_path = record.lora_path(policy)
            try:
                with timer.call():
                    reply = await self.router.client(record).generate(
                        [*input_ids, *out_ids], params, return_logprob=True, rid=f"{rid}.{calls}",
                        lora_path=lora_path, timeout_s=timeout)
                ids, lps, finish, seen = parse_reply(reply)
            except EngineHTTPError as exc:
                if lora_path is not None and exc.unknown_adapter and failovers < self.config.max_failovers:
                    failovers += 1  # an adapter swapped since the snapshot: read the registry again
                    self.router.refresh_soon()
                    await asyncio.sleep(min(0.05 * failovers, 0.5))
                    continue
                if exc.rejected and not exc.overloaded:
                    raise EngineRejected(f"engine {record.engine_id} rejected a generate call: {exc}") from None
                failovers = self._failed_over(record, rid, failovers, exc, avoid)
                continue
            except ValueError as exc:  # a reply we cannot read: treat the engine as broken
                failovers = self._failed_over(record, rid, failovers, exc, avoid)
                continue
            finally:
                self.router.release(record.engine_id)
                calls += 1
            adapter = parse_adapter_name(lora_path) if lora_path is not None else None
            if adapter is not None:
                seen = {adapter[1]}  # the engine reports its base version; the adapter's is in its name
            elif not seen and record.versions.get(policy, -1) >= 0:
                seen = {record.versions[policy]}  # a version that is no number (SGLang's "default"): the registry's
            if record.engine_id not in engines:
                engines.append(record.engine_id)
            if finish == "abort":
                aborts += 1
                if self.config.partial_rollout:
                    out_ids, log_probs, versions = out_ids + ids, log_probs + lps, versions | seen
                else:
                    out_ids, log_probs, versions = [], [], set()
                if len(out_ids) >= max_new:
                    finish = "length"
                elif aborts <= self.config.max_aborts:
                    # paused for a weight update: give the registry a moment to show it, then go on
                    await asyncio.sleep(min(0.05 * aborts, 1.0))
                    self.router.refresh_soon()
                    continue
            else:
                out_ids, log_probs, versions = out_ids + ids, log_probs + lps, versions | seen
            return Generation(out_ids, log_probs, finish, sorted(versions), engines, calls=calls,
                              failovers=failovers, aborts=aborts)

    def _failed_over(self, record: EngineRecord, rid: str, failovers: int, exc: Exception, avoid: set[str]) -> int:
        """Note a failed call (the engine cools down, this call avoids it); ``EnginesFailed`` past the limit."""
        failovers += 1
        self.router.failed(record.engine_id)
        avoid.add(record.engine_id)
        if failovers > self.config.max_failovers:
            raise EnginesFailed(f"generate {rid} failed {failovers} times, last on {record.engine_id}: {exc}")
        log.warning("generate %s failed on engine %s (%s); trying another engine", rid, record.engine_id, exc)
        return failovers


def parse_reply(reply: Any) -> tuple[list[int], list[float], str, set[int]]:
    """Output ids, their log-probs, the finish reason and the weight versions of a ``/generate`` reply."""
    if not isinstance(reply, dict) or not isinstance(reply.get("meta_info"), dict):
        raise ValueError(f"generate reply without meta_info: {str(reply)[:200]}")
    meta = reply["meta_info"]
    ids = reply.get("output_ids")
    entries = meta.get("output_token_logprobs")
    if not isinstance(ids, list) or not isinstance(entries, list) or len(entries) != len(ids):
        raise ValueError("generate reply needs output_ids and as many output_token_logprobs")
    log_probs = [float(e[0]) for e in entries]
    finish_reason = meta.get("finish_reason")
    finish = finish_reason.get("type") if isinstance(finish_reason, dict) else None
    if finish not in ("stop", "length", "abort"):
        raise ValueError(f"generate reply with finish_reason {finish_reason!r}")
    versions: set[int] = set()
    for value in [meta.get("weight_version"), *(s.get("version") for s in meta.get("weight_versions") or []
                                                 if isinstance(s, dict))]:
        parsed = parse_version(value)
        if parsed is not None:
            versions.add(parsed)
    return [int(i) for i in ids], log_probs, str(finish), versions
