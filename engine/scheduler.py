"""The scheduler: one thread that owns every sequence and runs the model, one step at a time.

Each iteration runs the commands that arrived (submit, abort, pause, weight swaps, adapters, ...),
admits waiting sequences up to ``max_batch_size``, then makes one step on the served model's
decode batch: a decode step for the sequences already in it and a prefill for new ones, which then
join it; a new one whose first tokens are in the prefix cache (``engine.prefix_cache``: finished
sequences' KV) prefills only the rest. Every row picks its adapter (or the base weights) in the same
forward. Commands only run between steps, so a weight swap is atomic with respect to decoding. During
a step's delay (``--token-delay-ms`` plus ``--token-delay-per-seq-ms`` per sequence in the step:
``step_delay_s``) commands keep running.

Paused (``in_place`` or ``retract``), or with ``weights``/``kv_cache`` released, the scheduler
does not step: new sequences wait in the queue until ``continue``/``resume``. The checks SGLang's
scheduler makes are answered here as clear refusals: releasing memory while sequences run, resuming
a tag never released, and flushing the cache after a weight load while an ``in_place`` pause holds
sequences (the weights are loaded, the reported version stays). Every change of the weights, version,
adapters or memory drops the prefix cache, whatever else it does.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from rollout_bus.engine.args import DEFAULT_PREFIX_CACHE_TOKENS
from rollout_bus.engine.errors import BadRequest, Overloaded, Unavailable
from rollout_bus.engine.prefix_cache import Layers, PrefixCache
from rollout_bus.engine.protocol import PauseMode
from rollout_bus.engine.sampling import sample_next
from rollout_bus.engine.sequence import Seq, abort_reason, finish_reason_after
from rollout_bus.engine.served import ServedModel, WeightUpdate, release_freed_memory
from rollout_bus.engine.waiting import WaitQueue

logger = logging.getLogger(__name__)
T = TypeVar("T")

RELEASE_BUSY = "release_memory_occupation should be called only when server is idle."
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
           "requests, the operation will not be performed.)\n")
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 32
    token_delay_ms: float = 0.0
    token_delay_per_seq_ms: float = 0.0
    """The step's delay grows by this for every sequence in it (see ``step_delay_s``)."""
    seed: int = 0
    idle_poll_s: float = 0.5
    max_queued_seqs: int = 16384
    """Most sequences waiting for a batch slot; a submit that would pass it is refused whole (429)."""
    prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS
    """Token budget of the prefix cache (finished sequences' KV reused by later prompts); 0 turns it off."""


@dataclass(frozen=True)
class UpdateOutcome:
    carried: int
    flushed: bool


def step_delay_s(config: SchedulerConfig, rows: int) -> float:
    """The time an accelerator would spend on a step of ``rows`` sequences, as a cost model.

    ``token_delay_ms + token_delay_per_seq_ms * rows``: a decode step reads every weight once
    whatever the batch (the fixed part) and each sequence's KV cache and activations (the part
    that grows with the batch), so a fuller batch is cheaper per token but never free. With
    ``token_delay_per_seq_ms`` 0 the step costs the same at any batch size.
    """
    ms = config.token_delay_ms + config.token_delay_per_seq_ms * rows
    return ms / 1000 if ms > 0 else 0.0


