"""A Hugging Face causal LM as a served model (``AutoModelForCausalLM`` + its tokenizer).

Rows share one KV cache (``engine.hf_cache.SlackCache``: a ``DynamicCache`` that writes each step's
slot in place instead of concatenating): prompts are left-padded, positions are passed explicitly (each row
counts only its real tokens), and the attention mask grows by one column per step, as
``model.generate`` does with a batch. New rows are prefilled on their own cache and merged in
(both caches left-padded to the longer); finished rows are dropped with ``batch_select_indices``,
and slots that became padding in every row are cut off. A row prefilled after a cached prefix (the
prefix cache) runs only its new tokens, on a cache that starts with the prefixes. Decoder-only models with full attention
(Llama, Qwen2, SmolLM2, ...) are what this is written for. On a CPU the linear layers run on
oneDNN with packed weights (``engine.hf_packed``), repacked after every weight update, and the decode
steps and prefills of a plain Llama without an adapter skip transformers' per-layer glue
(``engine.hf_decode``: stacked, transposed linear layers; the prefill on the real tokens only).
``packed=False`` (``--no-packed``) keeps all of it on plain ``F.linear``, module by module.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rollout_bus.engine import hf_packed
from rollout_bus.engine.codec import HFCodec
from rollout_bus.engine.errors import BadRequest
from rollout_bus.engine.hf_cache import SlackCache, reserved_bytes
from rollout_bus.engine.hf_decode import LlamaDecodeStep
from rollout_bus.engine.prefix_cache import Layers
from rollout_bus.engine.served import (
    IGNORED_CONFIG_KEYS,
    DecodeBatch,
    LoraLimits,
    ServedModel,
    WeightUpdate,
    prefix_lengths,
)
from rollout_bus.lm import hf
from rollout_bus.lm.files import CONFIG_FILE, tensor_shapes

PACK_ROWS_HINT = 16
"""The batch oneDNN lays the packed weights out for (``engine.hf_packed``); any batch runs on them."""


class HFServed(ServedModel):
    kind = "hf"

    def __init__(self, model_path: str, device: torch.device, version: str, lora: LoraLimits, *,
                 tokenizer: bool = True, packed: bool = True) -> None:
        """``packed=False`` (the engine's ``--no-packed``) keeps every linear layer on plain ``F.linear``."""
        reference = tensor_shapes(Path(model_path))  # first: only safetensors are loaded (never a pickled .bin)
        model = hf.load_model(model_path, device)
        loaded = hf.load_tokenizer(model_path) if tokenizer else None
        config = model.config
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos_ids = {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
        codec = HFCodec(loaded, int(config.get_text_config().vocab_size), eos_ids, model_path if tokenizer else None)
        super().__init__(model, reference, codec, max_seq_len=int(config.max_position_embeddings), device=device,
                         version=version, source=model_path, lora=lora)
        self.model_type = str(config.model_type)
        self.architectures = list(config.architectures or [type(model).__name__])
        self.config_json = _read_config(Path(model_path))
        self.hf_config = config
        self.cache_class = SlackCache
        self.packed = packed and hf_packed.available() and device.type == "cpu"
        self.decode_step = LlamaDecodeStep.build(model, fused=self.packed)
        """A decode step without transformers' glue for rows without an adapter (None: not a plain Llama); with
        ``packed``, on q/k/v and gate/up stacked (the modules' weights become views: before the packs below)
        and every linear layer transposed on oneDNN."""
        if self.packed:
            hf_packed.pack_linears(model, PACK_ROWS_HINT)

    # the packed copies of the linear layers' weights follow every change of the weights
    def apply_update(self, update: WeightUpdate, *, announce: bool = True) -> None:
        super().apply_update(update, announce=announce)
        if self.packed:
            hf_packed.repack(self.base, PACK_ROWS_HINT)

    def release(self) -> None:
        if self.packed:
            hf_packed.unpack(self.base)
            if self.decode_step is not None:
                self.decode_step.drop()  # before the weights go, so that their memory goes with them
        try:
            super().release()
        except BadRequest:  # refused, the weights untouched: so are the packs and the stacked weights
            if self.packed:
                if self.decode_step is not None:
                    self.decode_step.refresh()
                hf_packed.repack(self.base, PACK_ROWS_HINT)
            raise

    def resume(self) -> None:
        super().resume()
        if self.packed:
            if self.decode_step is not None:
                self.decode_step.refresh()  # the weights have storage of their own again: stack them anew
            hf_packed.repack(self.base, PACK_ROWS_HINT)

    def new_batch(self) -> DecodeBatch:
        return HFBatch(self)

    def config_problems(self, directory: Path) -> list[str]:
        if not (directory / CONFIG_FILE).is_file():
            return []
        try:
            new = _read_config(directory)
        except (OSError, ValueError) as exc:
            return [f"unreadable: {exc}"]
        keys = (set(new) | set(self.config_json)) - IGNORED_CONFIG_KEYS
        return [f"{k}: {new.get(k)!r} (served: {self.config_json.get(k)!r})" for k in sorted(keys)
                if new.get(k) != self.config_json.get(k)][:6]


def _read_config(directory: Path) -> dict[str, Any]:
    data = json.loads((directory / CONFIG_FILE).read_text())
    if not isinstance(data, dict):
        raise ValueError("config.json is not a JSON object")
    return data


class HFBatch(DecodeBatch):
    def __init__(self, served: HFServed) -> None:
        self.served = served
        self.rows: list[Any] = []
        self.cache: Any = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.positions = torch.zeros(0, dtype=torch.long)

    def _names(self, seqs: Sequence[Any]) -> list[str | None]:
        return [s.spec.lora for s in seqs]

    def decode(self) -> Tensor:
        device = self.served.device
        last = torch.tensor([s.output_ids[-1] for s in self.rows], device=device)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
        names = self._names(self.rows)
        step = self.served.decode_step
        if step is not None and all(n is None for n in names):
            logits = step(last, self.positions, self.mask, self.cache)
        else:
            logits = self.served.forward(names, input_ids=last[:, None], attention_mask=self.mask,
                                         position_ids=self.positions[:, None], cache=self.cache,
                                         use_cache=True).logits[:, -1]
        self.positions = self.positions + 1
        return logits

    def prefill(self, seqs: Sequence[Any], prefixes: Sequence[Layers | None] | None = None) -> Tensor:
        """Rows are ``[padding, cached prefix, padding, new tokens]``: the prefixes left-padded to the
        longest one, the new tokens to the longest run; the mask has a hole where a row's prefix is short."""
        device = self.served.device
        cached = prefix_lengths(prefixes, len(seqs))
        runs = [s.tokens()[n:] for s, n in zip(seqs, cached, strict=True)]
        longest = max(len(r) for r in runs)
        ids = torch.zeros(len(runs), longest, dtype=torch.long)
        mask = torch.zeros(len(runs), longest, dtype=torch.long)
        for row, run in enumerate(runs):
            ids[row, longest - len(run):] = torch.tensor(run)
            mask[row, longest - len(run):] = 1
        ids, mask = ids.to(device), mask.to(device)
        seen = torch.tensor(cached, device=device)
        positions = (seen[:, None] + mask.cumsum(dim=1) - 1).clamp(min=0)
        if max(cached) == 0:
            cache = self.served.cache_class()
        else:
            assert prefixes is not None
            past, past_mask = _stack_prefixes(prefixes, cached, device)
            cache = self.served.cache_class(ddp_cache_data=past)
            mask = torch.cat([past_mask, mask], dim=1)
        names = self._names(seqs)
        step = self.served.decode_step
        if step is not None and step.fused is not None and device.type == "cpu" and all(n is None for n in names):
            logits = step.prefill(ids, positions, mask, cache)  # the real tokens only, no padding rows
        else:
            logits = self.served.forward(names, input_ids=ids, attention_mask=mask, position_ids=positions,
                                         cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        self._merge(list(seqs), cache, mask, positions[:, -1] + 1)
        return logits

    def row_kv(self, seq: Any) -> Layers | None:
        row = next((i for i, s in enumerate(self.rows) if s is seq), None)
        if row is None or self.cache is None:
            return None
        slots = self.mask[row].nonzero().squeeze(1)
        return [(layer.keys[row:row + 1].index_select(2, slots), layer.values[row:row + 1].index_select(2, slots))
                for layer in self.cache.layers]

    def _merge(self, seqs: list[Any], cache: Any, mask: Tensor, positions: Tensor) -> None:
        if not self.rows:
            self.rows, self.cache, self.mask, self.positions = seqs, cache, mask, positions
            return
        length = max(self.mask.shape[1], mask.shape[1])
        layers = []
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            keys = torch.cat([_left_pad(old.keys, length), _left_pad(new.keys, length)])
            values = torch.cat([_left_pad(old.values, length), _left_pad(new.values, length)])
            layers.append((keys, values))
        self.cache = self.served.cache_class(ddp_cache_data=layers)
        self.mask = torch.cat([F.pad(self.mask, (length - self.mask.shape[1], 0)), F.pad(mask, (length - mask.shape[1], 0))])
        self.positions = torch.cat([self.positions, positions])
        self.rows = [*self.rows, *seqs]

    def keep(self, seqs: Sequence[Any]) -> None:
        wanted = {id(s) for s in seqs}
        index = [i for i, s in enumerate(self.rows) if id(s) in wanted]
        if len(index) == len(self.rows):
            return
        if not index:
            self.clear()
            return
        rows = torch.tensor(index, device=self.mask.device)
        self.cache.batch_select_indices(rows)
        self.mask = self.mask.index_select(0, rows)
        self.positions = self.positions.index_select(0, rows)
        self.rows = [self.rows[i] for i in index]
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else 0
        if start > 0:  # slots that are padding in every remaining row
            self.mask = self.mask[:, start:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]

    def clear(self) -> None:
        self.rows, self.cache = [], None
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.positions = torch.zeros(0, dtype=torch.long)

    def nbytes(self) -> int:
        if self.cache is None:
            return 0
        return reserved_bytes(self.cache)


def _stack_prefixes(prefixes: Sequence[Layers | None], cached: list[int],
                    device: torch.device) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
    """Every row's prefix left-padded to the longest (zeros for a row without one) and their mask."""
    length = max(cached)
    some = next(p for p in prefixes if p is not None)
    layers = []
    for i, (k0, v0) in enumerate(some):
        empty_k, empty_v = k0.new_zeros(1, k0.shape[1], 0, k0.shape[3]), v0.new_zeros(1, v0.shape[1], 0, v0.shape[3])
        keys = torch.cat([_left_pad(p[i][0] if p is not None else empty_k, length) for p in prefixes])
        values = torch.cat([_left_pad(p[i][1] if p is not None else empty_v, length) for p in prefixes])
        layers.append((keys.to(device), values.to(device)))
    mask = torch.zeros(len(prefixes), length, dtype=torch.long, device=device)
    for row, n in enumerate(cached):
        mask[row, length - n:] = 1
    return layers, mask


def _left_pad(t: Tensor, length: int) -> Tensor:
    return F.pad(t, (0, 0, length - t.shape[2], 0))
