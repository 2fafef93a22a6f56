"""A sample while it is being made: prompt, response, log-probs, weight versions, reward, status."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class Status(enum.StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


@dataclass
class Generation:
    """What one logical generate call produced, however many engine calls it took."""

    output_ids: list[int]
    log_probs: list[float]
    finish: str
    """SGLang finish reason type: stop, length or abort."""
    versions: list[int]
    """Every weight version the engines reported while generating (sorted, unique)."""
    engine_ids: list[str]
    calls: int = 1
    failovers: int = 0
    aborts: int = 0


@dataclass
class Sample:
    """One response to one prompt; ``group_index`` names the prompt group (GRPO)."""

    group_index: int
    index: int
    prompt: str
    prompt_ids: list[int]
    label: Any = None
    response_ids: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    reward: float | None = None
    status: Status = Status.PENDING
    remove_sample: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    def add_response(self, gen: Generation, *, trainable: bool = True) -> None:
        """Append a generated segment: its tokens, log-probs, versions; the status follows its finish reason."""
        self.response_ids.extend(gen.output_ids)
        self.rollout_log_probs.extend(gen.log_probs)
        self.loss_mask.extend([1 if trainable else 0] * len(gen.output_ids))
        self.weight_versions = sorted(set(self.weight_versions) | set(gen.versions))
        self.status = FINISH_STATUS.get(gen.finish, Status.FAILED)
        engines = self.metadata.setdefault("engine_ids", [])
        engines.extend(e for e in gen.engine_ids if e not in engines)

    def add_tokens(self, ids: Sequence[int]) -> None:
        """Append tokens that were not generated (a tool result, a user turn): not trained on."""
        self.response_ids.extend(ids)
        self.rollout_log_probs.extend([0.0] * len(ids))
        self.loss_mask.extend([0] * len(ids))

    @property
    def oldest_version(self) -> int:
        return min(self.weight_versions) if self.weight_versions else -1

    @property
    def newest_version(self) -> int:
        return max(self.weight_versions) if self.weight_versions else -1
