"""The tiny character-level LM (``lm.model.TinyLM``) as a served model: the fast default for tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rollout_bus.engine.codec import CharCodec
from rollout_bus.engine.prefix_cache import Layers
from rollout_bus.engine.served import DecodeBatch, LoraLimits, ServedModel, prefix_lengths
from rollout_bus.lm.files import config_file, tensor_shapes
from rollout_bus.lm.kv_cache import KVCache
from rollout_bus.lm.model import ModelConfig, load_config, load_model, pad_batch
from rollout_bus.lm.tokenizer import VOCAB_SIZE


class TinyServed(ServedModel):
    kind = "tiny_lm"
    model_type = "tiny_lm"
    architectures = ["TinyLM"]

    def __init__(self, model_path: str, device: torch.device, version: str, lora: LoraLimits) -> None:
        config = load_config(model_path)
        if config.vocab_size != VOCAB_SIZE:
            raise ValueError(f"{config_file(model_path)}: vocab_size {config.vocab_size}, the character "
                             f"vocabulary has {VOCAB_SIZE}")
        model = load_model(model_path, device).eval()
        super().__init__(model, tensor_shapes(Path(model_path)), CharCodec(), max_seq_len=config.max_seq_len,
                         device=device, version=version, source=model_path, lora=lora)
        self.config: ModelConfig = config

    def new_batch(self) -> DecodeBatch:
        return TinyBatch(self)

    def config_problems(self, directory: Path) -> list[str]:
        if not config_file(directory).is_file():
            return []
        try:
            config = load_config(directory)
        except (OSError, ValueError, TypeError) as exc:
            return [f"unreadable: {exc}"]
        return [f"{k}: {v} (served: {getattr(self.config, k)})" for k, v in config.to_dict().items()
                if getattr(self.config, k) != v]


class TinyBatch(DecodeBatch):
    """Rows on one ``lm.kv_cache.KVCache``: positions and padding come from the cache's mask."""

    def __init__(self, served: TinyServed) -> None:
        self.served = served
        self.rows: list[Any] = []
        self.cache: KVCache | None = None

    def _names(self, seqs: Sequence[Any]) -> list[str | None]:
        return [s.spec.lora for s in seqs]

    def decode(self) -> Tensor:
        assert self.cache is not None
        last = torch.tensor([s.output_ids[-1] for s in self.rows], device=self.served.device)
        logits = self.served.forward(self._names(self.rows), input_ids=last[:, None], attention_mask=None,
                                     cache=self.cache)
        return logits[:, -1]

    def prefill(self, seqs: Sequence[Any], prefixes: Sequence[Layers | None] | None = None) -> Tensor:
        cached = prefix_lengths(prefixes, len(seqs))
        ids, mask = pad_batch([s.tokens()[n:] for s, n in zip(seqs, cached, strict=True)], side="left",
                              device=self.served.device)
        cache = KVCache.empty()
        if max(cached) > 0:  # the cached prefixes, each left-padded to the longest: the new tokens run after them
            assert prefixes is not None
            cache = KVCache.stack([_prefix_cache(p, prefixes, self.served.device) for p in prefixes])
        logits = self.served.forward(self._names(seqs), input_ids=ids, attention_mask=mask, cache=cache)
        self.cache = cache if self.cache is None else KVCache.stack([self.cache, cache])
        self.rows = [*self.rows, *seqs]
        return logits[:, -1]

    def row_kv(self, seq: Any) -> Layers | None:
        row = next((i for i, s in enumerate(self.rows) if s is seq), None)
        if row is None or self.cache is None:
            return None
        slots = self.cache.mask[row].nonzero().squeeze(1)
        return [(k[row:row + 1].index_select(2, slots), v[row:row + 1].index_select(2, slots))
                for k, v in zip(self.cache.keys, self.cache.values, strict=True)]

    def keep(self, seqs: Sequence[Any]) -> None:
        wanted = {id(s) for s in seqs}
        index = [i for i, s in enumerate(self.rows) if id(s) in wanted]
        if len(index) == len(self.rows):
            return
        if not index:
            self.clear()
            return
        assert self.cache is not None
        self.cache = self.cache.select(torch.tensor(index, device=self.cache.mask.device))
        self.rows = [self.rows[i] for i in index]

    def clear(self) -> None:
        self.rows, self.cache = [], None

    def nbytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes()


def _prefix_cache(prefix: Layers | None, prefixes: Sequence[Layers | None], device: torch.device) -> KVCache:
    """One row's cached prefix as a ``KVCache`` (no tokens for a row without one)."""
    if prefix is None:
        some = next(p for p in prefixes if p is not None)
        prefix = [(k.new_zeros(1, k.shape[1], 0, k.shape[3]), v.new_zeros(1, v.shape[1], 0, v.shape[3])) for k, v in some]
    length = int(prefix[0][0].shape[2])
    return KVCache(keys=[k.to(device) for k, _ in prefix], values=[v.to(device) for _, v in prefix],
                   mask=torch.ones(1, length, dtype=torch.bool, device=device))
