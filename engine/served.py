"""The model an engine serves: base weights with a version, LoRA adapters by name, decode batches.

``ServedModel`` holds what the tiny LM (``engine.tiny_model``) and Hugging Face models
(``engine.hf_model``) share: vetting and applying base-weight updates (names, shapes, dtypes and
finiteness against the tensors the engine was launched with, checked off the scheduler thread),
releasing and resuming weight memory (for real: the base tensors are freed and the allocator's free
pages go back to the system; they are read again from the served version's files on resume), and
LoRA adapters through ``peft`` (several in one forward,
one per row). Only the scheduler thread mutates it; the HTTP side reads names and versions under a
lock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import logging
import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rollout_bus.engine.codec import Codec
from rollout_bus.engine.errors import BadRequest
from rollout_bus.engine.prefix_cache import Layers
from rollout_bus.lm.files import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    CONFIG_FILE,
    Shapes,
    WeightsError,
    adapter_problems,
    file_shapes,
    tensors_digest,
)
from rollout_bus.lm.hf import parameters_by_name, read_state, state_digest

logger = logging.getLogger(__name__)

BASE_ROW = "__base__"  # peft's name for rows without an adapter in a mixed batch
IGNORED_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache",
                                 "architectures", "pad_token_id"})


@dataclass(frozen=True)
class WeightUpdate:
    """Vetted base weights read from ``source``; ``version`` None keeps the served version."""

    state: dict[str, Tensor] = field(repr=False)
    version: str | None
    source: str
    digest: str = ""
    """``lm.hf.state_digest`` of ``state``: what ``/weights_digest`` reports once the tensors are in."""
    collective: bool = False
    """Received through a weight-update group (``engine.weight_sync``), not read from ``source``: the reported
    path stays, and the weights have no files to be read back from after a release."""


@dataclass(frozen=True)
class LoraLimits:
    enabled: bool = False
    max_rank: int | None = None
    target_modules: frozenset[str] | None = None
    max_per_batch: int = 8


class DecodeBatch(ABC):
    """Rows decoded together on one KV cache. Invariant: the cache covers each row's tokens but its
    last output token, which the next ``decode`` feeds."""

    rows: list[Any]

    @abstractmethod
    def decode(self) -> Tensor:
        """One step for every row (in ``rows`` order): logits ``[len(rows), vocab]``."""

    @abstractmethod
    def prefill(self, seqs: Sequence[Any], prefixes: Sequence[Layers | None] | None = None) -> Tensor:
        """Run new sequences' token lists, add them to the batch; logits of their last tokens.

        ``prefixes[i]``, when given, is the KV of the first tokens of ``seqs[i]`` (per layer, keys and
        values ``[1, heads, n, head_dim]``, from the prefix cache): only the tokens after them are run."""

    @abstractmethod
    def row_kv(self, seq: Any) -> Layers | None:
        """A row's cached keys and values (its ``tokens()[:-1]``), copied out of the batch, per layer
        ``[1, heads, n, head_dim]``; None when ``seq`` is not a row."""

    @abstractmethod
    def keep(self, seqs: Sequence[Any]) -> None:
        """Drop every row not in ``seqs`` (finished, aborted, retracted)."""

    @abstractmethod
    def clear(self) -> None: ...

    @abstractmethod
    def nbytes(self) -> int: ...


def prefix_lengths(prefixes: Sequence[Layers | None] | None, rows: int) -> list[int]:
    """Tokens each row's prefix holds (0 without one)."""
    if prefixes is None:
        return [0] * rows
    return [0 if p is None else int(p[0][0].shape[2]) for p in prefixes]


