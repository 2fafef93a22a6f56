"""Property: whatever bytes or JSON a client sends to ``/generate``, the engine's parser answers a
``GenerateInput`` within its bounds or a ``BadRequest`` with a message, and raises nothing else."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rollout_bus.engine.errors import BadRequest
from rollout_bus.engine.protocol import (
    MAX_JSON_DEPTH,
    GenerateInput,
    Limits,
    SamplingParams,
    parse_generate,
    parse_json,
)
from rollout_bus.events.rollouts import MIN_TEMPERATURE
from rollout_bus.lm.tokenizer import VOCAB_SIZE, encode

LIMITS = Limits(vocab_size=VOCAB_SIZE, max_seq_len=64, encode=encode, adapters=frozenset({"a"}), lora_enabled=True,
                max_seqs=32)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

hostile_numbers = st.one_of(
    st.integers(), st.integers(min_value=10**300, max_value=10**400), st.integers(min_value=-(10**400), max_value=-1),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=0, max_value=1e-3),
    st.sampled_from([1e-300, 5e-324, -0.0, 0, 1, 2**63, 2**64, VOCAB_SIZE, MIN_TEMPERATURE]))
scalars = st.one_of(st.none(), st.booleans(), hostile_numbers, st.text(max_size=12))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=16)
SAMPLING_KEYS = sorted(SamplingParams.__dataclass_fields__) + ["frequency_penalty", "stream_interval", "bogus"]
sampling = st.one_of(values, st.dictionaries(st.sampled_from(SAMPLING_KEYS), values, max_size=6))
TOP_KEYS = ["text", "input_ids", "rid", "lora_path", "return_logprob", "return_text_in_logprobs", "stream",
            "priority", "custom_labels", "logprob_start_len", "image_data", "unknown"]
prompt_ids = st.lists(st.one_of(st.integers(min_value=-2, max_value=VOCAB_SIZE + 2), values), max_size=6)
bodies = st.fixed_dictionaries(
    {},
    optional={
        **{key: values for key in TOP_KEYS},
        "input_ids": st.one_of(prompt_ids, st.lists(prompt_ids, max_size=6), values),
        "sampling_params": st.one_of(sampling, st.lists(sampling, max_size=6)),
    })


def nesting(value: Any) -> int:
    """Levels of arrays and objects in ``value`` (a scalar has none)."""
    if isinstance(value, dict):
        return 1 + max(map(nesting, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(nesting, value), default=0)
    return 0


def check_parsed_or_refused(body: dict[str, Any]) -> None:
    try:
        parsed = parse_generate(body, LIMITS)
    except BadRequest as exc:
        assert str(exc)
        return
    assert isinstance(parsed, GenerateInput)
    assert 1 <= len(parsed.sequences) <= LIMITS.max_seqs
    for spec in parsed.sequences:
        temperature = spec.params.temperature
        assert temperature == 0.0 or temperature >= MIN_TEMPERATURE
        assert all(0 <= t < VOCAB_SIZE for t in spec.input_ids)
        assert len(spec.input_ids) + spec.params.max_new_tokens <= LIMITS.max_seq_len


@SETTINGS
@given(bodies)
@example({"input_ids": [1, 2], "sampling_params": {"temperature": 1e-300}})
@example({"input_ids": [1, 2], "sampling_params": {"temperature": 10**400}})
@example({"input_ids": [[1]] * 33})
@example({"input_ids": [[1]] * 8, "sampling_params": {"n": 5}})
@example({"text": ["1"] * 40})
def test_generated_generate_bodies_are_parsed_or_refused_with_bad_request(body: dict[str, Any]) -> None:
    check_parsed_or_refused(body)


@SETTINGS
@given(st.binary(max_size=200))
@example(b"[" * 100_000)
@example(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
@example(b'{"a": ' + b"9" * 5000 + b"}")
@example(b"\xff\xfe{}")
@example(b'{"a": NaN, "b": -Infinity}')
def test_random_bytes_are_a_json_object_or_bad_request(raw: bytes) -> None:
    try:
        body = parse_json(raw)
    except BadRequest as exc:
        assert str(exc)
        return
    assert isinstance(body, dict)


@SETTINGS
@given(st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                    max_leaves=8), st.integers(min_value=0, max_value=3 * MAX_JSON_DEPTH))
def test_generated_json_of_any_depth_parses_and_checks_or_is_refused(value: Any, depth: int) -> None:
    for _ in range(depth):
        value = [value]
    raw = json.dumps({"input_ids": value, "sampling_params": {"max_new_tokens": 1}}).encode()
    try:
        body = parse_json(raw)
    except BadRequest as exc:
        assert "nested too deeply" in str(exc) and nesting(json.loads(raw)) > MAX_JSON_DEPTH
        return
    assert nesting(body) <= MAX_JSON_DEPTH
    check_parsed_or_refused(body)
