"""Generate functions: the default single-turn one and the context a custom one receives.

A generate plug-in is ``async def generate(ctx: GenerateContext, sample: Sample) -> Sample``.
``ctx.generate`` routes one call to an engine serving the request's policy (with
fail-over); a multi-turn plug-in calls it several times and appends non-generated
tokens with ``sample.add_tokens`` (loss mask 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollout_bus.events.rollouts import RolloutRequest
from rollout_bus.executor.engines import EngineCaller, EngineTime
from rollout_bus.executor.plugins import Tokenizer
from rollout_bus.executor.sample import Generation, Sample


@dataclass
class GenerateContext:
    request: RolloutRequest
    sampling_params: dict[str, Any]
    """SGLang ``sampling_params`` of the request."""
    tokenizer: Tokenizer
    caller: EngineCaller
    timer: EngineTime
    deadline: float | None
    """Monotonic time by which the request must be done."""

    async def generate(self, input_ids: Sequence[int], sampling_params: dict[str, Any] | None = None, *,
                       rid: str) -> Generation:
        return await self.caller.generate(
            self.request.policy, input_ids, sampling_params or self.sampling_params, rid=rid,
            deadline=self.deadline, timer=self.timer, evaluating=self.request.eval)


async def single_turn(ctx: GenerateContext, sample: Sample) -> Sample:
    """One ``/generate`` per sample with log-probs (miles' default)."""
    gen = await ctx.generate(sample.prompt_ids, rid=f"{ctx.request.request_id}.{sample.index}")
    sample.add_response(gen)
    sample.metadata["engine_calls"] = gen.calls
    sample.metadata["failovers"] = gen.failovers
    sample.metadata["aborts"] = gen.aborts
    sample.metadata["engines"] = list(gen.engine_ids)
    return sample
