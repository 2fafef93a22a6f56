"""Next-token choice per row (greedy, full distribution, truncated) and request parsing without a tokenizer."""

from __future__ import annotations

import pytest
import torch

from rollout_bus.engine.errors import BadRequest
from rollout_bus.engine.protocol import Limits, SamplingParams, parse_generate
from rollout_bus.engine.sampling import sample_next


def generators(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_each_row_follows_its_own_parameters_and_reports_the_temperature_scaled_logprob() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.0, top_p=1e-6)]
    tokens, logprobs, failed = sample_next(logits, params, generators(4))
    assert failed == {}
    argmax = logits.argmax(-1).tolist()
    assert tokens[0] == argmax[0] and tokens[2] == argmax[2] and tokens[3] == argmax[3]
    for row, (token, temperature) in enumerate(zip(tokens, [1.0, 0.7, 1.0, 1.0], strict=True)):
        expected = torch.log_softmax(logits[row] / temperature, -1)[token].item()
        assert logprobs[row] == pytest.approx(expected, abs=1e-6)


def test_sampling_is_reproducible_per_generator_and_covers_the_distribution() -> None:
    logits = torch.zeros(1, 8)
    params = [SamplingParams(temperature=1.0)]
    first = [sample_next(logits, params, [g])[0][0] for g in generators(1, seed=5) * 20]
    again = [sample_next(logits, params, [g])[0][0] for g in generators(1, seed=5) * 20]
    assert first == again and len(set(first)) > 3
    truncated = [sample_next(logits + torch.arange(8.0), [SamplingParams(temperature=1.0, top_k=2)], [g])[0][0]
                 for g in generators(30)]
    assert set(truncated) <= {6, 7}


def test_stop_strings_need_a_tokenizer() -> None:
    limits = Limits(vocab_size=10, max_seq_len=32, encode=lambda text: [1], adapters=frozenset(), lora_enabled=False,
                    has_tokenizer=False)
    with pytest.raises(BadRequest, match="stop strings need a tokenizer"):
        parse_generate({"input_ids": [1, 2], "sampling_params": {"stop": ["x"]}}, limits)
    parsed = parse_generate({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [3]}}, limits)
    assert parsed.sequences[0].params.stop_token_ids == (3,)
