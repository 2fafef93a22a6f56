"""One sequence in the scheduler (a prompt, or one of its ``n`` samples) and what it reports."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout_bus.engine.codec import Codec
from rollout_bus.engine.protocol import SamplingParams, SequenceSpec

logger = logging.getLogger(__name__)

FinishReason = dict[str, Any]


@dataclass(frozen=True)
class Progress:
    """A snapshot of a sequence, handed from the scheduler thread to the HTTP side."""

    spec: SequenceSpec
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[str, ...]  # the weight version that produced each output token
    finish: FinishReason | None
    weight_version: str
    e2e_latency: float
    retractions: int = 0
    cached_tokens: int = 0


Sink = Callable[[Progress], None]


@dataclass(eq=False)
class Seq:
    spec: SequenceSpec
    sink: Sink
    stream: bool = False
    arrival_s: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    retractions: int = 0
    in_batch: bool = False  # the decode batch caches tokens()[:-1]; False means prefill next
    finish: FinishReason | None = None
    cached_tokens: int = 0  # tokens its prefills took from the prefix cache
    prefix_source: Any = None  # the prefix-cache entry its last prefill started from
    cache_generation: int | None = None  # the prefix cache's generation at its last prefill

    @property
    def rid(self) -> str:
        return self.spec.rid

    @property
    def params(self) -> SamplingParams:
        return self.spec.params

    def tokens(self) -> list[int]:
        return [*self.spec.input_ids, *self.output_ids]

    def append(self, token: int, logprob: float, version: str) -> None:
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)

    def emit(self, weight_version: str) -> None:
        progress = Progress(
            spec=self.spec,
            output_ids=tuple(self.output_ids),
            logprobs=tuple(self.logprobs),
            versions=tuple(self.versions),
            finish=self.finish,
            weight_version=weight_version,
            e2e_latency=time.monotonic() - self.arrival_s,
            retractions=self.retractions,
            cached_tokens=self.cached_tokens,
        )
        try:
            self.sink(progress)
        except Exception:
            logger.exception("could not deliver progress of %s", self.rid)


def finish_reason_after(seq: Seq, codec: Codec) -> FinishReason | None:
    """Why ``seq`` stops after its latest token, or None to go on."""
    token = seq.output_ids[-1]
    params = seq.params
    if token in codec.eos_ids and not params.ignore_eos:
        return {"type": "stop", "matched": token}
    if token in params.stop_token_ids:
        return {"type": "stop", "matched": token}
    if params.stop:
        text = codec.decode(seq.output_ids, skip_special_tokens=params.skip_special_tokens)
        for stop in params.stop:
            if text.endswith(stop):
                return {"type": "stop", "matched": stop}
    if len(seq.output_ids) >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    return None


def abort_reason(message: str, status_code: int | None = None) -> FinishReason:
    """SGLang's FINISH_ABORT: ``status_code`` stays None for deliberate aborts, set for failures."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}