class Scheduler:
    def __init__(self, model: ServedModel, config: SchedulerConfig) -> None:
        self.model = model
        self.config = config
        # set once
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._rng = random.Random(config.seed)
        # owned by the scheduler thread
        self._waiting = WaitQueue()
        self._running: list[Seq] = []
        self._by_rid: dict[str, Seq] = {}
        self._batch = model.new_batch()
        self._unloading: dict[str, list[Future[None]]] = {}
        self.prefix_cache = PrefixCache(config.prefix_cache_tokens) if config.prefix_cache_tokens > 0 else None
        self.prefilled_tokens = 0  # tokens prefills were asked to cover, and those the prefix cache covered
        self.cached_tokens = 0
        self.unloading: frozenset[str] = frozenset()  # the names above, replaced whole (read by HTTP)
        # written by the scheduler thread, read anywhere
        self.paused: PauseMode | None = None
        self.released: frozenset[str] = frozenset()
        self.steps = 0
        self._last_step_rows = 0
        self.flushes = 0
        self.counts = (0, 0)  # running, waiting
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

    def usable_adapters(self) -> frozenset[str]:
        """Adapters a new request may name: loaded and not being unloaded."""
        return frozenset(self.model.adapter_paths()) - self.unloading

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
        """Abort as SGLang does: every sequence when ``rid`` is None; else nothing unless ``rid`` is in
        flight, then it and every rid that starts with it (only ``rid`` when ``exact``, in O(1))."""
        return self.call(lambda: self._abort(self._matching(rid, exact), message))

    def abort_seqs(self, seqs: list[Seq], message: str) -> Future[int]:
        """Abort those of ``seqs`` still in flight (a request whose client went away), in one command
        costing O(1) per sequence."""
        return self.call(lambda: self._abort([s for s in seqs if self._by_rid.get(s.rid) is s], message))

    def pause(self, mode: PauseMode) -> Future[int]:
        return self.call(lambda: self._pause(mode))

    def unpause(self) -> Future[None]:
        return self.call(self._unpause)

    def update_weights(self, update: WeightUpdate, abort_all: bool, flush_cache: bool) -> Future[UpdateOutcome]:
        return self.call(lambda: self._update(update, abort_all, flush_cache))

    def set_version(self, version: str, abort_all: bool) -> Future[None]:
        return self.call(lambda: self._set_version(version, abort_all))

    def release_memory(self, tags: tuple[str, ...]) -> Future[None]:
        return self.call(lambda: self._release(tags))

    def resume_memory(self, tags: tuple[str, ...]) -> Future[None]:
        return self.call(lambda: self._resume(tags))

    def load_adapter(self, name: str, path: str, digest: str = "") -> Future[None]:
        return self.call(lambda: self._load_adapter(name, path, digest))

    def unload_adapter(self, name: str) -> Future[Future[None]]:
        """The outer future resolves at once (accepted or refused); the inner one once the adapter is
        gone, which waits for the sequences using it to finish (no new request may use it meanwhile)."""
        return self.call(lambda: self._unload_adapter(name))

    def flush_cache(self) -> Future[tuple[bool, int, int]]:
        """Drop the prefix cache when idle (as SGLang's ``flush_cache``): (done, running, waiting)."""
        return self.call(self._flush)

    @property
    def cache_hit_rate(self) -> float:
        """Share of the prompt tokens to prefill that the prefix cache served."""
        return self.cached_tokens / self.prefilled_tokens if self.prefilled_tokens else 0.0

    def snapshot(self) -> Future[dict[str, Any]]:
        return self.call(self._snapshot)

    # commands
    def _submit(self, seqs: list[Seq]) -> None:
        cap = self.config.max_queued_seqs
        if len(self._waiting) + len(seqs) > cap:
            raise Overloaded(f"the queue is full: {len(self._waiting)} sequence(s) wait and this request adds "
                             f"{len(seqs)}, over --max-queued-seqs {cap}; retry later or send fewer")
        usable = self.usable_adapters()
        for seq in seqs:
            if seq.rid in self._by_rid:
                raise BadRequest(f"rid {seq.rid!r} is already in flight; use a unique rid per request")
            if seq.spec.lora is not None and seq.spec.lora not in usable:
                raise BadRequest(f"Got LoRA adapter that has never been loaded: {seq.spec.lora}\n"
                                 f"All loaded adapters: {sorted(usable)}.")
        for seq in seqs:
            seed = seq.spec.seed if seq.spec.seed is not None else self._rng.getrandbits(63)
            seq.generator = torch.Generator().manual_seed(seed)
            if seq.params.max_new_tokens == 0:
                seq.finish = {"type": "length", "length": 0}
                seq.emit(self.model.version)
                continue
            self._by_rid[seq.rid] = seq
            self._waiting.append(seq)
        self._count()

    def _matching(self, rid: str | None, exact: bool = False) -> list[Seq]:
        if rid is None:
            return [*self._running, *self._waiting]
        if rid not in self._by_rid:
            return []
        if exact:
            return [self._by_rid[rid]]
        return [s for s in (*self._running, *self._waiting) if s.rid.startswith(rid)]

    def _abort(self, seqs: list[Seq], message: str, status_code: int | None = None) -> int:
        for seq in seqs:
            self._finish(seq, abort_reason(message, status_code))
        return len(seqs)

    def _pause(self, mode: PauseMode) -> int:
        affected = len(self._running) + len(self._waiting)
        if mode == "abort":
            self._abort(self._matching(None), "aborted by /pause_generation (mode abort)")
        elif mode == "retract":
            self._retract()
        self.paused = mode
        logger.info("paused (mode %s) with %d sequence(s) in flight", mode, affected)
        return affected

    def _retract(self) -> None:
        """Running sequences back to the head of the queue; their KV goes to the prefix cache (as SGLang's
        retraction does), so that resuming prefills only their last token unless a flush comes first."""
        for seq in reversed(self._running):
            if seq.in_batch:
                self._keep_prefix(seq)
            seq.in_batch = False
            seq.retractions += 1
            self._waiting.appendleft(seq)
        self._running = []
        self._batch.clear()
        self._count()

    def _unpause(self) -> None:
        self.paused = None
        logger.info("continued")

    def _busy(self) -> bool:
        """Not idle as SGLang's scheduler sees it: sequences running, or waiting while not paused."""
        return bool(self._running) or (bool(self._waiting) and self.paused is None)

    def _update(self, update: WeightUpdate, abort_all: bool, flush_cache: bool) -> UpdateOutcome:
        if abort_all:
            self._abort(self._matching(None), "aborted by a weight update (abort_all_requests)")
        # SGLang flushes after loading: refused while an in_place pause holds sequences. Unpaused, it
        # waits for running requests first (here they carry on with the new weights and report spans).
        flushed = not flush_cache or not (self.paused == "in_place" and self._busy())
        self._drop_prefix_cache(f"weights from {update.source}")  # whatever flush_cache says: no stale KV is reused
        if flushed:
            self.model.apply_update(update)
        else:
            self.model.apply_update(update, announce=False)
            logger.warning("weights loaded from %s, cache not flushed: the version stays %s", update.source,
                           self.model.version)
        return UpdateOutcome(len(self._running) + len(self._waiting), flushed)

    def _set_version(self, version: str, abort_all: bool) -> None:
        if abort_all:
            self._abort(self._matching(None), "aborted by /update_weight_version (abort_all_requests)")
        if version != self.model.version:
            self._drop_prefix_cache(f"version {version}")
        self.model.set_version(version)

    def _release(self, tags: tuple[str, ...]) -> None:
        if self._busy():
            raise BadRequest(f"{RELEASE_BUSY} {len(self._running)} running and {len(self._waiting)} waiting; "
                             "pause generation (mode retract or abort) first")
        self._drop_prefix_cache(f"memory release {sorted(tags)}")  # first: its KV is freed with the rest
        if "weights" in tags:
            self.model.release()
        if "kv_cache" in tags:
            self._retract()
            release_freed_memory(self.model.device)
        self.released = self.released | frozenset(tags)
        logger.info("released memory %s", sorted(tags))

    def _resume(self, tags: tuple[str, ...]) -> None:
        never = [t for t in tags if t not in self.released]
        if never:
            raise BadRequest(f"cannot resume {never}: never released (released: {sorted(self.released)})")
        if "weights" in tags:
            self.model.resume()
        self.released = self.released - frozenset(tags)
        logger.info("resumed memory %s", sorted(tags))

    def _load_adapter(self, name: str, path: str, digest: str) -> None:
        if name in self.model.adapter_paths():
            raise BadRequest(f"Failed to load LoRA adapter {name} because it is already loaded")
        self._drop_prefix_cache(f"adapter {name} loaded")
        self.model.attach_adapter(name, path, digest)

    def _unload_adapter(self, name: str) -> Future[None]:
        if name not in self.model.adapter_paths():
            raise BadRequest(f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(self.model.adapter_paths())}")
        done: Future[None] = Future()
        self._unloading.setdefault(name, []).append(done)
        self.unloading = frozenset(self._unloading)
        self._finish_unloads()
        return done

    def _finish_unloads(self) -> None:
        if not self._unloading:
            return
        in_use = {s.spec.lora for s in (*self._running, *self._waiting)}
        for name in [n for n in self._unloading if n not in in_use]:
            waiters = self._unloading.pop(name)
            self.unloading = frozenset(self._unloading)
            self._drop_prefix_cache(f"adapter {name} unloaded")
            try:
                self.model.detach_adapter(name)
            except Exception as exc:
                logger.exception("unloading adapter %s failed", name)
                for w in waiters:
                    w.set_exception(exc)
            else:
                for w in waiters:
                    w.set_result(None)

    def _flush(self) -> tuple[bool, int, int]:
        if self._busy():
            return False, len(self._running), len(self._waiting)
        self.flushes += 1
        self._drop_prefix_cache("/flush_cache")
        return True, 0, len(self._waiting)

    # the prefix cache
    def _drop_prefix_cache(self, why: str) -> None:
        """Drop every cached prefix; a sequence prefilled before this is not cached when it ends."""
        if self.prefix_cache is not None:
            dropped = self.prefix_cache.flush()
            if dropped:
                logger.info("prefix cache flushed (%s): %d entries dropped", why, dropped)

    def _namespace(self, seq: Seq) -> tuple[str, str | None]:
        return self.model.version, seq.spec.lora

    def _cached_prefixes(self, seqs: list[Seq]) -> list[Layers | None] | None:
        """The cached KV each new sequence starts with (never its last token: its logits are needed)."""
        cache = self.prefix_cache
        for seq in seqs:
            self.prefilled_tokens += len(seq.tokens())
        if cache is None:
            return None
        prefixes: list[Layers | None] = []
        for seq in seqs:
            tokens = seq.tokens()
            hit = cache.match(self._namespace(seq), tokens, len(tokens) - 1)
            seq.cache_generation = cache.generation
            seq.prefix_source = None if hit is None else hit.entry
            if hit is None or hit.length == 0:
                prefixes.append(None)
                continue
            seq.cached_tokens += hit.length
            self.cached_tokens += hit.length
            prefixes.append(hit.layers())
        return prefixes

    def _keep_prefix(self, seq: Seq) -> None:
        """Put a finished row's KV in the prefix cache (unless a flush came since its prefill)."""
        cache = self.prefix_cache
        tokens = seq.tokens()[:-1]
        if cache is None or seq.cache_generation is None or not cache.accepts(len(tokens), seq.cache_generation):
            return
        layers = self._batch.row_kv(seq)
        if layers is None or int(layers[0][0].shape[2]) != len(tokens):
            logger.warning("sequence %s: its KV does not cover its tokens; not cached", seq.rid)
            return
        cache.insert(self._namespace(seq), tokens, layers, generation=seq.cache_generation, replaces=seq.prefix_source)

    def _count(self) -> None:
        self.counts = (len(self._running), len(self._waiting))

    def _snapshot(self) -> dict[str, Any]:
        return {
            "running": len(self._running),
            "queued": len(self._waiting),
            "paused": self.paused is not None,
            "pause_mode": self.paused,
            "memory_released": sorted(self.released),
            "steps": self.steps,
            "flushes": self.flushes,
            "weight_bytes": self.model.live_bytes(),
            "kv_cache_bytes": self._batch.nbytes(),
            "prefix_cache": None if self.prefix_cache is None else self.prefix_cache.snapshot(),
            "adapters": sorted(self.model.adapter_paths()),
            "unloading": sorted(self.unloading),
        }

    # the loop
    def _loop(self) -> None:
        logger.info("scheduler started")
        while not self._stopping:
            self._finish_unloads()  # right after a step, in which the last user of an adapter may have ended
            self._run_commands(wait_s=0.0 if self._can_step() else self.config.idle_poll_s)
            if self._stopping or not self._can_step():
                continue
            try:
                self._step()
            except Exception as exc:
                logger.exception("step failed; aborting the running sequences")
                self._batch.clear()
                self._abort(list(self._running), f"engine error: {exc}", status_code=500)
            delay_s = step_delay_s(self.config, self._last_step_rows)
            if delay_s > 0:
                self._run_commands_until(time.monotonic() + delay_s)
        self._abort(self._matching(None), "the engine is shutting down", status_code=503)
        for waiters in self._unloading.values():
            for waiter in waiters:
                waiter.set_exception(Unavailable("the engine is shutting down"))
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

    def _admit(self) -> None:
        adapters = {s.spec.lora for s in self._running if s.spec.lora is not None}
        skipped: list[Seq] = []
        while self._waiting and len(self._running) < self.config.max_batch_size:
            seq = self._waiting.popleft()
            lora = seq.spec.lora
            if lora is not None and lora not in adapters and len(adapters) >= self.model.lora.max_per_batch:
                skipped.append(seq)  # --max-loras-per-batch: waits for a batch with room for its adapter
                continue
            if lora is not None:
                adapters.add(lora)
            self._running.append(seq)
        self._waiting.extendleft(skipped)

    def _step(self) -> None:
        self._admit()
        warm = [s for s in self._running if s.in_batch]
        fresh = [s for s in self._running if not s.in_batch]
        self._batch.keep(warm)
        with torch.inference_mode():
            if self._batch.rows:
                rows = list(self._batch.rows)
                self._advance(rows, self._batch.decode())
            if fresh:
                logits = self._batch.prefill(fresh, self._cached_prefixes(fresh))
                for seq in fresh:
                    seq.in_batch = True
                self._advance(fresh, logits)
        self.steps += 1
        self._last_step_rows = len(warm) + len(fresh)
        self._count()

    def _advance(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        generators = [s.generator for s in seqs if s.generator is not None]
        tokens, logprobs, failed = sample_next(logits, [s.params for s in seqs], generators)
        version = self.model.version
        codec = self.model.codec
        for row, (seq, token, logprob) in enumerate(zip(seqs, tokens, logprobs, strict=True)):
            if row in failed:  # only this sequence ends; the others of the step go on
                logger.warning("sequence %s: %s", seq.rid, failed[row])
                self._finish(seq, abort_reason(failed[row], status_code=500))
                continue
            seq.append(token, logprob, version)
            finish = finish_reason_after(seq, codec)
            if finish is not None:
                self._finish(seq, finish)
            elif seq.stream:
                seq.emit(version)

    def _finish(self, seq: Seq, finish: dict[str, Any]) -> None:
        if seq.in_batch and finish["type"] != "abort":
            self._keep_prefix(seq)
        seq.finish = finish
        seq.in_batch = False
        self._by_rid.pop(seq.rid, None)
        if seq in self._running:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        seq.emit(self.model.version)
        self._count()
