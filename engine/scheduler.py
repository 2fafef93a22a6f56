"""The scheduler: one thread that owns every sequence and runs the model, one step at a time.

Each iteration runs the commands that arrived (submit, abort, pause, weight swaps, ...), admits
waiting sequences up to ``max_batch_size``, then makes one step: per weight set, a prefill for
sequences without a KV cache and a decode step for the rest. Commands only run between steps, so
a weight swap is atomic with respect to decoding. During ``--token-delay-ms`` commands keep running.

Paused (``in_place`` or ``retract``), or with ``weights``/``kv_cache`` released, the scheduler
does not step: new sequences wait in the queue until ``continue``/``resume``.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from rollout_bus.engine.errors import BadRequest, Unavailable
from rollout_bus.engine.protocol import PauseMode
from rollout_bus.engine.sampling import sample_next
from rollout_bus.engine.sequence import Seq, abort_reason, finish_reason_after
from rollout_bus.engine.weights import WeightSet, WeightStore, WeightUpdate
from rollout_bus.lm.kv_cache import KVCache
from rollout_bus.lm.model import pad_batch

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 32
    token_delay_ms: float = 0.0
    seed: int = 0
    idle_poll_s: float = 0.5


class Scheduler:
    def __init__(self, store: WeightStore, config: SchedulerConfig) -> None:
        self.store = store
        self.config = config
        # set once
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._rng = random.Random(config.seed)
        # owned by the scheduler thread
        self._waiting: deque[Seq] = deque()
        self._running: list[Seq] = []
        self._by_rid: dict[str, Seq] = {}
        # written by the scheduler thread, read anywhere
        self.paused: PauseMode | None = None
        self.released: frozenset[str] = frozenset()
        self.steps = 0
        self.flushes = 0
        self._stopping = False

    # lifecycle
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._commands.put((lambda: None, Future()))
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # thread-safe API: each call runs on the scheduler thread between steps
    def call(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        if not self.alive:
            future.set_exception(Unavailable("the engine is shutting down"))
            return future
        self._commands.put((fn, future))
        return future

    def submit(self, seqs: list[Seq]) -> Future[None]:
        return self.call(lambda: self._submit(seqs))

    def abort(self, rid: str | None, message: str, exact: bool = False) -> Future[int]:
        """Abort every sequence whose rid starts with ``rid`` (as SGLang does), only ``rid`` when
        ``exact``, or all when ``rid`` is None; the result is how many were aborted."""
        return self.call(lambda: self._abort(self._matching(rid, exact), message))

    def pause(self, mode: PauseMode) -> Future[int]:
        return self.call(lambda: self._pause(mode))

    def unpause(self) -> Future[None]:
        return self.call(self._unpause)

    def update_weights(self, update: WeightUpdate, abort_all: bool) -> Future[int]:
        """Swap in new weights between steps; the result is the number of sequences carried across."""
        return self.call(lambda: self._update(update, abort_all))

    def set_version(self, name: str, version: str, abort_all: bool) -> Future[None]:
        return self.call(lambda: self._set_version(name, version, abort_all))

    def release_memory(self, tags: tuple[str, ...]) -> Future[None]:
        return self.call(lambda: self._release(tags))

    def resume_memory(self, tags: tuple[str, ...]) -> Future[None]:
        return self.call(lambda: self._resume(tags))

    def flush_cache(self) -> Future[bool]:
        return self.call(self._flush)

    def snapshot(self) -> Future[dict[str, Any]]:
        return self.call(self._snapshot)

    # commands
    def _submit(self, seqs: list[Seq]) -> None:
        for seq in seqs:
            if seq.rid in self._by_rid:
                raise BadRequest(f"rid {seq.rid!r} is already in flight; use a unique rid per request")
        for seq in seqs:
            seed = seq.spec.seed if seq.spec.seed is not None else self._rng.getrandbits(63)
            seq.generator = torch.Generator().manual_seed(seed)
            if seq.params.max_new_tokens == 0:
                seq.finish = {"type": "length", "length": 0}
                seq.emit(self._version_of(seq))
                continue
            self._by_rid[seq.rid] = seq
            self._waiting.append(seq)

    def _matching(self, rid: str | None, exact: bool = False) -> list[Seq]:
        seqs = [*self._running, *self._waiting]
        if rid is None:
            return seqs
        return [s for s in seqs if s.rid == rid or (not exact and s.rid.startswith(rid))]

    def _abort(self, seqs: list[Seq], message: str, status_code: int | None = None) -> int:
        for seq in seqs:
            self._finish(seq, abort_reason(message, status_code))
        return len(seqs)

    def _pause(self, mode: PauseMode) -> int:
        affected = len(self._running) + len(self._waiting)
        if mode == "abort":
            self._abort(self._matching(None), "aborted by /pause_generation (mode abort)")
        elif mode == "retract":
            for seq in reversed(self._running):
                seq.cache = None
                self._waiting.appendleft(seq)
            self._running = []
        self.paused = mode
        logger.info("paused (mode %s) with %d sequence(s) in flight", mode, affected)
        return affected

    def _unpause(self) -> None:
        self.paused = None
        logger.info("continued")

    def _update(self, update: WeightUpdate, abort_all: bool) -> int:
        self.store.check(update)
        if abort_all:
            self._abort(self._matching(None), "aborted by a weight update (abort_all_requests)")
        self.store.put(update)
        return len(self._running) + len(self._waiting)

    def _set_version(self, name: str, version: str, abort_all: bool) -> None:
        self.store.set_version(name, version)
        if abort_all:
            self._abort(self._matching(None), "aborted by /update_weight_version (abort_all_requests)")

    def _release(self, tags: tuple[str, ...]) -> None:
        if "weights" in tags:
            for ws in self.store.all():
                ws.release()
        if "kv_cache" in tags:
            for seq in self._running:
                seq.cache = None
        self.released = self.released | frozenset(tags)
        logger.info("released memory %s", sorted(tags))

    def _resume(self, tags: tuple[str, ...]) -> None:
        if "weights" in tags:
            for ws in self.store.all():
                ws.resume()
        self.released = self.released - frozenset(tags)
        logger.info("resumed memory %s", sorted(tags))

    def _flush(self) -> bool:
        if self._running or self._waiting:
            return False
        self.flushes += 1
        return True

    def _snapshot(self) -> dict[str, Any]:
        return {
            "running": len(self._running),
            "queued": len(self._waiting),
            "paused": self.paused is not None,
            "pause_mode": self.paused,
            "memory_released": sorted(self.released),
            "steps": self.steps,
            "flushes": self.flushes,
            "weight_bytes": {ws.name: ws.live_bytes() for ws in self.store.all()},
            "kv_cache_bytes": sum(s.cache.nbytes() for s in self._running if s.cache is not None),
        }

    # the loop
    def _loop(self) -> None:
        logger.info("scheduler started")
        while not self._stopping:
            self._run_commands(wait_s=0.0 if self._can_step() else self.config.idle_poll_s)
            if self._stopping or not self._can_step():
                continue
            try:
                self._step()
            except Exception as exc:
                logger.exception("step failed; aborting the running sequences")
                self._abort(list(self._running), f"engine error: {exc}", status_code=500)
            if self.config.token_delay_ms > 0:
                self._run_commands_until(time.monotonic() + self.config.token_delay_ms / 1000)
        self._abort(self._matching(None), "the engine is shutting down", status_code=503)
        self._fail_pending_commands()
        logger.info("scheduler stopped")

    def _can_step(self) -> bool:
        blocked = self.paused is not None or bool(self.released & {"weights", "kv_cache"})
        return not blocked and bool(self._running or self._waiting)

    def _run_commands(self, wait_s: float) -> None:
        try:
            item = self._commands.get(timeout=wait_s) if wait_s > 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run_command(*item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_commands_until(self, deadline: float) -> None:
        while (left := deadline - time.monotonic()) > 0 and not self._stopping:
            self._run_commands(wait_s=left)

    def _run_command(self, fn: Callable[[], Any], future: Future[Any]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except Exception as exc:
            if not isinstance(exc, BadRequest):
                logger.exception("command failed")
            future.set_exception(exc)

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(Unavailable("the engine is shutting down"))

    def _step(self) -> None:
        while self._waiting and len(self._running) < self.config.max_batch_size:
            self._running.append(self._waiting.popleft())
        by_set: dict[str, list[Seq]] = defaultdict(list)
        for seq in self._running:
            by_set[seq.spec.weight_set].append(seq)
        with torch.inference_mode():
            for name, seqs in by_set.items():
                ws = self.store.get(name)
                fresh = [s for s in seqs if s.cache is None]
                warm = [s for s in seqs if s.cache is not None]
                if fresh:
                    self._prefill(ws, fresh)
                if warm:
                    self._decode(ws, warm)
        self.steps += 1

    def _prefill(self, ws: WeightSet, seqs: list[Seq]) -> None:
        ids, mask = pad_batch([s.tokens() for s in seqs], side="left", device=self.store.device)
        logits, cache = ws.model.prefill(ids, mask)
        self._advance(ws, seqs, logits[:, -1], cache.split())

    def _decode(self, ws: WeightSet, seqs: list[Seq]) -> None:
        cache = KVCache.stack([s.cache for s in seqs if s.cache is not None])
        last = torch.tensor([s.output_ids[-1] for s in seqs], device=self.store.device)
        logits, cache = ws.model.decode_step(last, cache)
        self._advance(ws, seqs, logits, cache.split())

    def _advance(self, ws: WeightSet, seqs: list[Seq], logits: torch.Tensor, caches: list[KVCache]) -> None:
        generators = [s.generator for s in seqs if s.generator is not None]
        tokens, logprobs = sample_next(logits, [s.params for s in seqs], generators)
        for seq, cache, token, logprob in zip(seqs, caches, tokens, logprobs, strict=True):
            seq.cache = cache
            seq.append(token, logprob, ws.version)
            finish = finish_reason_after(seq)
            if finish is not None:
                self._finish(seq, finish)
            elif seq.stream:
                seq.emit(ws.version)

    def _finish(self, seq: Seq, finish: dict[str, Any]) -> None:
        seq.finish = finish
        seq.cache = None
        self._by_rid.pop(seq.rid, None)
        if seq in self._running:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        seq.emit(self._version_of(seq))

    def _version_of(self, seq: Seq) -> str:
        ws = self.store.find(seq.spec.weight_set)
        return ws.version if ws is not None else "unknown"
