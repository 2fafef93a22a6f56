"""Samples to train data (miles' ``convert_samples_to_train_data``) and rollout metrics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rollout_bus.events.train_data import RAGGED_FIELDS, TrainData, group_normalise, ragged
from rollout_bus.executor.sample import Sample, Status


def to_train_data(samples: Sequence[Sample], *, rollout_id: int, std_normalise: bool = False,
                  eps: float = 1e-6, metadata: dict[str, Any] | None = None) -> TrainData:
    """The batch of ``samples``; rewards GRPO-normalised within each ``group_index``."""
    raw = torch.tensor([float(s.reward if s.reward is not None else 0.0) for s in samples], dtype=torch.float32)
    groups = torch.tensor([s.group_index for s in samples], dtype=torch.int64)
    n = len(samples)
    masks = [[0] * s.response_length if s.remove_sample else s.loss_mask for s in samples]
    return TrainData(
        tokens=ragged([s.tokens for s in samples], RAGGED_FIELDS["tokens"]),
        loss_masks=ragged(masks, RAGGED_FIELDS["loss_masks"]),
        rollout_log_probs=ragged([s.rollout_log_probs for s in samples],
                                           RAGGED_FIELDS["rollout_log_probs"]),
        prompt_lengths=torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.int64),
        response_lengths=torch.tensor([s.response_length for s in samples], dtype=torch.int64),
        rewards=group_normalise(raw, groups, std_normalise=std_normalise, eps=eps),
        raw_reward=raw,
        truncated=torch.tensor([s.status == Status.TRUNCATED for s in samples], dtype=torch.int32),
        sample_indices=torch.tensor([s.index for s in samples], dtype=torch.int64),
        group_indices=groups,
        rollout_ids=torch.full((n,), rollout_id, dtype=torch.int64),
        weight_versions=torch.tensor([s.oldest_version for s in samples], dtype=torch.int64),
        weight_versions_max=torch.tensor([s.newest_version for s in samples], dtype=torch.int64),
        metadata=dict(metadata or {}),
    )


def is_correct(sample: Sample) -> bool:
    """Whether a sample's answer is right: the reward's own verdict (``metadata["correct"]``, set by rewards
    that judge answers, such as ``tasks.math_reward``), else full reward (1 or more). Partial credit for
    form or for a wrong answer never counts."""
    verdict = sample.metadata.get("correct")
    if isinstance(verdict, bool):
        return verdict
    return float(sample.reward or 0.0) >= 1.0


def pass_at_n(groups: Sequence[Sequence[Sample]]) -> float:
    """The share of groups (one prompt's samples) with at least one correct sample (``is_correct``)."""
    return sum(any(is_correct(s) for s in g) for g in groups) / max(len(groups), 1)


def sample_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Reward, length, truncation and engine figures of a set of samples."""
    n = max(len(samples), 1)
    rewards = [float(s.reward or 0.0) for s in samples]
    versions = [v for s in samples for v in s.weight_versions]
    judged: dict[str, float] = {}
    for key in ("correct", "formatted"):  # set by rewards that judge answers (tasks.math_reward)
        marks = [s.metadata[key] for s in samples if isinstance(s.metadata.get(key), bool)]
        if marks:
            judged[f"{key}_frac"] = sum(marks) / len(marks)
    episodes = [s for s in samples if "session_id" in s.metadata]
    if episodes:  # agent episodes (executor.agents)
        m = len(episodes)
        judged.update(
            turns_mean=sum(int(s.metadata.get("turns", 0)) for s in episodes) / m,
            tool_calls_mean=sum(int(s.metadata.get("tool_calls", 0)) for s in episodes) / m,
            generation_s=sum(float(s.metadata.get("generation_s", 0.0)) for s in episodes),
            environment_s=sum(float(s.metadata.get("environment_s", 0.0)) for s in episodes),
            engine_switches=float(sum(int(s.metadata.get("engine_switches", 0)) for s in episodes)),
            episodes_failed=float(sum(s.metadata.get("session_status") in ("failed", "abandoned")
                                      for s in episodes)))
    return {**judged,
        "samples": float(len(samples)),
        "reward_mean": sum(rewards) / n,
        "response_len_mean": sum(s.response_length for s in samples) / n,
        "truncated_frac": sum(s.status == Status.TRUNCATED for s in samples) / n,
        "aborted_frac": sum(s.status == Status.ABORTED for s in samples) / n,
        "engine_calls": float(sum(int(s.metadata.get("engine_calls", 0)) for s in samples)),
        "failovers": float(sum(int(s.metadata.get("failovers", 0)) for s in samples)),
        "aborts": float(sum(int(s.metadata.get("aborts", 0)) for s in samples)),
        "min_weight_version": float(min(versions, default=-1)),
        "max_weight_version": float(max(versions, default=-1)),
    }
