"""Weights by collective, in SGLang's contract: a process group per ``group_name``, buckets broadcast into it.

``/init_weights_update_group`` joins the group ``group_name`` of ``world_size`` ranks as rank
``rank_offset`` (this engine runs one rank): rank 0, the sender, hosts the rendezvous store at
``master_address:master_port`` and every group lives under its own prefix of it, as SGLang's
``init_custom_process_group`` does. ``gloo`` carries CPU tensors; ``nccl`` needs CUDA. Each group
has the engine's ``--dist-timeout``: a rank that never comes, or stops mid-way, fails the call after
it instead of hanging the engine.

``/update_weights_from_distributed`` names a bucket (``names``, ``dtypes``, ``shapes``): each name must
be a tensor of the served model with that shape and dtype, or nothing is received. The tensors are
received from rank 0 (``broadcast``) into fresh memory, checked finite, digested (its lines of
``lm.hf.state_digest``) and staged: the served weights
do not change until every tensor of the model has arrived for the same ``weight_version``, and then
all of them are swapped in at once by the scheduler, between two steps (``WeightsStaged.complete``).
A failed or refused bucket drops what was staged, so no engine ever serves a half-updated set; a
bucket for another version or group than the staged one starts a new stage. Destroying the group
drops its stage too.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rollout_bus.engine.errors import BadRequest
from rollout_bus.engine.served import check_tensors
from rollout_bus.lm.files import Shapes, combine_digest
from rollout_bus.lm.hf import SAFETENSORS_DTYPES, state_lines

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


def parse_dtype(name: str) -> torch.dtype:
    """``bfloat16`` or ``torch.bfloat16`` (SGLang takes ``getattr(torch, name)``) as a torch dtype."""
    value = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise BadRequest(f"dtype {name!r} is not a torch dtype (send e.g. 'float32' or 'bfloat16')")
    return value


@dataclass
class Group:
    name: str
    rank: int
    world_size: int
    backend: str
    store: Any = field(repr=False)
    pg: Any = field(repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


@dataclass
class Stage:
    group: str
    version: str | None
    tensors: dict[str, Tensor] = field(default_factory=dict, repr=False)
    lines: dict[str, bytes] = field(default_factory=dict, repr=False)
    """Each staged tensor's line of the digest, taken as it arrived."""


@dataclass(frozen=True)
class WeightsStaged:
    """What a bucket left: how many of the model's tensors are staged, and all of them once ``complete``."""

    received: int
    staged: int
    total: int
    state: dict[str, Tensor] | None = field(default=None, repr=False)
    digest: str = ""
    """``lm.hf.state_digest`` of ``state`` (built from each bucket's lines as they arrived)."""

    @property
    def complete(self) -> bool:
        return self.state is not None