class ServedModel(ABC):
    kind: str
    model_type: str
    architectures: list[str]

    def __init__(self, base: nn.Module, reference: Shapes, codec: Codec, *, max_seq_len: int,
                 device: torch.device, version: str, source: str, lora: LoraLimits) -> None:
        self.base = base
        self.peft: Any = None
        self.reference = reference
        self.codec = codec
        self.max_seq_len = max_seq_len
        self.device = device
        self.version = version
        self.source = source
        self.served_name: str | None = None  # after a weight update: its path, as SGLang reports
        self.lora = lora
        self.adapters: dict[str, str] = {}
        self.digest = tensors_digest(Path(source))
        """The digest (``lm.files.DIGEST_ALGORITHM``) of the base tensors last copied in: the launch weights'
        files, then each update's tensors as read (``WeightUpdate.digest``)."""
        self.adapter_digests: dict[str, str] = {}
        self.reload_from: str | None = None
        self.collective = False
        """The base weights came through a weight-update group: ``source`` no longer holds them."""
        """While the weights are released: the files ``resume`` reads them back from (None: not released)."""
        self._live = parameters_by_name(base, reference)
        with torch.no_grad():  # every weight in storage of its own, as ``resume`` will put it back
            for tensor in _unique(self._live.values()):
                if tensor.numel() and tensor.data_ptr() % WEIGHT_ALIGNMENT:
                    tensor.data = _own_copy(tensor.data, tensor.dtype, device)
        self._lock = threading.Lock()

    # --- what the HTTP side reads -----------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.codec.vocab_size

    def adapter_paths(self) -> dict[str, str]:
        with self._lock:
            return dict(self.adapters)

    def digests(self) -> tuple[str, str, dict[str, dict[str, str]]]:
        """The served version, the base tensors' digest and, per loaded adapter, its path and digest."""
        with self._lock:
            adapters = {name: {"path": path, "digest": self.adapter_digests.get(name, "")}
                        for name, path in self.adapters.items()}
            return self.version, self.digest, adapters

    @property
    def released(self) -> bool:
        return self.reload_from is not None

    @abstractmethod
    def new_batch(self) -> DecodeBatch: ...

    def config_problems(self, directory: Path) -> list[str]:
        """How the ``config.json`` in ``directory`` differs from the served one (none when absent)."""
        return []

    # --- running ------------------------------------------------------------------------------
    def forward(self, names: Sequence[str | None], **inputs: Any) -> Any:
        """The model on a batch whose row ``i`` uses adapter ``names[i]`` (None: the base weights)."""
        if self.peft is None:
            return self.base(**inputs)
        if all(n is None for n in names):
            with self.peft.disable_adapter():
                return self.peft(**inputs)
        return self.peft(**inputs, adapter_names=[n or BASE_ROW for n in names])

    # --- base weights -----------------------------------------------------------------------------
    def read_update(self, model_path: str) -> dict[str, Tensor]:
        """Read and vet new base weights (off the scheduler thread); ``BadRequest`` says what is wrong."""
        path = Path(model_path)
        if not path.exists():
            raise BadRequest(f"model_path {model_path} does not exist")
        if path.is_dir():
            problems = self.config_problems(path)
            if problems:
                raise BadRequest(f"{path / CONFIG_FILE} differs from the served model's: {'; '.join(problems)}")
        try:
            state = read_state(path)
        except WeightsError as exc:
            raise BadRequest(f"cannot load {model_path}: {exc.reason}") from None
        except Exception as exc:  # safetensors, OSError, ...: whatever it is, the file is unusable
            raise BadRequest(f"cannot read the weights at {model_path}: {exc}") from None
        problems = check_tensors(self.reference, state)
        if problems:
            raise BadRequest(f"weights at {model_path} do not fit the served model: {'; '.join(problems)}")
        return state

    def apply_update(self, update: WeightUpdate, *, announce: bool = True) -> None:
        """Copy vetted weights in (while released: ``resume`` reads them from ``update.source``); scheduler
        thread only.

        ``announce`` False loads the tensors but leaves the reported path, name and version as they
        were (SGLang's tokenizer side when the cache flush after a load was refused)."""
        if self.reload_from is not None and update.collective:
            raise BadRequest("weights are released: resume memory before updating them from a weight-update group")
        if self.reload_from is not None:
            self.reload_from = update.source  # nothing to copy into: resume reads this version's files
        else:
            with torch.no_grad():
                for name, tensor in update.state.items():
                    self._live[name].data.copy_(tensor)
        with self._lock:
            self.digest = update.digest  # the tensors are in, announced or not
            self.collective = update.collective
        if not announce:
            return
        with self._lock:
            if not update.collective:
                self.source = self.served_name = update.source
            if update.version is not None:
                self.version = update.version

    def set_version(self, version: str) -> None:
        with self._lock:
            self.version = version

    # --- memory -------------------------------------------------------------------------------------
    def _parameters(self) -> list[nn.Parameter]:
        module = self.peft if self.peft is not None else self.base
        unique: dict[int, nn.Parameter] = {}
        for param in module.parameters():
            unique.setdefault(id(param), param)
        return list(unique.values())

    def live_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._parameters())

    def release(self) -> None:
        """Free the base weights' storage (no copy is kept: the process's resident memory falls by their size)
        and hand the allocator's free pages back to the system; ``resume`` reads them again from the files of
        the version served (``source``). Adapter weights stay (they are small, and their files may be gone)."""
        if self.reload_from is not None:
            return
        if self.collective:
            raise BadRequest("the weights came through a weight-update group (/update_weights_from_distributed) and "
                             "have no files to be read back from: update them from disk before releasing them")
        self.reload_from = self.source
        with torch.no_grad():
            for tensor in _unique(self._live.values()):
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        release_freed_memory(self.device)

    def resume(self) -> None:
        """Read the base weights back from ``reload_from`` (the version served, or one applied while released);
        ``BadRequest`` when its files are gone or no longer fit, and the weights stay released."""
        if self.reload_from is None:
            return
        source = self.reload_from
        try:
            state = read_state(Path(source))
        except Exception as exc:  # WeightsError, OSError, safetensors: the version's files cannot be read
            raise BadRequest(f"cannot bring the weights back from {source}: {exc}") from None
        problems = check_tensors(self.reference, state)
        if problems:
            raise BadRequest(f"cannot bring the weights back from {source}: {'; '.join(problems)}")
        digest = state_digest(state)
        with torch.no_grad():
            for name, tensor in self._live.items():
                if tensor.numel() == 0:  # a tied alias is restored once, through the first name
                    tensor.data = _own_copy(state[name], tensor.dtype, self.device)
        del state
        self.reload_from = None
        with self._lock:
            self.digest = digest

    # --- adapters -------------------------------------------------------------------------------------
    def check_adapter(self, name: str, path: str) -> None:
        """Vet a PEFT LoRA adapter against the served base (off the scheduler thread)."""
        if not self.lora.enabled:
            raise BadRequest("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if not name:
            raise BadRequest("lora_name must not be empty")
        if name in self.adapter_paths():
            raise BadRequest(f"Failed to load LoRA adapter {name} because it is already loaded")
        directory = Path(path)
        config_path, weights_path = directory / ADAPTER_CONFIG_FILE, directory / ADAPTER_WEIGHTS_FILE
        if not config_path.is_file() or not weights_path.is_file():
            raise BadRequest(f"{path} is not a PEFT adapter: it needs {ADAPTER_CONFIG_FILE} and {ADAPTER_WEIGHTS_FILE}")
        try:
            config = json.loads(config_path.read_text())
            shapes = file_shapes(weights_path)
        except (OSError, ValueError) as exc:
            raise BadRequest(f"cannot read the adapter at {path}: {exc}") from None
        except WeightsError as exc:
            raise BadRequest(f"cannot read the adapter at {path}: {exc.reason}") from None
        if config.get("peft_type") != "LORA":
            raise BadRequest(f"{config_path}: peft_type is {config.get('peft_type')!r}; only LoRA adapters are served")
        rank = config.get("r")
        if self.lora.max_rank is not None and isinstance(rank, int) and rank > self.lora.max_rank:
            raise BadRequest(f"adapter rank {rank} exceeds --max-lora-rank {self.lora.max_rank}")
        problems = adapter_problems(shapes, self.reference)
        if problems:
            raise BadRequest(f"adapter {path} does not fit the base model: {'; '.join(problems)}")

    @staticmethod
    def adapter_digest(path: str) -> str:
        """The digest of an adapter's tensors (off the scheduler thread; its file was vetted by ``check_adapter``)."""
        try:
            return tensors_digest(Path(path) / ADAPTER_WEIGHTS_FILE)
        except WeightsError as exc:
            raise BadRequest(f"cannot read the adapter at {path}: {exc.reason}") from None

    def attach_adapter(self, name: str, path: str, digest: str = "") -> None:
        """Load a vetted adapter (scheduler thread); finite values are checked after loading."""
        if self.reload_from is not None:
            raise BadRequest("weights are released: resume memory before loading an adapter")
        from peft import PeftModel

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(self.base, path, adapter_name=name, is_trainable=False)
            else:
                self.peft.load_adapter(path, adapter_name=name, is_trainable=False)
            self.peft.eval()
        bad = [n for n, p in self.peft.named_parameters() if f".{name}." in n and not bool(torch.isfinite(p).all())]
        if bad:
            self._remove_adapter(name)
            raise BadRequest(f"adapter {path} holds NaN or infinite values in {bad[:4]}")
        with self._lock:
            self.adapters[name] = path
            self.adapter_digests[name] = digest or self.adapter_digest(path)
        logger.info("loaded LoRA adapter %s from %s", name, path)

    def detach_adapter(self, name: str) -> None:
        self._remove_adapter(name)
        with self._lock:
            self.adapters.pop(name, None)
            self.adapter_digests.pop(name, None)
        logger.info("unloaded LoRA adapter %s", name)

    def _remove_adapter(self, name: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if list(self.peft.peft_config) == [name]:
                self.base = self.peft.unload()  # back to the bare base model (nothing merged)
                self.peft = None
            else:
                self.peft.delete_adapter(name)


def _unique(tensors: Sequence[Tensor] | Any) -> list[Tensor]:
    seen: dict[int, Tensor] = {}
    for tensor in tensors:
        seen.setdefault(id(tensor), tensor)
    return list(seen.values())


_LIBC: Any = None


WEIGHT_ALIGNMENT = 64
"""Bytes every served weight's storage is aligned to. safetensors' tensors are views into one buffer at
offsets that are not, and the matmul kernels picked for unaligned data round differently: the same weights
gave log-probs 2e-7 apart after a release and resume put them at other offsets."""


def _own_copy(src: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``src`` in storage of its own (the allocator's, aligned to ``WEIGHT_ALIGNMENT``)."""
    return torch.empty(src.shape, dtype=dtype, device=device).copy_(src)


def release_freed_memory(device: torch.device | None = None) -> None:
    """Give freed memory back to the system: collect cycles, then ``malloc_trim(0)`` on glibc (its heap keeps
    freed pages mapped otherwise), and empty CUDA's cache on a GPU."""
    global _LIBC
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC else None
    if trim is not None:  # glibc only; musl and others return freed pages themselves or have no such call
        trim(0)


def check_tensors(reference: Mapping[str, tuple[str, tuple[int, ...]]], state: Mapping[str, Tensor],
                  limit: int = 6) -> list[str]:
    """Every missing or unexpected name, wrong shape, non-float dtype and non-finite tensor."""
    problems: list[str] = []
    missing = sorted(set(reference) - set(state))
    unexpected = sorted(set(state) - set(reference))
    if missing:
        problems.append(f"missing keys {missing[:limit]}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected[:limit]}")
    for name in sorted(set(reference) & set(state)):
        want, got = reference[name][1], tuple(state[name].shape)
        if got != tuple(want):
            problems.append(f"{name}: shape {got}, expected {tuple(want)}")
        elif not state[name].is_floating_point():
            problems.append(f"{name}: dtype {state[name].dtype}, expected a floating dtype")
        elif not bool(torch.isfinite(state[name]).all()):
            problems.append(f"{name}: contains NaN or infinite values")
        if len(problems) >= limit:
            break
    return problems
