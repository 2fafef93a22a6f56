"""Rollout requests have upper bounds and a temperature minimum, and the decoder answers every hostile
value with a request or an ``InvalidRequest``, nothing else."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rollout_bus.events.errors import InvalidRequest
from rollout_bus.events.rollouts import MIN_TEMPERATURE, RequestBounds, RolloutRequest, SamplingParams

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def request(**kwargs: Any) -> RolloutRequest:
    base: dict[str, Any] = {"policy": "p", "rollout_id": 0, "n_groups": 4, "n_samples_per_group": 4}
    return RolloutRequest(**{**base, **kwargs})


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n_groups": 10**9}, "n_groups is 1000000000, over the bound 4096 (RequestBounds.max_groups)"),
    ({"n_samples_per_group": 10**6}, "n_samples_per_group is 1000000, over the bound 1024 "
                                     "(RequestBounds.max_samples_per_group)"),
    ({"over_sample_groups": 10**9}, "over_sample_groups is 1000000000, over the bound 4096"),
    ({"sampling": SamplingParams(max_new_tokens=10**12)}, "sampling.max_new_tokens is 1000000000000, over the "
                                                          "bound 32768 (RequestBounds.max_new_tokens)"),
    ({"sampling": SamplingParams(stop_token_ids=tuple(range(10**6)))},
     "the number of sampling.stop_token_ids is 1000000, over the bound 256"),
    ({"n_groups": 4096, "n_samples_per_group": 1024}, "samples per round (max(n_groups, over_sample_groups) * "
                                                      "n_samples_per_group) is 4194304, over the bound 16384"),
    ({"n_groups": 16, "n_samples_per_group": 1024, "sampling": SamplingParams(max_new_tokens=32768)},
     "tokens per round (samples per round * sampling.max_new_tokens) is 536870912, over the bound 33554432"),
    ({"returned": [{"index": i} for i in range(5000)]}, "the number of returned items is 5000, over the bound 4096"),
    ({"sampling": SamplingParams(temperature=1e-300)}, f"sampling.temperature must be 0 (greedy) or a number in "
                                                       f"[{MIN_TEMPERATURE}, 100], got 1e-300"),
    ({"sampling": SamplingParams(temperature=10**400)}, "sampling.temperature must be 0 (greedy)"),
])
def test_a_request_past_a_bound_is_refused_naming_the_field_and_the_bound(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        request(**kwargs).validate()
    assert message in str(refused.value)


def test_bounds_are_configurable_and_the_defaults_accept_a_normal_request() -> None:
    request(n_groups=64, n_samples_per_group=16, over_sample_groups=128,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=1024)).validate()
    request(sampling=SamplingParams(temperature=MIN_TEMPERATURE)).validate()
    with pytest.raises(InvalidRequest, match=r"n_groups is 4, over the bound 2 \(RequestBounds.max_groups\)"):
        request().validate(bounds=RequestBounds(max_groups=2))
    request(n_groups=5000, n_samples_per_group=1).validate(bounds=RequestBounds(max_groups=5000))


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=10**300, max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=10),
    st.sampled_from([1e-300, 0, -1, 2**63, 10**9, MIN_TEMPERATURE]))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)
SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "bogus"]
FIELDS = ["request_id", "deadline_ms", "data", "eval",
          "over_sample_groups", "std_normalise", "returned", "bogus"]
requests = st.fixed_dictionaries(
    {"policy": st.one_of(st.just("p"), values), "rollout_id": st.one_of(st.just(1), values),
     "n_groups": st.one_of(st.integers(min_value=1, max_value=8), values),
     "n_samples_per_group": st.one_of(st.integers(min_value=1, max_value=8), values)},
    optional={**{name: values for name in FIELDS},
              "sampling": st.one_of(values, st.dictionaries(st.sampled_from(SAMPLING_FIELDS), values, max_size=5))})


@SETTINGS
@given(st.one_of(requests, values))
@example({"policy": "p", "rollout_id": 1, "n_groups": 1, "n_samples_per_group": 1,
          "sampling": {"temperature": 10**400}})
@example({"policy": "p", "rollout_id": 1, "n_groups": 10**9, "n_samples_per_group": 10**6,
          "over_sample_groups": 10**9, "sampling": {"max_new_tokens": 10**12, "stop_token_ids": [1] * 1000}})
@example({"policy": 5, "rollout_id": 1, "n_groups": 1, "n_samples_per_group": 1, "sampling": {"stop_token_ids": 3}})
def test_the_decoder_answers_any_value_with_a_request_or_invalid_request(data: Any) -> None:
    try:
        decoded = RolloutRequest.from_json(data)
        decoded.validate(check_deadline=False)
    except InvalidRequest as exc:
        assert str(exc)
        return
    bounds = RequestBounds()
    assert 1 <= decoded.n_groups <= bounds.max_groups and decoded.n_samples_per_group >= 1
    assert decoded.sampling.temperature == 0 or decoded.sampling.temperature >= MIN_TEMPERATURE
    assert RolloutRequest.from_json(decoded.to_json()) == decoded
