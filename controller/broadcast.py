"""Full weights by collective (``--weight-sync broadcast``): the controller drives SGLang's three routes.

A trainer that offers a version by collective names its rendezvous store and bucket plan in
``WeightsPublished`` (``trainer.broadcast``); the version is verified from its directory as always
(manifest, digests, shapes), and the offer is checked too (an address ``host:port``, a backend, a plan
that sends every tensor of the directory once). A round then pushes the version to the engines that
lag, together, under every engine's lock:

1. pause each (the configured mode; with ``broadcast_pause`` ``swap``, only before the last bucket: the
   CPU engine stages what it receives, so it serves the old weights meanwhile);
2. the group: one per policy, kept open across versions while its members (the engines, in order) and
   the trainer's address stay the same. Otherwise the old one is destroyed on the engines that had it
   and a new one opened: ``WeightBroadcastRequested`` (``new_group``) tells the trainer to join as rank 0
   while ``/init_weights_update_group`` goes to every engine at once (ranks 1..N, world size 1 + N);
3. with a group open, ``WeightBroadcastRequested`` asks the trainer for the version, and each bucket of
   the plan goes to every engine at once (``/update_weights_from_distributed``, the version as
   ``weight_version``, the cache flushed with the last one unless the pause is ``in_place``). An engine
   stages what it receives and swaps the whole set in only with the last bucket;
4. anything failing in 2 or 3 (an engine gone, the trainer gone, a group that times out, an engine that
   refuses a bucket) breaks the group: it is destroyed on every engine still there (which drops what
   they staged: each serves the old version or the new one, never a mix) and forgotten, so the next round
   opens a new one; the version is then delivered by disk (``/update_weights_from_disk``) to the engines
   that did not take it, under the same pause;
5. continue each; the outcomes are recorded as for a disk update (``WeightsApplied`` per engine, then
   the announcement and the digest check).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_bus.controller.core import Core
from rollout_bus.controller.state import EngineHandle
from rollout_bus.controller.versions import Target
from rollout_bus.engine.http_client import EngineHTTPError
from rollout_bus.events.registry import EngineState
from rollout_bus.events.schema import WeightBroadcastRequested
from rollout_bus.lm.buckets import TORCH_DTYPE_NAMES, plan_problems
from rollout_bus.lm.files import Shapes, WeightsError, tensor_shapes

log = logging.getLogger(__name__)

GROUP_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class OpenGroup:
    name: str
    address: str
    backend: str
    members: tuple[str, ...]
    """Engine ids, rank 1.. in this order."""


class BroadcastFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def split_address(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def offer_problem(target: Target, shapes: Shapes) -> str | None:
    """Why ``target``'s offer by collective cannot be used (None: it can)."""
    if split_address(target.group_address) is None:
        return f"group address {target.group_address[:80]!r} is not host:port"
    if target.group_backend not in GROUP_BACKENDS:
        return f"group backend {target.group_backend[:20]!r} is not one of {list(GROUP_BACKENDS)}"
    problems = plan_problems([list(b) for b in target.buckets], shapes)
    if problems:
        return "the bucket plan does not send the version's tensors once each: " + "; ".join(problems)
    unknown = sorted({dtype for dtype, _ in shapes.values()} - set(TORCH_DTYPE_NAMES))
    if unknown:
        return f"dtypes {unknown} cannot travel by collective"
    return None


Outcome = tuple[str, str]
"""(status, reason) of one engine: ``applied``, ``rejected`` or ``failed``."""


