"""One decode step of a Llama model (one new token per row), and a prefill, without transformers' glue.

A decode step of SmolLM2-135M at batch 16 is about 30 layers x 40 small tensor operations, and on
two CPU cores the Python around them (module calls, keyword plumbing, the 4-D mask built from the
padding mask) was a fifth of the step once the matmuls ran on packed weights (BENCHMARKS.md, "CPU
engine near the machine's limit"). ``LlamaDecodeStep`` runs the same computation as
``LlamaForCausalLM.forward`` for a one-token step on the same modules and weights, in two forms:

- plain (``--no-packed``, or whatever cannot be stacked): the model's own embedding, RMSNorm and
  rotary modules, each linear layer's ``forward``, the KV cache's ``update`` and
  ``scaled_dot_product_attention`` with the query heads grouped by key/value head, as transformers'
  SDPA path does for one query token;
- fused (the CPU default): q/k/v and gate/up stacked into one weight each, the modules' weights
  becoming views of them (``hf_packed.fuse_rows``: no extra memory, and an update copied into the
  modules lands in them), every wide linear layer transposed (``hf_packed.linear_t``), rotary
  embedding on q and k at once in that layout, ``F.rms_norm``, attention as two batched matmuls with
  one additive mask a step. The logits are transformers' to float32 rounding (a few 1e-7).

``prefill`` runs a prompt batch with the linear layers and the MLP on the real tokens only (a third
of a padded batch's rows were padding in the bench), used where the fused step is. Rows with a LoRA
adapter and any model this does not recognise go through transformers (``build`` returns None).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rollout_bus.engine import hf_packed


def _weight(module: nn.Module) -> Tensor:
    weight = module.weight
    assert isinstance(weight, Tensor)
    return weight


def _base(module: nn.Module) -> nn.Module:
    """The plain layer under a peft LoRA wrapper (the base weights), or the module itself."""
    return getattr(module, "base_layer", module)


class LlamaDecodeStep:
    def __init__(self, model: Any, *, fused: bool = False) -> None:
        config = model.config
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = inner.norm
        self.head = model.lm_head
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.hidden = int(config.hidden_size)
        self.scaling = self.head_dim ** -0.5
        self.layers = [(layer.input_layernorm, layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                        layer.self_attn.o_proj, layer.post_attention_layernorm, layer.mlp.gate_proj,
                        layer.mlp.up_proj, layer.mlp.down_proj) for layer in inner.layers]
        self.fused: list[tuple[Tensor, Tensor]] | None = None
        """Per layer, q/k/v's and gate/up's weights stacked (``hf_packed.fuse_rows``; the modules' weights are
        views of them): the transposed oneDNN step runs on these. None: the plain step (module by module)."""
        if fused:
            self.refresh()

    @classmethod
    def build(cls, model: Any, *, fused: bool = False) -> LlamaDecodeStep | None:
        """A step for ``model`` when it is a plain Llama on SDPA attention (else None: transformers runs it);
        ``fused``: the transposed oneDNN step where the weights allow it (float32 on a CPU)."""
        config = getattr(model, "config", None)
        if (config is None or getattr(config, "model_type", None) != "llama"
                or getattr(config, "_attn_implementation", None) != "sdpa" or config.hidden_act != "silu"
                or getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)
                or getattr(config, "pretraining_tp", 1) != 1):
            return None
        return cls(model, fused=fused and hf_packed.available())

    # --- the fused weights follow the modules' storage ----------------------------------------------------
    def refresh(self) -> None:
        """(Re)stack q/k/v and gate/up into one weight each, the modules' weights becoming views of them: at
        the start and after anything gave the weights storage of their own again (a resume). The plain step
        runs if any layer's weights cannot be stacked."""
        self.fused = None
        others = [self.embed.weight, _base(self.head).weight, *(w for layer in self.layers for w in
                                                                 (_base(layer[4]).weight, _base(layer[8]).weight))]
        if any(w.device.type != "cpu" or w.dtype != torch.float32 for w in others):
            return
        stacked = []
        for _, q, k, v, _, _, gate, up, _ in self.layers:
            qkv = hf_packed.fuse_rows([_base(q), _base(k), _base(v)])
            gate_up = hf_packed.fuse_rows([_base(gate), _base(up)])
            if qkv is None or gate_up is None:
                return
            stacked.append((qkv, gate_up))
        self.fused = stacked

    def drop(self) -> None:
        """Forget the stacked weights (a release frees them with the modules' views)."""
        self.fused = None

    def _intact(self) -> bool:
        assert self.fused is not None
        for (qkv, gate_up), (_, q, k, v, _, _, gate, up, _) in zip(self.fused, self.layers, strict=True):
            if not (hf_packed.fused_intact(qkv, [_base(q), _base(k), _base(v)])
                    and hf_packed.fused_intact(gate_up, [_base(gate), _base(up)])):
                return False
        return True

    def __call__(self, ids: Tensor, positions: Tensor, mask: Tensor, cache: Any) -> Tensor:
        """Logits ``[batch, vocab]`` for one token per row: ``ids`` and ``positions`` ``[batch]``, ``mask``
        ``[batch, slots]`` the padding mask with the new slot included; ``cache`` gets each layer's new slot."""
        if self.fused is not None and ids.device.type == "cpu" and self._intact():
            return self._fused_step(ids, positions, mask, cache)
        return self._plain_step(ids, positions, mask, cache)

    def _plain_step(self, ids: Tensor, positions: Tensor, mask: Tensor, cache: Any) -> Tensor:
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

    def _fused_step(self, ids: Tensor, positions: Tensor, mask: Tensor, cache: Any) -> Tensor:
        """The same step on the stacked weights, every linear layer transposed (``hf_packed.linear_t``:
        ``[out, batch]``). Between them the activations stay in that layout where it saves an operation:
        rotary embedding on q and k at once (three operations for both), SiLU and the gate product on
        contiguous halves; the residual stream is ``[batch, hidden]``, each addition reading the transposed
        output as it is. One attention mask, additive, for every layer."""
        assert self.fused is not None
        batch, heads, kv_heads, dim, half = ids.shape[0], self.heads, self.kv_heads, self.head_dim, self.head_dim // 2
        groups = heads // kv_heads
        h = F.embedding(ids, self.embed.weight)
        cos, sin = self.rotary(h, positions[:, None])  # [batch, 1, head_dim], as transformers computes them
        cos_t = cos[:, 0].t().contiguous()  # [head_dim, batch]
        sin_t = sin[:, 0].t()
        sin_t = torch.cat((-sin_t[:half], sin_t[half:]))  # rotate_half's sign, for the halves swapped
        bias = torch.zeros(mask.shape, dtype=h.dtype).masked_fill_(mask == 0, float("-inf"))
        bias = bias[:, None, None, :].expand(batch, kv_heads, groups, mask.shape[1]).reshape(
            batch * kv_heads, groups, mask.shape[1])  # the padding mask, additive, per (row, kv head, query head)
        shape = (self.hidden,)
        square_packed = torch.get_num_threads() > 1
        for index, ((qkv_w, gate_up_w), (ln1, _, _, _, o_proj, ln2, _, _, down)) in enumerate(
                zip(self.fused, self.layers, strict=True)):
            x = F.rms_norm(h, shape, ln1.weight, ln1.variance_epsilon)
            qkv = hf_packed.linear_t(qkv_w, x).view(heads + 2 * kv_heads, dim, batch)
            qk = qkv[:heads + kv_heads]
            qk = torch.addcmul(qk * cos_t, torch.cat((qk[:, half:], qk[:, :half]), dim=1), sin_t)
            q = qk[:heads].permute(2, 0, 1).contiguous().view(batch * kv_heads, groups, dim)
            k = qk[heads:].permute(2, 0, 1)[:, :, None]
            v = qkv[heads + kv_heads:].permute(2, 0, 1)[:, :, None]
            keys, values = cache.layers[index].update(k, v)
            slots = keys.shape[2]
            scores = torch.baddbmm(bias, q, keys.reshape(batch * kv_heads, slots, dim).transpose(1, 2),
                                   alpha=self.scaling)
            attn = torch.bmm(torch.softmax(scores, dim=-1), values.reshape(batch * kv_heads, slots, dim))
            h = h + _narrow(o_proj, attn.view(batch, heads * dim), square_packed)
            x = F.rms_norm(h, shape, ln2.weight, ln2.variance_epsilon)
            gate_up = hf_packed.linear_t(gate_up_w, x)
            inner = gate_up.shape[0] // 2
            act = F.silu(gate_up[:inner]).mul_(gate_up[inner:])
            h = h + _narrow(down, act.t(), square_packed)
        x = F.rms_norm(h, shape, self.norm.weight, self.norm.variance_epsilon)
        return hf_packed.linear_t(_weight(_base(self.head)), x).t().contiguous()

    def prefill(self, ids: Tensor, positions: Tensor, mask: Tensor, cache: Any) -> Tensor:
        """Logits ``[batch, vocab]`` at the last token of each row for a prefill of left-padded rows: ``ids``
        and ``positions`` ``[batch, new]``, ``mask`` ``[batch, past + new]`` (``past`` slots already in
        ``cache``, holes allowed); ``cache`` gets the ``new`` slots. What ``LlamaForCausalLM.forward`` with
        ``logits_to_keep=1`` computes, but every linear layer and the MLP run on the real tokens only,
        gathered (the padding of short prompts was a third of a prefill's rows in the bench's batch); the
        attention scatters them back into the padded layout the cache keeps, zeros in the padding's slots
        (masked, as transformers' values there are)."""
        batch, new = ids.shape
        past = mask.shape[1] - new
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        real = mask[:, past:].reshape(-1).nonzero().squeeze(1)
        count = real.numel()
        h = F.embedding(ids.reshape(-1).index_select(0, real), self.embed.weight)
        cos, sin = self.rotary(h, positions.reshape(-1).index_select(0, real)[None])  # [1, count, head_dim]
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]
        slots = torch.arange(past + new, device=ids.device)
        query_slots = past + torch.arange(new, device=ids.device)
        allowed = mask.bool()[:, None, None, :] & (slots[None, :] <= query_slots[:, None])
        allowed |= slots[None, :] == query_slots[:, None]  # a padding query sees itself: no empty row (its output is dropped)
        shape = (self.hidden,)
        for index, (ln1, q_proj, k_proj, v_proj, o_proj, ln2, gate, up, down) in enumerate(self.layers):
            x = F.rms_norm(h, shape, ln1.weight, ln1.variance_epsilon)
            q = _base(q_proj).forward(x).view(count, heads, dim)
            k = _base(k_proj).forward(x).view(count, kv_heads, dim)
            v = _base(v_proj).forward(x).view(count, kv_heads, dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = cache.update(_padded(k, real, batch, new), _padded(v, real, batch, new), index)
            attn = F.scaled_dot_product_attention(_padded(q, real, batch, new), keys, values, attn_mask=allowed,
                                                  scale=self.scaling, enable_gqa=heads != kv_heads)
            attn = attn.transpose(1, 2).reshape(batch * new, heads * dim).index_select(0, real)
            h = h + _base(o_proj).forward(attn)
            x = F.rms_norm(h, shape, ln2.weight, ln2.variance_epsilon)
            h = h + _base(down).forward(F.silu(_base(gate).forward(x)) * _base(up).forward(x))
        last = mask[:, past:].sum(dim=1).cumsum(dim=0) - 1  # each row's last token (left padding: its last slot)
        x = F.rms_norm(h.index_select(0, last), shape, self.norm.weight, self.norm.variance_epsilon)
        return _base(self.head).forward(x)


def _padded(x: Tensor, real: Tensor, batch: int, new: int) -> Tensor:
    """``[tokens, heads, dim]`` of the real tokens into ``[batch, heads, new, dim]``, zeros at the padding."""
    out = x.new_zeros(batch * new, x.shape[1], x.shape[2]).index_copy_(0, real, x)
    return out.view(batch, new, x.shape[1], x.shape[2]).transpose(1, 2)


def _narrow(linear: nn.Module, x: Tensor, packed: bool) -> Tensor:
    """``linear(x)`` for a layer with no more outputs than inputs (o_proj, down_proj): transposed on one
    thread; on more, oneDNN splits the transposed product over the weight's rows in blocks too coarse for a
    few hundred of them (SmolLM2's 576 rows: 215 us on two threads against 247 on one; packed, 194 us), so
    the layer's own forward, packed (``hf_packed.PackedLinear``), runs it there."""
    base = _base(linear)
    return base.forward(x) if packed else hf_packed.linear_t(_weight(base), x).t()


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
