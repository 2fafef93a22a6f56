"""The train-data wire schema: every batch field's name, dtype and shape, in one place.

A sample batch is columnar. Per-sample scalars are 1-D tensors of length ``n``; ragged
per-sample sequences are ``events.batch.Ragged`` fields: flat values plus int64 offsets
(length ``n + 1``, ``offsets[0] == 0``), so sample ``i`` is ``values[offsets[i]:offsets[i+1]]``;
the batch wire format (``events.batch``) carries them as such. Small metadata (ids,
counts, metrics) is a plain msgpack-able dict beside the tensors.

Pure torch: no Redis here. The executor builds ``TrainData`` from samples and publishes
``to_tensors()``; a trainer rebuilds it with ``from_tensors`` or ``from_batch``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rollout_bus.events.batch import Batch, Ragged
from rollout_bus.events.errors import DecodeError

SCHEMA = "train_data/1"

#: Ragged fields: name -> dtype of the values. Offsets are always int64.
RAGGED_FIELDS: dict[str, torch.dtype] = {
    "tokens": torch.int32,             # prompt + response token ids
    "loss_masks": torch.int32,         # per response token: 1 trains, 0 does not (all 0: removed sample)
    "rollout_log_probs": torch.float32,  # per response token: log-prob under the engine that made it
}

#: Per-sample fields: name -> dtype, each a 1-D tensor of length n.
SCALAR_FIELDS: dict[str, torch.dtype] = {
    "prompt_lengths": torch.int64,
    "response_lengths": torch.int64,
    "rewards": torch.float32,          # GRPO-normalised per prompt group
    "raw_reward": torch.float32,       # what the reward function returned
    "truncated": torch.int32,          # 1 when generation stopped at max_new_tokens
    "sample_indices": torch.int64,     # group_index * n_samples_per_group + position in the group
    "group_indices": torch.int64,      # the data source's sequence number of the prompt (unique per run)
    "rollout_ids": torch.int64,
    "weight_versions": torch.int64,    # the oldest weight version seen while generating the sample
    "weight_versions_max": torch.int64,  # the newest one (differs when weights changed mid-sample)
}


def wire_names() -> list[str]:
    """Every field name ``to_tensors`` writes (ragged ones first)."""
    return [*RAGGED_FIELDS, *SCALAR_FIELDS]


def ragged(rows: Sequence[Sequence[int] | Sequence[float]], dtype: torch.dtype) -> Ragged:
    """A ragged field of Python rows (one tensor built from the flat list, no per-row tensors)."""
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    if rows:
        torch.cumsum(torch.tensor([len(r) for r in rows], dtype=torch.int64), 0, out=offsets[1:])
    return Ragged(torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=dtype), offsets)


@dataclass(frozen=True)
class SampleView:
    """One sample of a batch, as views into the batch's tensors."""

    tokens: Tensor
    prompt_length: int
    response_length: int
    loss_mask: Tensor
    rollout_log_probs: Tensor
    reward: float
    raw_reward: float
    truncated: bool
    sample_index: int
    group_index: int
    rollout_id: int
    weight_version: int
    weight_version_max: int

    @property
    def prompt_tokens(self) -> Tensor:
        return self.tokens[:self.prompt_length]

    @property
    def response_tokens(self) -> Tensor:
        return self.tokens[self.prompt_length:]


