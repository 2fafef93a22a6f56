"""The train-data wire schema: round trips, validation, GRPO normalisation, per-sample views."""

from __future__ import annotations

import pytest
import torch

from rollout_bus.events.batch import decode, encode
from rollout_bus.events.errors import DecodeError
from rollout_bus.events.train_data import (
    RAGGED_FIELDS,
    SCALAR_FIELDS,
    TrainData,
    group_normalise,
    ragged,
    wire_names,
)


def make(n_groups: int = 2, per_group: int = 3) -> TrainData:
    n = n_groups * per_group
    prompts = [[1, 5, 6, 7][: 2 + i % 2] for i in range(n)]
    responses = [[9] * (1 + i) for i in range(n)]
    raw = torch.tensor([float(i % 2) for i in range(n)], dtype=torch.float32)
    groups = torch.arange(n_groups).repeat_interleave(per_group)
    return TrainData(
        tokens=ragged([p + r for p, r in zip(prompts, responses, strict=True)], torch.int32),
        loss_masks=ragged([[1] * len(r) for r in responses], torch.int32),
        rollout_log_probs=ragged([[-0.5] * len(r) for r in responses], torch.float32),
        prompt_lengths=torch.tensor([len(p) for p in prompts], dtype=torch.int64),
        response_lengths=torch.tensor([len(r) for r in responses], dtype=torch.int64),
        rewards=group_normalise(raw, groups), raw_reward=raw,
        truncated=torch.zeros(n, dtype=torch.int32), sample_indices=torch.arange(n),
        group_indices=groups, rollout_ids=torch.full((n,), 4), weight_versions=torch.zeros(n, dtype=torch.int64),
        weight_versions_max=torch.ones(n, dtype=torch.int64), metadata={"request_id": "r1"})


def test_train_data_round_trips_through_the_batch_wire_format() -> None:
    data = make()
    fields, meta = data.to_tensors()
    assert sorted(fields) == sorted(wire_names())
    back = TrainData.from_batch(decode(encode(fields, meta).tobytes()))
    for name in SCALAR_FIELDS:
        assert torch.equal(getattr(back, name), getattr(data, name)), name
    for name in RAGGED_FIELDS:
        assert torch.equal(getattr(back, name).values, getattr(data, name).values), name
        assert torch.equal(getattr(back, name).offsets, getattr(data, name).offsets), name
    assert back.metadata == {"request_id": "r1"}


def test_every_field_has_its_wire_dtype() -> None:
    fields, _ = make().to_tensors()
    for name, dtype in SCALAR_FIELDS.items():
        assert fields[name].dtype == dtype  # type: ignore[union-attr]
    for name, dtype in RAGGED_FIELDS.items():
        assert fields[name].values.dtype == dtype  # type: ignore[union-attr]
        assert fields[name].offsets.dtype == torch.int64  # type: ignore[union-attr]


def test_per_sample_views_split_prompt_and_response() -> None:
    data = make()
    views = list(data.samples())
    assert len(views) == len(data) == 6
    v = views[2]
    assert v.prompt_tokens.tolist() == [1, 5] and v.response_tokens.tolist() == [9, 9, 9]
    assert v.loss_mask.tolist() == [1, 1, 1] and v.rollout_log_probs.tolist() == [-0.5] * 3
    assert (v.group_index, v.sample_index, v.rollout_id) == (0, 2, 4)
    sub = data.select([5, 0])
    assert sub.sample_indices.tolist() == [5, 0] and sub.sample(0).response_length == 6


def test_malformed_train_data_is_a_decode_error_naming_the_field() -> None:
    fields, meta = make().to_tensors()
    with pytest.raises(DecodeError, match="lacks field"):
        TrainData.from_tensors({k: v for k, v in fields.items() if k != "rewards"}, meta)
    bad = dict(fields, rewards=fields["rewards"].to(torch.float64))  # type: ignore[union-attr]
    with pytest.raises(DecodeError, match="rewards"):
        TrainData.from_tensors(bad, meta)
    short = dict(fields, loss_masks=ragged([[1]] * 6, torch.int32))
    with pytest.raises(DecodeError, match="loss_masks"):
        TrainData.from_tensors(short, meta)
    with pytest.raises(DecodeError, match="schema"):
        TrainData.from_tensors(fields, {**meta, "schema": "train_data/99"})


def test_group_normalise_centres_each_group() -> None:
    raw = torch.tensor([1.0, 0.0, 0.0, 0.0, 5.0, 5.0])
    groups = torch.tensor([0, 0, 0, 0, 7, 7])
    out = group_normalise(raw, groups)
    assert torch.allclose(out, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0]))


def test_group_normalise_divides_by_the_group_std_when_asked() -> None:
    raw = torch.tensor([1.0, 0.0, 1.0, 0.0, 3.0])
    groups = torch.tensor([0, 0, 0, 0, 1])
    out = group_normalise(raw, groups, std_normalise=True, eps=1e-6)
    std = torch.tensor([1.0, 0.0, 1.0, 0.0]).std()
    assert torch.allclose(out[:4], (torch.tensor([1.0, 0.0, 1.0, 0.0]) - 0.5) / (std + 1e-6))
    assert out[4].item() == 0.0  # a group of one: no signal, no NaN
    equal = group_normalise(torch.ones(3), torch.zeros(3, dtype=torch.int64), std_normalise=True)
    assert equal.tolist() == [0.0, 0.0, 0.0]


def test_an_empty_batch_is_valid() -> None:
    empty = make(0, 0)
    assert len(empty) == 0
    fields, meta = empty.to_tensors()
    assert len(TrainData.from_tensors(fields, meta)) == 0
