"""Named weight sets: each is a whole TinyLM with its own weight version.

The set named ``base`` comes from ``--model-path``; others are created by
``/update_weights_from_disk`` with ``lora_name`` and chosen per request with ``lora_path``.
Only the scheduler thread mutates sets; the HTTP thread reads names, configs and versions under
the store's lock.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import Tensor

from rollout_bus.engine.errors import BadRequest
from rollout_bus.engine.protocol import BASE_WEIGHT_SET
from rollout_bus.lm.model import (
    ModelConfig,
    TinyLM,
    check_state,
    config_file,
    load_config,
    load_state,
    weights_file,
)

logger = logging.getLogger(__name__)


@dataclass
class WeightSet:
    name: str
    model: TinyLM
    version: str
    source: str
    backup: dict[str, Tensor] | None = field(default=None, repr=False)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def released(self) -> bool:
        return self.backup is not None

    def live_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def load(self, state: dict[str, Tensor]) -> None:
        """Copy ``state`` in (into the backup while released); ``WeightStore.check`` has vetted it."""
        if self.backup is not None:
            dtypes = {name: p.dtype for name, p in self.model.named_parameters()}
            self.backup = {name: t.detach().to("cpu", dtypes[name]) for name, t in state.items()}
            return
        with torch.no_grad():
            self.model.load_state_dict(state)

    def release(self) -> None:
        """Drop the parameter storage, keeping a CPU copy that ``resume`` restores bit for bit."""
        if self.backup is not None:
            return
        self.backup = {}
        for name, param in self.model.named_parameters():
            self.backup[name] = param.data.to("cpu")
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        if self.model.head.weight.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self) -> None:
        if self.backup is None:
            return
        for name, param in self.model.named_parameters():
            param.data = self.backup[name].to(param.device)
        self.backup = None


@dataclass(frozen=True)
class WeightUpdate:
    """Weights read from ``source`` for set ``name``; ``version`` None keeps the set's version."""

    name: str
    state: dict[str, Tensor] = field(repr=False)
    config: ModelConfig | None
    version: str | None
    source: str


class WeightStore:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sets: dict[str, WeightSet] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._sets)

    def versions(self) -> dict[str, str]:
        with self._lock:
            return {name: ws.version for name, ws in sorted(self._sets.items())}

    def get(self, name: str) -> WeightSet:
        with self._lock:
            ws = self._sets.get(name)
            if ws is None:
                raise BadRequest(f"unknown weight set (lora_path) {name!r}; loaded sets are {sorted(self._sets)}")
            return ws

    def find(self, name: str) -> WeightSet | None:
        with self._lock:
            return self._sets.get(name)

    def all(self) -> list[WeightSet]:
        with self._lock:
            return list(self._sets.values())

    def config_for(self, name: str) -> ModelConfig:
        return self.get(name).config

    def set_version(self, name: str, version: str) -> None:
        ws = self.get(name)
        with self._lock:
            ws.version = version

    def check(self, update: WeightUpdate) -> ModelConfig:
        """The config the update's weights will run under; BadRequest if they do not fit it."""
        ws = self.find(update.name)
        if ws is None:
            base = self.find(BASE_WEIGHT_SET)
            config = update.config or (base.config if base else None)
            if config is None:
                raise BadRequest(f"no config.json beside {update.source}, and no base set to copy the config from")
        else:
            config = ws.config
            if update.config is not None and update.config != config:
                diff = {k: (v, getattr(config, k)) for k, v in update.config.to_dict().items() if getattr(config, k) != v}
                raise BadRequest(
                    f"config.json beside {update.source} differs from set {update.name!r}: (new, served) = {diff}"
                )
        with torch.device("meta"):
            twin = TinyLM(config)
        try:
            check_state(twin, update.state)
        except ValueError as exc:
            raise BadRequest(f"weights for set {update.name!r} rejected: {exc}") from None
        return config

    def put(self, update: WeightUpdate) -> None:
        """Load the update's weights into its set (created when new); on any error the set is unchanged."""
        config = self.check(update)
        ws = self.find(update.name)
        if ws is None:
            ws = WeightSet(update.name, TinyLM(config).to(self.device), update.version or "default", update.source)
            ws.load(update.state)
            ws.model.eval()
            with self._lock:
                self._sets[update.name] = ws
            logger.info("created weight set %s (version %s) from %s", ws.name, ws.version, update.source)
            return
        ws.load(update.state)
        with self._lock:
            ws.source = update.source
            if update.version is not None:
                ws.version = update.version
        logger.info("loaded weights into set %s (version %s) from %s", ws.name, ws.version, update.source)


def read_weights(model_path: str) -> tuple[dict[str, Tensor], ModelConfig | None]:
    """The tensors at ``model_path`` (a directory with model.safetensors, or a .safetensors file) and the
    config.json beside them when there is one. Raises BadRequest saying what is wrong."""
    path = Path(model_path)
    target = weights_file(path)
    if not path.exists():
        raise BadRequest(f"model_path {model_path} does not exist")
    if not target.is_file():
        raise BadRequest(f"no weights at {target}: model_path must be a .safetensors file or a directory holding one")
    try:
        state = load_state(target)
    except (SafetensorError, OSError, ValueError) as exc:
        raise BadRequest(f"cannot read {target}: {exc}") from None
    if not config_file(path).is_file():
        return state, None
    try:
        return state, load_config(path)
    except (OSError, ValueError, TypeError) as exc:
        raise BadRequest(f"cannot read {config_file(path)}: {exc}") from None