@dataclass
class TrainData:
    """A batch of samples in wire layout; see ``RAGGED_FIELDS`` and ``SCALAR_FIELDS``."""

    tokens: Ragged
    loss_masks: Ragged
    rollout_log_probs: Ragged
    prompt_lengths: Tensor
    response_lengths: Tensor
    rewards: Tensor
    raw_reward: Tensor
    truncated: Tensor
    sample_indices: Tensor
    group_indices: Tensor
    rollout_ids: Tensor
    weight_versions: Tensor
    weight_versions_max: Tensor
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def __len__(self) -> int:
        return int(self.response_lengths.numel())

    # --- wire --------------------------------------------------------------------------
    def to_tensors(self) -> tuple[dict[str, Tensor | Ragged], dict[str, Any]]:
        """Fields by wire name (``Ragged`` for ragged ones, for ``events.batch.encode``) and the metadata."""
        out: dict[str, Tensor | Ragged] = {}
        for name in RAGGED_FIELDS:
            rows: Ragged = getattr(self, name)
            out[name] = Ragged(rows.values.contiguous(), rows.offsets.contiguous())
        for name in SCALAR_FIELDS:
            out[name] = getattr(self, name).contiguous()
        return out, {**self.metadata, "schema": SCHEMA}

    @classmethod
    def from_tensors(cls, fields: Mapping[str, Tensor | Ragged], meta: Mapping[str, Any] | None = None) -> TrainData:
        """Rebuild from ``to_tensors`` output; ``DecodeError`` naming the field when anything is off."""
        meta = dict(meta or {})
        schema = meta.pop("schema", SCHEMA)
        if schema != SCHEMA:
            raise DecodeError(f"train data schema {schema!r}, expected {SCHEMA!r}")
        missing = [n for n in wire_names() if n not in fields]
        if missing:
            raise DecodeError(f"train data lacks field(s) {missing}")
        kwargs: dict[str, Any] = {}
        for name in RAGGED_FIELDS:
            if not isinstance(fields[name], Ragged):
                raise DecodeError(f"{name} must be a ragged field (values + offsets)")
            kwargs[name] = fields[name]
        for name in SCALAR_FIELDS:
            if not isinstance(fields[name], Tensor):
                raise DecodeError(f"{name} must be a tensor")
            kwargs[name] = fields[name]
        try:
            return cls(**kwargs, metadata=meta)
        except ValueError as exc:
            raise DecodeError(f"malformed train data: {exc}") from None

    @classmethod
    def from_batch(cls, batch: Batch) -> TrainData:
        """Rebuild from a decoded ``events.batch.Batch`` (tensors share its buffer)."""
        return cls.from_tensors({**batch.tensors, **batch.ragged}, batch.meta)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field with a wrong dtype, shape or value.

        Values are checked too, since one bad value poisons a training step: rewards (the GRPO
        advantages), raw rewards and rollout log-probs must be finite, token ids and lengths
        non-negative, every prompt at least one token long (a response token's log-prob sits at
        the column of the token before it), loss masks 0 or 1. Ids in the vocabulary need the
        model: ``check_vocab``.
        """
        n = len(self)
        for name, dtype in SCALAR_FIELDS.items():
            t: Tensor = getattr(self, name)
            if t.dtype != dtype or t.dim() != 1 or t.numel() != n:
                raise ValueError(f"{name}: expected {dtype} of shape ({n},), got {t.dtype} {tuple(t.shape)}")
        for name, dtype in RAGGED_FIELDS.items():
            r: Ragged = getattr(self, name)
            if r.values.dtype != dtype or r.values.dim() != 1:
                raise ValueError(f"{name}: expected 1-D {dtype} values, got {r.values.dtype} {tuple(r.values.shape)}")
            off = r.offsets
            if off.dtype != torch.int64 or off.dim() != 1 or off.numel() != n + 1:
                raise ValueError(f"{name}: expected int64 offsets of shape ({n + 1},), got {off.dtype} "
                                 f"{tuple(off.shape)}")
            if int(off[0]) != 0 or int(off[-1]) != r.values.numel() or bool((off[1:] < off[:-1]).any()):
                raise ValueError(f"{name}: offsets must rise from 0 to {r.values.numel()}")
        if not torch.equal(self.tokens.lengths, self.prompt_lengths + self.response_lengths):
            raise ValueError("tokens: row lengths must equal prompt_lengths + response_lengths")
        for name in ("loss_masks", "rollout_log_probs"):
            if not torch.equal(getattr(self, name).lengths, self.response_lengths):
                raise ValueError(f"{name}: row lengths must equal response_lengths")
        self._validate_values()

    def _validate_values(self) -> None:
        for name, t in (("rewards", self.rewards), ("raw_reward", self.raw_reward),
                        ("rollout_log_probs", self.rollout_log_probs.values)):
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"{name}: value {float(t[i])!r} at index {i} is not finite")
        if bool((self.response_lengths < 0).any()) or bool((self.prompt_lengths < 1).any()):
            raise ValueError("prompt_lengths must be >= 1 and response_lengths >= 0")
        tokens = self.tokens.values
        if tokens.numel() and int(tokens.min()) < 0:
            raise ValueError(f"tokens: negative token id {int(tokens.min())}")
        masks = self.loss_masks.values
        if bool(((masks != 0) & (masks != 1)).any()):
            raise ValueError("loss_masks: values must be 0 or 1")

    def check_vocab(self, vocab_size: int) -> None:
        """``DecodeError`` when a token id is outside ``[0, vocab_size)`` (it would fail inside the model)."""
        tokens = self.tokens.values
        if tokens.numel() and int(tokens.max()) >= vocab_size:
            raise DecodeError(f"tokens: id {int(tokens.max())} is outside the model's vocabulary of {vocab_size}")

    # --- views -------------------------------------------------------------------------
    def sample(self, i: int) -> SampleView:
        return SampleView(
            tokens=self.tokens[i], prompt_length=int(self.prompt_lengths[i]),
            response_length=int(self.response_lengths[i]), loss_mask=self.loss_masks[i],
            rollout_log_probs=self.rollout_log_probs[i], reward=float(self.rewards[i]),
            raw_reward=float(self.raw_reward[i]), truncated=bool(self.truncated[i]),
            sample_index=int(self.sample_indices[i]), group_index=int(self.group_indices[i]),
            rollout_id=int(self.rollout_ids[i]), weight_version=int(self.weight_versions[i]),
            weight_version_max=int(self.weight_versions_max[i]))

    def samples(self) -> Iterator[SampleView]:
        for i in range(len(self)):
            yield self.sample(i)

    def select(self, indices: Sequence[int]) -> TrainData:
        """A new batch with the samples at ``indices``, in that order (metadata shared)."""
        idx = torch.tensor(list(indices), dtype=torch.int64)
        kwargs: dict[str, Any] = {name: getattr(self, name)[idx] for name in SCALAR_FIELDS}
        for name, dtype in RAGGED_FIELDS.items():
            rows = getattr(self, name)
            kwargs[name] = Ragged.from_list([rows[i] for i in idx.tolist()], dtype)
        return TrainData(**kwargs, metadata=dict(self.metadata))


def group_normalise(raw: Tensor, group_indices: Tensor, *, std_normalise: bool = False,
                    eps: float = 1e-6) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std + eps when asked.

    The std is the unbiased one (as miles); a group of one sample gets 0.
    """
    raw = raw.to(torch.float32)
    out = torch.zeros_like(raw)
    for g in torch.unique(group_indices).tolist():
        sel = group_indices == g
        r = raw[sel]
        centred = r - r.mean()
        if std_normalise:
            std = r.std() if r.numel() > 1 else torch.zeros(())
            centred = centred / (std + eps)
        out[sel] = centred
    return out
