"""The trainer as rank 0 of its policy's weight-update groups (``--weight-sync broadcast``).

``WeightSender`` hosts the rendezvous store (a ``torch.distributed.TCPStore`` at ``host:port``, a
free port unless one is set) and holds the tensors of the newest version saved, exactly as written
to its directory (names, dtypes and bytes of the files, so an engine that receives them reports the
directory's digest). ``WeightsPublished`` names the store (``group_address``) and the bucket plan
(``lm.buckets``). The trainer talks to engines only through the collective: a thread follows the
weight stream for the controller's ``WeightBroadcastRequested`` for this policy, joins the group it
names (once: a group stays open across versions until the controller names another), and broadcasts
every bucket of the version, tensor by tensor, in the plan's order, while the controller drives the
engines' routes. A request for another version than the one held, or a group that does not form or
breaks within ``timeout_s``, is logged and dropped: the controller then delivers the version from its
directory. LoRA adapters are not offered (they travel by disk: they are small).

The sender holds the newest ``keep`` versions offered, not only the newest: in async training a
trainer often saves the next version before the controller's request for the previous one arrives,
and a request the sender cannot serve costs the engines a group that never forms (``timeout_s``)
before the disk fallback. A request for version v also drops every version older than v: the
controller only moves forward.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rollout_bus.events.connection import Guard, Redis
from rollout_bus.events.names import NAME_PATTERN, Keys
from rollout_bus.events.paging import stream_entries
from rollout_bus.events.schema import WeightBroadcastRequested, decode
from rollout_bus.lm.buckets import DEFAULT_BUCKET_BYTES, bucket_plan
from rollout_bus.lm.files import ADAPTER_CONFIG_FILE, tensor_shapes
from rollout_bus.lm.hf import SAFETENSORS_DTYPES, read_state

log = logging.getLogger(__name__)

MAX_WORLD_SIZE = 4096


@dataclass
class Offer:
    version: int
    tensors: dict[str, Tensor] = field(repr=False)
    plan: list[list[str]]
    entry_id: str = ""


@dataclass
class SentVersion:
    version: int
    group_name: str
    tensors: int
    seconds: float


class WeightSender:
    """Rank 0 of the weight-update groups of one policy (see the module docstring)."""

    def __init__(self, client: Redis, keys: Keys, policy: str, *, host: str = "127.0.0.1", port: int = 0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 60.0, backend: str = "gloo",
                 keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1 (the newest version), got {keep}")
        self.client = client
        self.keys = keys
        self.policy = policy
        self.host = host
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, None, True, timeout=self.timeout, wait_for_workers=False)
        self.address = f"{host}:{self.store.port}"
        self.guard = Guard(client, name=f"weight sender {policy}")
        self.sent: list[SentVersion] = []
        """Versions broadcast so far (newest last)."""
        self.failures: list[str] = []
        self.keep = keep
        self._offers: dict[int, Offer] = {}
        """Versions held, oldest first (at most ``keep``)."""
        self._group: tuple[str, Any] | None = None
        self._lock = threading.Lock()
        self._cursor = "0"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._answered: set[int] = set()
        """Versions whose request this sender handled, sent or not."""

    # --- what is offered ---------------------------------------------------------------------------
    def offer(self, version: int, model: Any, directory: Path) -> list[list[str]] | None:
        """Hold ``version``'s tensors as saved in ``directory`` (taken from ``model`` where its state has them
        in the saved dtype, else read back from the files); return the bucket plan. None for an adapter."""
        if (directory / ADAPTER_CONFIG_FILE).is_file():
            return None
        shapes = tensor_shapes(directory)
        state = model.state_dict() if model is not None else {}
        tensors: dict[str, Tensor] = {}
        for name, (dtype, shape) in shapes.items():
            tensor = state.get(name)
            if tensor is None or SAFETENSORS_DTYPES.get(tensor.dtype) != dtype or tuple(tensor.shape) != shape:
                tensors = {}
                break
            device = tensor.device if self.backend == "nccl" else torch.device("cpu")
            tensors[name] = tensor.detach().to(device, copy=True).contiguous()
        if not tensors:
            tensors = read_state(directory)
        plan = bucket_plan(shapes, self.bucket_bytes)
        with self._lock:
            self._offers.pop(version, None)
            self._offers[version] = Offer(version, tensors, plan)
            while len(self._offers) > self.keep:
                del self._offers[next(iter(self._offers))]
        return plan

    def held(self) -> list[int]:
        """The versions held, oldest first."""
        with self._lock:
            return list(self._offers)

    def offered(self, version: int) -> bool:
        with self._lock:
            return version in self._offers

    def plan(self, version: int) -> list[list[str]]:
        with self._lock:
            offer = self._offers.get(version)
            return [list(b) for b in offer.plan] if offer is not None else []

    def published(self, version: int, entry_id: str) -> None:
        """``WeightsPublished`` of ``version`` went out as ``entry_id``: requests for it come after it."""
        with self._lock:
            offer = self._offers.get(version)
            if offer is not None:
                offer.entry_id = entry_id
            if self._cursor == "0":
                self._cursor = entry_id

    # --- the thread ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"weight-sender-{self.policy}", daemon=True)
            self._thread.start()

    def pending(self) -> bool:
        """The newest offered version was published and no request for it has been handled yet."""
        with self._lock:
            offer = self._offers[next(reversed(self._offers))] if self._offers else None
            return offer is not None and offer.entry_id != "" and offer.version not in self._answered

    def stop(self, timeout_s: float = 5.0, drain_s: float = 0.0) -> None:
        """Stop the thread; first, for up to ``drain_s``, let it answer the request for the newest published
        version (the controller asks right after it accepts the ``WeightsPublished``), so a trainer's last
        version goes by collective too instead of falling back to disk when the trainer exits."""
        deadline = time.monotonic() + drain_s
        while self._thread is not None and self._thread.is_alive() and self.pending() \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._group = None

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                waiting = self._cursor == "0"
            if waiting:  # nothing published yet: no request can be for this sender
                self._stop.wait(0.05)
                continue
            try:
                self.poll(block_ms=500)
            except Exception:  # noqa: BLE001  # the sender must outlive one bad look at the stream
                log.exception("weight sender of %s: reading the weight stream failed", self.policy)
                self._stop.wait(1.0)

    def poll(self, block_ms: int = 0) -> None:
        """Handle every ``WeightBroadcastRequested`` for this policy since the last look."""
        with self._lock:
            cursor = self._cursor
        reply: Any = self.guard.call(partial(_xread, stream=self.keys.weight_stream(self.policy), after=cursor, block_ms=block_ms))
        for _, entry_id, fields in stream_entries(reply):
            with self._lock:
                self._cursor = entry_id
            try:
                event = decode(fields)
            except Exception:  # noqa: BLE001  # not ours to judge: other readers report bad entries
                continue
            if isinstance(event, WeightBroadcastRequested) and event.policy == self.policy:
                self.serve(event)

    def serve(self, request: WeightBroadcastRequested) -> bool:
        """Join the requested group if new, and broadcast the requested version; False when it was not sent."""
        try:
            return self._serve(request)
        finally:
            with self._lock:
                self._answered.add(request.version)

    def _serve(self, request: WeightBroadcastRequested) -> bool:
        problem = self._request_problem(request)
        with self._lock:
            offer = self._offers.get(request.version)
            held = list(self._offers)
            for version in held:  # the controller only moves forward: older versions are never asked again
                if version < request.version:
                    del self._offers[version]
        if problem is None and offer is None:
            problem = (f"v{request.version} is not among the versions held "
                       f"({', '.join(f'v{v}' for v in held) or 'none'}): the controller delivers it by disk")
        if problem is not None:
            log.warning("weight sender of %s: not sending (%s)", self.policy, problem)
            self.failures.append(problem)
            return False
        assert offer is not None
        started = time.perf_counter()
        try:
            pg = self._join(request)
            for index in range(len(offer.plan)):
                self.send_bucket(pg, offer, index)
        except Exception as exc:  # noqa: BLE001  # a rank gone, a timeout: the group is broken, disk delivers
            self._group = None
            reason = f"broadcast of v{request.version} in {request.group_name} failed: {type(exc).__name__}: {exc}"
            log.warning("weight sender of %s: %s", self.policy, reason)
            self.failures.append(reason)
            return False
        seconds = time.perf_counter() - started
        self.sent.append(SentVersion(request.version, request.group_name, len(offer.tensors), seconds))
        log.info("broadcast %s v%d in %s (%d tensors, %.2fs)", self.policy, request.version, request.group_name,
                 len(offer.tensors), seconds)
        return True

    def send_bucket(self, pg: Any, offer: Offer, index: int) -> None:
        """Broadcast bucket ``index`` of ``offer``, tensor by tensor (what each receiver's call takes in)."""
        works = [pg.broadcast(offer.tensors[name], 0) for name in offer.plan[index]]
        for work in works:
            work.wait()

    def _request_problem(self, request: WeightBroadcastRequested) -> str | None:
        if not NAME_PATTERN.fullmatch(request.group_name):
            return f"group name {request.group_name[:80]!r} is not a safe name"
        if not 2 <= request.world_size <= MAX_WORLD_SIZE:
            return f"world size {request.world_size} outside 2..{MAX_WORLD_SIZE}"
        if not request.new_group and (self._group is None or self._group[0] != request.group_name):
            return f"group {request.group_name} is not open here (this sender never joined it)"
        return None

    def _join(self, request: WeightBroadcastRequested) -> Any:
        if self._group is not None and self._group[0] == request.group_name and not request.new_group:
            return self._group[1]
        self._group = None
        prefixed = dist.PrefixStore(request.group_name, self.store)
        if self.backend == "nccl":  # pragma: no cover - needs CUDA
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            pg: Any = dist.ProcessGroupNCCL(prefixed, 0, request.world_size, options)
        else:
            pg = dist.ProcessGroupGloo(prefixed, 0, request.world_size, self.timeout)
        self._group = (request.group_name, pg)
        log.info("joined weight update group %s as rank 0 of %d", request.group_name, request.world_size)
        return pg


def _xread(c: Redis, *, stream: str, after: str, block_ms: int, count: int = 64) -> Any:
    return c.xread({stream: after}, count=count, block=block_ms if block_ms > 0 else None)
