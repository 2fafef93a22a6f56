"""One decode step of a Llama model (one new token per row) without transformers' per-layer glue.

A decode step of SmolLM2-135M at batch 16 is about 30 layers x 40 small tensor operations, and on
two CPU cores the Python around them (module calls, keyword plumbing, the 4-D mask built from the
padding mask) was a fifth of the step once the matmuls ran on packed weights (BENCHMARKS.md, "CPU
engine near the machine's limit"). ``LlamaDecodeStep`` runs the same computation as
``LlamaForCausalLM.forward`` for a one-token step on the same modules and weights: the model's own
embedding, RMSNorm and rotary modules, each linear layer's ``forward`` (packed by ``engine.hf_packed``
when it is), the KV cache's ``update`` and ``scaled_dot_product_attention`` with the query heads
grouped by key/value head, as transformers' SDPA path does for one query token. Prefill, rows with a
LoRA adapter and any model this does not recognise go through transformers as before
(``build`` returns None).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _base(module: nn.Module) -> nn.Module:
    """The plain layer under a peft LoRA wrapper (the base weights), or the module itself."""
    return getattr(module, "base_layer", module)


class LlamaDecodeStep:
    def __init__(self, model: Any) -> None:
        config = model.config
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = inner.norm
        self.head = model.lm_head
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.scaling = self.head_dim ** -0.5
        self.layers = [(layer.input_layernorm, layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                        layer.self_attn.o_proj, layer.post_attention_layernorm, layer.mlp.gate_proj,
                        layer.mlp.up_proj, layer.mlp.down_proj) for layer in inner.layers]

    @classmethod
    def build(cls, model: Any) -> LlamaDecodeStep | None:
        """A step for ``model`` when it is a plain Llama on SDPA attention (else None: transformers runs it)."""
        config = getattr(model, "config", None)
        if (config is None or getattr(config, "model_type", None) != "llama"
                or getattr(config, "_attn_implementation", None) != "sdpa" or config.hidden_act != "silu"
                or getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)
                or getattr(config, "pretraining_tp", 1) != 1):
            return None
        return cls(model)

    def __call__(self, ids: Tensor, positions: Tensor, mask: Tensor, cache: Any) -> Tensor:
        """Logits ``[batch, vocab]`` for one token per row: ``ids`` and ``positions`` ``[batch]``, ``mask``
        ``[batch, slots]`` the padding mask with the new slot included; ``cache`` gets each layer's new slot."""
        batch = ids.shape[0]
        h = F.embedding(ids, self.embed.weight)
        cos, sin = self.rotary(h, positions[:, None])  # [batch, 1, head_dim], as transformers computes them
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        allowed = mask.bool()[:, None, None, :]
        groups = self.heads // self.kv_heads
        for index, (ln1, q_proj, k_proj, v_proj, o_proj, ln2, gate, up, down) in enumerate(self.layers):
            x = ln1(h)
            q = _base(q_proj).forward(x).view(batch, self.kv_heads, groups, self.head_dim)
            k = _base(k_proj).forward(x).view(batch, self.kv_heads, 1, self.head_dim)
            v = _base(v_proj).forward(x).view(batch, self.kv_heads, 1, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = cache.layers[index].update(k, v)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=self.scaling)
            h = h + _base(o_proj).forward(attn.reshape(batch, self.heads * self.head_dim))
            x = ln2(h)
            h = h + _base(down).forward(F.silu(_base(gate).forward(x)) * _base(up).forward(x))
        return _base(self.head).forward(self.norm(h))


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