class WeightGroups:
    """This engine's weight-update groups and the one stage of weights being received (HTTP worker threads)."""

    def __init__(self, reference: Shapes, device: torch.device, timeout_s: float) -> None:
        self.reference = reference
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._groups: dict[str, Group] = {}
        self._stage: Stage | None = None
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._groups)

    # --- groups ---------------------------------------------------------------------------------
    def open(self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
             backend: str) -> Group:
        """Join the group (blocks until every rank joined, at most the timeout); ``BadRequest`` says why not."""
        if not group_name:
            raise BadRequest("group_name must not be empty")
        if backend not in BACKENDS:
            raise BadRequest(f"backend {backend!r} is not one of {list(BACKENDS)}")
        if backend == "nccl" and self.device.type != "cuda":
            raise BadRequest("backend 'nccl' needs an engine on CUDA; this one runs on "
                             f"{self.device.type}: use backend 'gloo'")
        if world_size < 2 or not 1 <= rank_offset < world_size:
            raise BadRequest(f"rank_offset {rank_offset} must lie in 1..world_size-1 (world_size {world_size}, "
                             "rank 0 is the sender)")
        if not 0 < master_port < 65536:
            raise BadRequest(f"master_port {master_port} is not a port")
        with self._lock:
            if group_name in self._groups:
                raise BadRequest(f"weight update group {group_name!r} is already open: destroy it first")
        try:
            store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=self.timeout)
            prefixed = dist.PrefixStore(group_name, store)
            if backend == "gloo":
                pg: Any = dist.ProcessGroupGloo(prefixed, rank_offset, world_size, self.timeout)
            else:  # pragma: no cover - needs CUDA
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self.timeout
                pg = dist.ProcessGroupNCCL(prefixed, rank_offset, world_size, options)
        except Exception as exc:  # noqa: BLE001  # a store or a rank that never came: the group is not open
            raise BadRequest(f"could not join weight update group {group_name!r} at {master_address}:{master_port} "
                             f"as rank {rank_offset} of {world_size}: {type(exc).__name__}: {exc}") from None
        group = Group(group_name, rank_offset, world_size, backend, store, pg)
        with self._lock:
            self._groups[group_name] = group
        logger.info("joined weight update group %s (%s) as rank %d of %d", group_name, backend, rank_offset,
                    world_size)
        return group

    def destroy(self, group_name: str) -> None:
        with self._lock:
            group = self._groups.pop(group_name, None)
            if self._stage is not None and self._stage.group == group_name:
                self._stage = None
        if group is None:
            raise BadRequest(f"no weight update group {group_name!r} is open")
        logger.info("left weight update group %s", group_name)

    # --- buckets --------------------------------------------------------------------------------
    def receive(self, group_name: str, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                version: str | None) -> WeightsStaged:
        """Receive one bucket from rank 0 and stage it (blocking); the whole state once every tensor is staged."""
        try:
            return self._receive(group_name, names, dtypes, shapes, version)
        except BaseException:
            self.discard(f"a bucket of group {group_name!r} failed")
            raise

    def discard(self, why: str) -> None:
        with self._lock:
            if self._stage is not None and self._stage.tensors:
                logger.warning("dropping %d staged tensors (%s)", len(self._stage.tensors), why)
            self._stage = None

    def _receive(self, group_name: str, names: Sequence[str], dtypes: Sequence[str],
                 shapes: Sequence[Sequence[int]], version: str | None) -> WeightsStaged:
        with self._lock:
            group = self._groups.get(group_name)
        if group is None:
            raise BadRequest(f"no weight update group {group_name!r} is open: call /init_weights_update_group first")
        buffers = self._buffers(names, dtypes, shapes, group.backend)
        with group.lock:
            try:
                works = [group.pg.broadcast(tensor, 0) for tensor in buffers.values()]
                for work in works:
                    work.wait()
            except Exception as exc:  # noqa: BLE001  # a rank gone, a timeout: nothing of this bucket is kept
                raise BadRequest(f"receiving {len(buffers)} tensors in group {group_name!r} failed: "
                                 f"{type(exc).__name__}: {exc}") from None
        if group.backend == "nccl":  # pragma: no cover - needs CUDA
            torch.cuda.synchronize(self.device)
        problems = check_tensors({n: self.reference[n] for n in buffers}, buffers)
        if problems:
            raise BadRequest(f"received weights do not fit the served model: {'; '.join(problems)}")
        lines = state_lines(buffers)
        with self._lock:
            stage = self._stage
            if stage is None or (stage.group, stage.version) != (group_name, version):
                if stage is not None and stage.tensors:
                    logger.warning("dropping %d staged tensors of version %s: a bucket of version %s began",
                                   len(stage.tensors), stage.version, version)
                stage = self._stage = Stage(group_name, version)
            stage.tensors.update(buffers)
            stage.lines.update(lines)
            staged = len(stage.tensors)
            if staged < len(self.reference):
                return WeightsStaged(len(buffers), staged, len(self.reference))
            self._stage = None
        return WeightsStaged(len(buffers), staged, len(self.reference), stage.tensors, combine_digest(stage.lines))

    def _buffers(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                 backend: str) -> dict[str, Tensor]:
        """Fresh tensors for a bucket, after checking every name, dtype and shape against the served model."""
        if not names:
            raise BadRequest("names must list at least one tensor")
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest(f"names, dtypes and shapes must have one entry per tensor (got {len(names)}, "
                             f"{len(dtypes)} and {len(shapes)})")
        if len(set(names)) != len(names):
            raise BadRequest("names lists a tensor twice")
        device = self.device if backend == "nccl" else torch.device("cpu")
        out: dict[str, Tensor] = {}
        for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
            if not isinstance(name, str):
                raise BadRequest(f"names must be strings, got {name!r}")
            known = self.reference.get(name)
            if known is None:
                raise BadRequest(f"{name!r} is not a tensor of the served model")
            dtype = parse_dtype(dtype_name)
            if SAFETENSORS_DTYPES.get(dtype) != known[0]:
                raise BadRequest(f"{name}: dtype {dtype_name}, the served model's is {known[0]}")
            if not isinstance(shape, list | tuple) or not all(isinstance(d, int) and not isinstance(d, bool)
                                                                for d in shape):
                raise BadRequest(f"{name}: shape must be a list of integers, got {shape!r}")
            if tuple(shape) != tuple(known[1]):
                raise BadRequest(f"{name}: shape {list(shape)}, the served model's is {list(known[1])}")
            out[name] = torch.empty(tuple(shape), dtype=dtype, device=device)
        return out
