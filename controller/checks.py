"""Checking that engines serve the weights of the version they report.

Each CPU engine keeps the digest (``lm.files.DIGEST_ALGORITHM``) of the tensors it loaded and answers
``GET /weights_digest``. The controller compares it with the digest of the published directory of the
version the engine reports: the current target's (taken when the publication was verified), the
launch model's for the launch version, or a version directory under the weights root, checked
against its own manifest first. Adapters the controller gave an engine are compared the same way.

A mismatch (another digest, or another version than the controller gave it) takes the engine out of
the serving set (``Lifecycle.fail``: a launched engine is restarted with the published weights) after a
``WeightsChecked`` event naming the engine, the version and both digests; it is logged and counted
(``rollout_bus_controller_weight_checks``). An engine without the route (SGLang) or not serving is
``unchecked``, with the reason. Checks run after every weight update round, at every bring-up (``vet``:
before the engine serves) and on a ``CheckWeights`` command.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from rollout_bus.controller.core import Core
from rollout_bus.controller.state import EngineHandle
from rollout_bus.controller.weights import BadWeights, verify
from rollout_bus.engine.http_client import EngineHTTPError
from rollout_bus.events.errors import InvalidRequest
from rollout_bus.events.registry import EngineState, parse_adapter_name
from rollout_bus.events.schema import WeightsChecked
from rollout_bus.lm.files import WeightsError, read_manifest, tensors_digest, version_dir

log = logging.getLogger(__name__)

FailHook = Callable[[EngineHandle, str], Awaitable[None]]
NO_ROUTE = ("the engine offers no weights digest (SGLang has no route for it: see 'Checking weights' in "
            "docs/architecture.md)")


class WeightChecker:
    def __init__(self, core: Core, on_mismatch: FailHook) -> None:
        self.core = core
        self.on_mismatch = on_mismatch
        self._published: dict[tuple[str, int], str] = {}

    async def check(self, engine_ids: Sequence[str] | None = None, request_id: str = "") -> list[WeightsChecked]:
        """Check the given engines (None: every engine) at once; one ``WeightsChecked`` per engine and policy,
        each published. ``InvalidRequest`` names engines the controller does not know."""
        if engine_ids is not None:
            unknown = sorted(set(engine_ids) - set(self.core.engines))
            if unknown:
                raise InvalidRequest(f"unknown engines {unknown}; known: {sorted(self.core.engines)}")
            handles = [self.core.engines[e] for e in dict.fromkeys(engine_ids)]
        else:
            handles = list(self.core.engines.values())
        results = await asyncio.gather(*(self.check_engine(h, request_id) for h in handles))
        events = [event for events in results for event in events]
        if request_id:  # the asker waits for this one: every answer to its request came before it
            counts = {o: sum(e.outcome == o for e in events) for o in ("match", "mismatch", "unchecked")}
            await self.core.bus.weights_event(self._event(
                None, "", -1, "done", ", ".join(f"{n} {o}" for o, n in counts.items()), request_id))
        return events

    async def check_engine(self, h: EngineHandle, request_id: str = "") -> list[WeightsChecked]:
        async with self.core.operate(h):
            if h.state != EngineState.SERVING:
                pool = h.record.base_policy
                events = [self._event(h, pool, h.record.versions.get(pool, -1), "unchecked",
                                      f"engine is {h.state.value}", request_id)]
            else:
                events = await self._compare(h, request_id)
        problem = await self._report(h, events)
        if problem is not None:
            await self.on_mismatch(h, problem)
        return events

    async def vet(self, h: EngineHandle) -> str | None:
        """At bring-up, before the engine serves (the caller holds its lock): the mismatch, or None."""
        return await self._report(h, await self._compare(h, ""))

    async def _report(self, h: EngineHandle, events: list[WeightsChecked]) -> str | None:
        """Publish, count and log the answers; the reason to take the engine out of service, if any."""
        mismatches = [e for e in events if e.outcome == "mismatch"]
        for event in events:
            self.core.metrics.weight_checks.labels(event.policy, event.outcome).inc()
            await self.core.bus.weights_event(event)
            if event.outcome == "mismatch":
                log.error("engine %s: weights mismatch on %s v%d: %s", h.engine_id, event.policy, event.version,
                          event.reason)
        if not mismatches:
            return None
        if any(e.policy == h.record.base_policy for e in mismatches):  # its next bring-up loads the target
            self.core.suspect_weights.add(h.engine_id)
        return "weights mismatch: " + "; ".join(f"{e.policy} v{e.version}: {e.reason}" for e in mismatches)

    def _event(self, h: EngineHandle | None, policy: str, version: int, outcome: str, reason: str, request_id: str,
               expected: str = "", actual: str = "") -> WeightsChecked:
        event = self.core.event(WeightsChecked, engine_id=h.engine_id if h is not None else "", policy=policy, version=version,
                                outcome=outcome, expected=expected, actual=actual, reason=reason,
                                request_id=request_id)
        assert isinstance(event, WeightsChecked)
        return event

    async def _compare(self, h: EngineHandle, request_id: str) -> list[WeightsChecked]:
        pool = h.record.base_policy
        given = h.record.versions.get(pool, -1)
        try:
            info = await h.client.weights_digest(timeout_s=self.core.config.health_timeout_s)
        except EngineHTTPError as exc:
            if exc.fenced:
                raise
            reason = NO_ROUTE if exc.status == 404 else f"no digest: {exc.message}"
            return [self._event(h, pool, given, "unchecked", reason, request_id)]
        raw_version, digest = info.get("weight_version"), info.get("digest")
        if not isinstance(digest, str):
            return [self._event(h, pool, given, "unchecked", "the engine's reply names no digest", request_id)]
        try:
            reported = int(str(raw_version))
        except ValueError:
            return [self._event(h, pool, given, "mismatch", f"the engine reports version {raw_version!r}, "
                                f"the controller gave it v{given}", request_id, actual=digest)]
        if pool not in h.record.versions:  # given no version yet (a bring-up after a failed check): it may run any
            given = reported
        events = [await self._one(h, pool, given, reported, digest, request_id)]
        if events[0].outcome == "match":
            h.record.versions.setdefault(pool, reported)
        adapters = info.get("adapters")
        loaded = adapters if isinstance(adapters, dict) else {}
        for policy, name in sorted(h.record.adapters.items()):
            parsed = parse_adapter_name(name)
            if parsed is None:
                continue
            entry = loaded.get(name)
            if not isinstance(entry, dict):
                events.append(self._event(h, policy, parsed[1], "unchecked", f"adapter {name} is not loaded on the "
                                          "engine (the health round loads it again)", request_id))
                continue
            events.append(await self._one(h, policy, parsed[1], parsed[1], str(entry.get("digest") or ""),
                                          request_id))
        return events

    async def _one(self, h: EngineHandle, policy: str, given: int, reported: int, actual: str,
                   request_id: str) -> WeightsChecked:
        try:
            expected = await asyncio.to_thread(self.published_digest, policy, reported)
        except BadWeights as exc:
            if reported != given:
                return self._event(h, policy, reported, "mismatch", f"the engine reports v{reported}, the controller "
                                   f"gave it v{given} (and v{reported} is not usable: {exc.reason})", request_id,
                                   actual=actual)
            return self._event(h, policy, reported, "unchecked", f"no published digest: {exc.reason}", request_id,
                               actual=actual)
        problems = []
        if actual != expected:
            problems.append(f"the engine's digest is {actual or 'missing'}, the published one {expected}")
        if reported != given:
            problems.append(f"the engine reports v{reported}, the controller gave it v{given}")
        if problems:
            return self._event(h, policy, reported, "mismatch", "; ".join(problems), request_id, expected, actual)
        return self._event(h, policy, reported, "match", "", request_id, expected, actual)

    def published_digest(self, policy: str, version: int) -> str:
        """The digest of the published weights of ``policy`` v``version`` (blocking). ``BadWeights`` when there
        are none this controller can vouch for."""
        for target in (self.core.book.target(policy), self.core.book.good(policy)):
            if target is not None and target.version == version and target.digest:
                return target.digest
        key = (policy, version)
        if key in self._published:
            return self._published[key]
        cfg = self.core.config
        try:
            if version == cfg.initial_version and policy in self.core.pool_policies():
                digest = tensors_digest(Path(cfg.model_path))  # the launch weights
            else:
                directory = version_dir(cfg.weights_root, policy, version)
                _, sha256 = read_manifest(directory)
                digest = verify(policy, version, str(directory), sha256, Path(cfg.weights_root), None).digest
        except WeightsError as exc:
            raise BadWeights(exc.reason) from None
        self._published[key] = digest
        return digest
