"""Choosing the next token of each row of a batch, each row with its own parameters and generator.

The log-prob reported for a token is taken under the temperature-scaled distribution before top-k,
top-p and min-p truncation: ``log_softmax(logits / temperature)`` when temperature > 0 and
``log_softmax(logits)`` for greedy rows. At temperature 1 it equals ``lm.model.token_logprobs``.

Greedy rows take the argmax; sampled rows without truncation draw from the full distribution; only
rows with top-k, top-p or min-p sort their probabilities (a sort over the vocabulary per row per step
was a quarter of a decode step on a small model).

Rows fail alone: a row whose distribution cannot be sampled (non-finite logits, a temperature that is
0 in float32) or whose chosen log-prob is not finite is reported in ``Sampled.failed`` with the
reason, and the other rows of the batch keep their tokens (the scheduler ends only that sequence).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from rollout_bus.engine.protocol import SamplingParams


class Sampled(NamedTuple):
    tokens: list[int]
    logprobs: list[float]
    failed: dict[int, str]
    """Row -> why it could not be sampled; that row's token and log-prob mean nothing."""


def sample_next(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> Sampled:
    """Token ids and their log-probs for each row of ``logits`` (``[batch, vocab]``)."""
    logits = logits.detach().float().cpu()
    vocab = logits.shape[1]
    temperatures = [p.temperature if not p.greedy else 1.0 for p in params]
    scaled = logits if all(t == 1.0 for t in temperatures) else logits / torch.tensor(temperatures)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1).tolist()
    failed: dict[int, str] = {}
    truncated = [row for row, p in enumerate(params)
                 if not p.greedy and (0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0)]
    skip = set(truncated)
    plain = [row for row, p in enumerate(params) if not p.greedy and row not in skip]
    for row in plain:
        _draw(tokens, failed, row, logprobs[row].exp(), generators[row])
    if truncated:
        index = torch.tensor(truncated)
        sorted_probs, order = logprobs[index].exp().sort(dim=-1, descending=True)
        rank = torch.arange(vocab)[None, :]
        top_k = torch.tensor([params[r].top_k if params[r].top_k > 0 else vocab for r in truncated])
        top_p = torch.tensor([params[r].top_p for r in truncated])
        min_p = torch.tensor([params[r].min_p for r in truncated])
        keep = rank < top_k[:, None]
        keep &= (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p[:, None]
        keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
        keep[:, 0] = True
        kept = sorted_probs * keep
        for i, row in enumerate(truncated):
            if _draw(tokens, failed, row, kept[i], generators[row]):
                tokens[row] = int(order[i, tokens[row]])
    chosen = logprobs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()
    for row, value in enumerate(chosen):
        if row not in failed and not math.isfinite(value):
            failed[row] = (f"sampling failed: the chosen token's log-prob is {value} "
                           f"(non-finite logits at temperature {params[row].temperature})")
    return Sampled(tokens, chosen, failed)


def _draw(tokens: list[int], failed: dict[int, str], row: int, probs: Tensor, generator: torch.Generator) -> bool:
    """One draw from ``probs`` into ``tokens[row]``; on a distribution that cannot be sampled the row
    goes to ``failed`` (with torch's reason) and False is returned."""
    try:
        tokens[row] = int(torch.multinomial(probs, 1, generator=generator))
    except RuntimeError as exc:
        failed[row] = f"sampling failed: {exc}"
        return False
    return True