class WeightBroadcast:
    """The weight-update groups of the controller's pools, one per policy (see the module docstring)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.groups: dict[str, OpenGroup] = {}
        self.fallbacks = 0
        """Versions delivered by disk after a broadcast broke (since start)."""
        self.last_pauses: dict[str, float] = {}
        """Seconds each engine of the last push was paused: from the pause call until it continued."""
        self._serial = itertools.count(1)
        self._tag = os.urandom(3).hex()

    def takes(self, target: Target) -> bool:
        return self.core.config.weight_sync == "broadcast" and target.kind == "full" and bool(target.group_address)

    async def push_all(self, target: Target, engines: list[EngineHandle]) -> dict[str, Outcome]:
        """Deliver ``target`` to ``engines`` (locked): by collective, else by disk; outcome per engine id.

        ``broadcast_pause`` ``before``: every engine is paused before the first bucket (what a real SGLang
        engine needs: it loads each bucket as it arrives). ``swap``: the engines stage (the CPU engine does),
        so they keep serving the old weights while every bucket but the last arrives, and are paused for the
        last one, which swaps the whole set in; a failure before the pause breaks the group as any other."""
        shapes = await asyncio.to_thread(_shapes, target)
        problem = offer_problem(target, shapes) if shapes is not None else "the version's tensors are unreadable"
        cfg = self.core.config
        outcomes: dict[str, Outcome] = {}
        early = cfg.broadcast_pause == "swap" and problem is None and len(target.buckets) > 1
        broken = False
        if early:
            assert shapes is not None
            try:
                await self._broadcast(target, engines, shapes, last=False)
            except BroadcastFailed as exc:
                await self._break(target.policy, engines, exc.reason)
                broken = True
        paused: list[EngineHandle] = []
        paused_at: dict[str, float] = {}
        self.last_pauses = {}

        async def pause(h: EngineHandle) -> None:
            paused_at[h.engine_id] = time.perf_counter()
            try:
                await h.client.pause_generation(cfg.pause_mode, timeout_s=cfg.request_timeout_s)
                paused.append(h)
            except EngineHTTPError as exc:
                outcomes[h.engine_id] = ("failed", f"{exc.path}: {exc.message}")
        await asyncio.gather(*(pause(h) for h in engines))
        paused.sort(key=lambda h: engines.index(h))
        if early and not broken and len(paused) < len(engines):  # a member missing: the last bucket cannot go
            await self._break(target.policy, paused, "an engine of the group did not pause")
            broken = True
        if paused:
            if problem is None and not broken:
                assert shapes is not None
                try:
                    await self._broadcast(target, paused, shapes, first=not early)
                    outcomes.update({h.engine_id: ("applied", "") for h in paused})
                except BroadcastFailed as exc:
                    await self._break(target.policy, paused, exc.reason)
            elif problem is not None:
                log.warning("%s v%d: not by collective (%s); by disk", target.policy, target.version, problem)
            rest = [h for h in paused if h.engine_id not in outcomes]
            if rest:
                results = await asyncio.gather(*(self._disk(h, target) for h in rest))
                outcomes.update({h.engine_id: o for h, o in zip(rest, results, strict=True)})
            await asyncio.gather(*(self._finish(h, target, outcomes) for h in paused))
            self.last_pauses = {h.engine_id: time.perf_counter() - paused_at[h.engine_id] for h in paused}
        return outcomes

    # --- the collective ----------------------------------------------------------------------------
    async def _broadcast(self, target: Target, engines: list[EngineHandle], shapes: Shapes, *, first: bool = True,
                         last: bool = True) -> None:
        """The group (opened if new) and the request, with ``first``; every bucket but the last, then the last
        one (with ``last``)."""
        cfg = self.core.config
        limit = cfg.group_timeout_s + cfg.request_timeout_s
        if first:
            group, new = self._group_for(target, engines)
            if new:
                await self._close(target.policy)
            await self.core.bus.weights_event(self.core.event(
                WeightBroadcastRequested, policy=target.policy, version=target.version, group_name=group.name,
                world_size=len(group.members) + 1, new_group=new))
            if new:
                host, port = split_address(group.address) or ("", 0)
                await self._all(engines, "opening the group", lambda i, h: h.client.init_weights_update_group(
                    host, port, i + 1, len(engines) + 1, group_name=group.name, backend=group.backend,
                    timeout_s=limit))
                self.groups[target.policy] = group
        group = self.groups[target.policy]
        flush = cfg.pause_mode != "in_place"
        count = len(target.buckets)
        indices = range(0 if first else count - 1, count if last else count - 1)
        for index in indices:
            names = list(target.buckets[index])
            dtypes = [TORCH_DTYPE_NAMES[shapes[n][0]] for n in names]
            dims = [list(shapes[n][1]) for n in names]
            await self._all(engines, f"bucket {index + 1} of {count}", functools.partial(
                _send_bucket, names, dtypes, dims, group.name, target.version, flush and index == count - 1, limit))

    def _group_for(self, target: Target, engines: list[EngineHandle]) -> tuple[OpenGroup, bool]:
        members = tuple(h.engine_id for h in engines)
        current = self.groups.get(target.policy)
        if current is not None and (current.members, current.address, current.backend) == (
                members, target.group_address, target.group_backend):
            return current, False
        name = f"{target.policy}-w{self._tag}-{next(self._serial)}"[:64]
        return OpenGroup(name, target.group_address, target.group_backend, members), True

    async def _all(self, engines: list[EngineHandle], what: str,
                   call: Callable[[int, EngineHandle], Awaitable[Any]]) -> None:
        """``call(rank_index, h)`` on every engine at once (each runs to its end); ``BroadcastFailed`` naming
        every engine that failed."""
        async def one(i: int, h: EngineHandle) -> str | None:
            try:
                await call(i, h)
            except EngineHTTPError as exc:
                return f"{h.engine_id}: {exc.message}"
            return None
        failures = [f for f in await asyncio.gather(*(one(i, h) for i, h in enumerate(engines))) if f]
        if failures:
            raise BroadcastFailed(f"{what} failed on {'; '.join(failures)}")

    async def _break(self, policy: str, engines: list[EngineHandle], reason: str) -> None:
        """The group is broken: destroy it on every engine still there, forget it, count the fallback."""
        self.fallbacks += 1
        self.core.metrics.weight_update_failures.labels(policy, "broadcast").inc()
        log.warning("broadcast of %s failed (%s): destroying the group, delivering by disk", policy, reason)
        group = self.groups.pop(policy, None)
        name = group.name if group is not None else None
        if name is None:
            return
        await asyncio.gather(*(self._destroy(h, name) for h in engines))

    async def _close(self, policy: str) -> None:
        """Destroy the policy's open group on its members that still run (the members changed)."""
        group = self.groups.pop(policy, None)
        if group is None:
            return
        handles = {h.engine_id: h for h in self.core.members(policy)}
        await asyncio.gather(*(self._destroy(handles[e], group.name) for e in group.members if e in handles
                               and handles[e].state != EngineState.STOPPED))

    async def _destroy(self, h: EngineHandle, name: str) -> None:
        with contextlib.suppress(EngineHTTPError):  # gone, or it never joined: nothing to destroy there
            await h.client.destroy_weights_update_group(name, timeout_s=self.core.config.request_timeout_s)

    # --- the fallback and the end ------------------------------------------------------------------
    async def _disk(self, h: EngineHandle, target: Target) -> Outcome:
        cfg = self.core.config
        try:
            await h.client.update_weights_from_disk(target.engine_path, weight_version=target.version,
                                                    flush_cache=cfg.pause_mode != "in_place",
                                                    timeout_s=cfg.update_timeout_s)
        except EngineHTTPError as exc:
            if exc.unflushed:
                await h.client.update_weight_version(target.version, abort_all_requests=False,
                                                     timeout_s=cfg.request_timeout_s)
                return "applied", ""
            return ("rejected" if exc.rejected else "failed"), exc.message
        return "applied", ""

    async def _finish(self, h: EngineHandle, target: Target, outcomes: dict[str, Outcome]) -> None:
        """After the load: under an ``in_place`` pause retract and flush (as a disk update), then continue."""
        cfg = self.core.config
        try:
            if cfg.pause_mode == "in_place" and outcomes[h.engine_id][0] == "applied":
                await h.client.pause_generation("retract", timeout_s=cfg.request_timeout_s)
                await h.client.flush_cache(timeout_s=cfg.request_timeout_s)
            await h.client.continue_generation(timeout_s=cfg.request_timeout_s)
        except EngineHTTPError as exc:
            outcomes[h.engine_id] = ("failed", f"{exc.path}: {exc.message}")


async def _send_bucket(names: list[str], dtypes: list[str], dims: list[list[int]], group: str, version: int,
                       flush: bool, limit: float, _rank_index: int, h: EngineHandle) -> None:
    await h.client.update_weights_from_distributed(names, dtypes, dims, group_name=group, weight_version=version,
                                                   flush_cache=flush, timeout_s=limit)


def _shapes(target: Target) -> Shapes | None:
    try:
        return tensor_shapes(Path(target.engine_path))
    except (WeightsError, OSError):
        return None
