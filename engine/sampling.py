"""Choosing the next token of each row of a batch, each row with its own parameters and generator.

The log-prob reported for a token is taken under the temperature-scaled distribution before top-k,
top-p and min-p truncation: ``log_softmax(logits / temperature)`` when temperature > 0 and
``log_softmax(logits)`` for greedy rows. At temperature 1 it equals ``lm.model.token_logprobs``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rollout_bus.engine.protocol import SamplingParams


def sample_next(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Token ids and their log-probs for each row of ``logits`` (``[batch, vocab]``)."""
    logits = logits.detach().float().cpu()
    batch, vocab = logits.shape
    temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params])
    logprobs = torch.log_softmax(logits / temperature[:, None], dim=-1)
    probs = logprobs.exp()
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    min_p = torch.tensor([p.min_p for p in params])
    keep = rank < top_k[:, None]
    keep &= (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p[:, None]
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True
    kept = sorted_probs * keep
    greedy_tokens = logits.argmax(dim=-1)
    tokens: list[int] = []
    for row, p in enumerate(params):
        if p.greedy:
            tokens.append(int(greedy_tokens[row]))
        else:
            pick = torch.multinomial(kept[row], 1, generator=generators[row])
            tokens.append(int(order[row, pick]))
    chosen = logprobs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    return tokens, chosen.tolist()
