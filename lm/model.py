"""TinyLM: a small GPT-style causal LM (pre-LN blocks, learned positions, untied output head).

Batches may be left- or right-padded: positions count real tokens only, and padding never takes
part in attention, so a padded row gives the same logits as the row alone. ``extend`` runs new
tokens against a KV cache; ``prefill`` and ``decode_step`` are its two common uses.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from rollout_bus.lm.files import CONFIG_FILE, config_file, weights_file
from rollout_bus.lm.kv_cache import KVCache
from rollout_bus.lm.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE

DeviceLike = str | torch.device
PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = VOCAB_SIZE
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    max_seq_len: int = 64

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{f.name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys {unknown}; known keys are {sorted(known)}")
        return cls(**data)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(
        self, x: Tensor, allowed: Tensor, past: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        batch, steps, width = x.shape
        q, k, v = self.qkv(x).view(batch, steps, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.proj(out.transpose(1, 2).reshape(batch, steps, width)), k, v


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, config.d_ff), nn.GELU(), nn.Linear(config.d_ff, config.d_model)
        )

    def forward(
        self, x: Tensor, allowed: Tensor, past: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        attended, k, v = self.attn(self.ln1(x), allowed, past)
        x = x + attended
        return x + self.mlp(self.ln2(x)), k, v


class TinyLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """Logits ``[batch, seq, vocab]``; ``attention_mask`` is 1 for real tokens, 0 for padding.

        With ``cache`` (possibly ``KVCache.empty()``) the tokens run after those already cached and the
        cache grows in place, as a Hugging Face ``DynamicCache`` does (so ``peft`` wrappers pass it on).
        """
        logits, grown = self.extend(input_ids, attention_mask, cache if cache is not None and cache.filled else None)
        if cache is not None:
            cache.assign(grown)
        return logits

    def extend(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, cache: KVCache | None = None
    ) -> tuple[Tensor, KVCache]:
        """Run ``input_ids`` after the tokens already in ``cache``; return their logits and the grown cache."""
        batch, steps = input_ids.shape
        device = input_ids.device
        new_mask = (
            torch.ones(batch, steps, dtype=torch.bool, device=device)
            if attention_mask is None
            else attention_mask.to(device=device, dtype=torch.bool)
        )
        past_len = 0 if cache is None else cache.length
        seen = (
            torch.zeros(batch, dtype=torch.long, device=device)
            if cache is None
            else cache.token_counts().to(device)
        )
        positions = (seen[:, None] + new_mask.long().cumsum(dim=1) - 1).clamp(min=0)
        if steps and int(positions.max()) >= self.config.max_seq_len:
            raise ValueError(
                f"sequence of {int(positions.max()) + 1} tokens exceeds max_seq_len {self.config.max_seq_len}"
            )
        key_mask = new_mask if cache is None else torch.cat([cache.mask.to(device), new_mask], dim=1)
        query_slot = torch.arange(steps, device=device)[:, None] + past_len
        key_slot = torch.arange(past_len + steps, device=device)[None, :]
        allowed = (key_slot <= query_slot)[None] & key_mask[:, None, :]
        # A padding query sees only itself, so no softmax row is empty; its output is never used.
        allowed = (allowed | (key_slot == query_slot)[None])[:, None]

        x = self.tok_emb(input_ids) + self.pos_emb(positions)
        keys: list[Tensor] = []
        values: list[Tensor] = []
        for i, block in enumerate(self.blocks):
            past = None if cache is None else (cache.keys[i], cache.values[i])
            x, k, v = block(x, allowed, past)
            keys.append(k)
            values.append(v)
        return self.head(self.ln_f(x)), KVCache(keys, values, key_mask)

    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, KVCache]:
        return self.extend(input_ids, attention_mask)

    def decode_step(self, token_ids: Tensor, cache: KVCache) -> tuple[Tensor, KVCache]:
        """Feed one token per row (``[batch]``) after ``cache``; logits ``[batch, vocab]``."""
        logits, cache = self.extend(token_ids[:, None], None, cache)
        return logits[:, -1], cache


def build_model(config: ModelConfig | None = None, seed: int = 0, device: DeviceLike = "cpu") -> TinyLM:
    """A TinyLM with random weights that depend only on ``config`` and ``seed``."""
    config = config or ModelConfig()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyLM(config)
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() == 1:
                nn.init.ones_(param)
            else:
                std = 0.02 / math.sqrt(2 * config.n_layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(param, mean=0.0, std=std)
    return model.to(device)


def pad_batch(
    sequences: Sequence[Sequence[int]],
    side: Literal["left", "right"] = "left",
    pad_id: int = PAD_ID,
    device: DeviceLike = "cpu",
) -> tuple[Tensor, Tensor]:
    """``(input_ids, attention_mask)`` of shape ``[len(sequences), longest]``."""
    longest = max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, seq in enumerate(sequences):
        span = slice(longest - len(seq), longest) if side == "left" else slice(0, len(seq))
        ids[row, span] = torch.tensor(list(seq), dtype=torch.long)
        mask[row, span] = 1
    return ids.to(device), mask.to(device)


def token_logprobs(
    model: TinyLM, input_ids: Tensor, attention_mask: Tensor | None = None, temperature: float = 1.0
) -> Tensor:
    """``log p(input_ids[:, t] | input_ids[:, :t])`` for t >= 1, shape ``[batch, seq - 1]``.

    Entries whose target is padding are 0. Gradients flow when called outside ``no_grad``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = model(input_ids, attention_mask)[:, :-1] / temperature
    targets = input_ids[:, 1:]
    picked = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    if attention_mask is not None:
        picked = picked * attention_mask[:, 1:].to(picked.dtype)
    return picked


