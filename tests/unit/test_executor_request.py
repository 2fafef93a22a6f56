"""Rollout requests: validation messages, strict JSON round trip, deadlines, batch ids."""

from __future__ import annotations

import pytest

from rollout_bus.events.errors import InvalidRequest
from rollout_bus.events.rollouts import RolloutRequest, SamplingParams, now_ms


def test_a_request_round_trips_through_json() -> None:
    request = RolloutRequest.create("p", 3, 4, 8, timeout_s=30, data={"digits": 3}, eval=True,
                                    sampling=SamplingParams(temperature=0.7, stop_token_ids=(2,)))
    back = RolloutRequest.from_json(request.to_json())
    assert back == request
    assert back.batch_id == f"batch-{request.request_id}" and back.n_samples == 32
    assert 29 < (back.remaining_s() or 0) <= 30


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"policy": "bad policy"}, "policy 'bad policy': character ' ' at position 4 is not allowed"),
    ({"n_groups": 0}, "n_groups must be a positive integer"),
    ({"n_samples_per_group": True}, "n_samples_per_group must be a positive integer"),
    ({"rollout_id": -1}, "rollout_id must be a non-negative integer"),
    ({"request_id": "x" * 59}, "request_id"),
    ({"request_id": "a.b"}, "request_id 'a.b' must be 1-58 letters, digits, '_' or '-'"),
    ({"over_sample_groups": 1, "n_groups": 2}, "over_sample_groups must be an integer >= n_groups"),
    ({"sampling": SamplingParams(temperature=-1)}, "sampling.temperature"),
    ({"sampling": SamplingParams(top_k=0)}, "sampling.top_k must be -1"),
    ({"sampling": SamplingParams(stop_token_ids=(-3,))}, "sampling.stop_token_ids"),
    ({"deadline_ms": 1}, "deadline_ms is .* in the past"),
])
def test_validation_says_what_to_fix(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"policy": "p", "rollout_id": 0, "n_groups": 2, "n_samples_per_group": 2, **kwargs}
    with pytest.raises(InvalidRequest, match=message):
        RolloutRequest(**args).validate()  # type: ignore[arg-type]


def test_policy_must_be_known_when_a_list_is_given() -> None:
    RolloutRequest("p", 0, 1, 1).validate(None)
    with pytest.raises(InvalidRequest, match=r"unknown policy 'p' \(known: a, b\)"):
        RolloutRequest("p", 0, 1, 1).validate({"a", "b"})


def test_an_executor_accepts_a_passed_deadline_to_fail_it_itself() -> None:
    request = RolloutRequest("p", 0, 1, 1, deadline_ms=now_ms() - 1000)
    request.validate(check_deadline=False)
    assert (request.remaining_s() or 0) < 0


def test_from_json_is_strict() -> None:
    good = RolloutRequest("p", 0, 1, 1).to_json()
    with pytest.raises(InvalidRequest, match=r"unknown rollout request field\(s\) \['colour'\]"):
        RolloutRequest.from_json({**good, "colour": "red"})
    with pytest.raises(InvalidRequest, match=r"unknown sampling field\(s\) \['temp'\]"):
        RolloutRequest.from_json({**good, "sampling": {"temp": 1}})
    with pytest.raises(InvalidRequest, match="missing"):
        RolloutRequest.from_json({"policy": "p"})
    with pytest.raises(InvalidRequest, match="JSON object"):
        RolloutRequest.from_json([1, 2])