def token_logprobs_and_entropy(
    model: TinyLM, input_ids: Tensor, attention_mask: Tensor | None = None, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """``token_logprobs`` (at ``temperature``) and the entropy of the next-token distribution it picks from.

    Both are ``[batch, seq - 1]`` from one forward pass: column ``t`` is about token ``t + 1``,
    and entries whose target is padding are 0. Gradients flow through both.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = model(input_ids, attention_mask)[:, :-1] / temperature
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    picked = log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    if attention_mask is not None:
        keep = attention_mask[:, 1:].to(picked.dtype)
        picked, entropy = picked * keep, entropy * keep
    return picked, entropy


@torch.no_grad()
def generate(
    model: TinyLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_at_eos: bool = True,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Plain batched generation (greedy when ``temperature == 0``); output stops after EOS."""
    device = next(model.parameters()).device
    ids, mask = pad_batch(prompts, side="left", device=device)
    logits, cache = model.prefill(ids, mask)
    step_logits = logits[:, -1]
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for step in range(max_new_tokens):
        if temperature == 0:
            tokens = step_logits.argmax(dim=-1)
        else:
            probs = torch.softmax(step_logits.float() / temperature, dim=-1).cpu()
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1).to(device)
        for row, token in enumerate(tokens.tolist()):
            if not done[row]:
                outputs[row].append(token)
                done[row] = stop_at_eos and token == EOS_ID
        if all(done) or step == max_new_tokens - 1:
            break
        step_logits, cache = model.decode_step(tokens, cache)
    return outputs


def save_weights(model: TinyLM, path: PathLike) -> Path:
    """Write the weights and ``config.json`` (each atomically, config first); return the weights file."""
    target = weights_file(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    config_text = json.dumps(model.config.to_dict(), indent=2, sort_keys=True) + "\n"
    _write_atomically(config_file(path), lambda tmp: tmp.write_text(config_text))
    state = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    _write_atomically(target, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    return target


def load_state(path: PathLike, device: DeviceLike = "cpu") -> dict[str, Tensor]:
    """Tensors of the safetensors file at ``path`` (a ``.safetensors`` file or a weights directory)."""
    target = weights_file(path)
    if not target.is_file():
        raise FileNotFoundError(f"no weights file at {target}")
    return load_file(str(target), device=str(device))


def load_config(path: PathLike) -> ModelConfig:
    target = config_file(path)
    if not target.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} at {target}")
    return ModelConfig.from_dict(json.loads(target.read_text()))


def load_model(path: PathLike, device: DeviceLike = "cpu") -> TinyLM:
    """A TinyLM built from the ``config.json`` at ``path`` with the weights stored there."""
    model = TinyLM(load_config(path)).to(device)
    state = load_state(path, device)
    check_state(model, state)
    model.load_state_dict(state)
    return model


def check_state(model: TinyLM, state: Mapping[str, Tensor]) -> None:
    """Raise ValueError naming every missing or unexpected key, shape mismatch and non-finite tensor."""
    expected = model.state_dict()
    problems: list[str] = []
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    for name in sorted(set(expected) & set(state)):
        want, got = expected[name], state[name]
        if tuple(got.shape) != tuple(want.shape):
            problems.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        elif not got.is_floating_point():
            problems.append(f"{name}: dtype {got.dtype}, expected a floating dtype")
        elif not bool(torch.isfinite(got).all()):
            problems.append(f"{name}: contains NaN or infinite values")
    if problems:
        raise ValueError("weights do not fit the model: " + "; ".join(problems))


def _write_atomically(target: Path, write: Callable[[Path], object]) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
