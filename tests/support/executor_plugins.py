"""Plug-ins for the executor's bad-input tests."""

from __future__ import annotations

from typing import Any

from rollout_bus.executor.sample import Sample
from rollout_bus.tasks.arithmetic import ArithmeticSource


class MalformedSource(ArithmeticSource):
    """Arithmetic prompts, except that item 1 has no prompt at all."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.name = "malformed-" + self.name

    def item(self, index: int) -> dict[str, Any]:
        if index == 1:
            return {"index": index, "prompt": None, "label": "?"}
        return super().item(index)


def exploding_reward(sample: Sample) -> float:
    raise ZeroDivisionError("the reward model fell over")


async def half_reward(samples: list[Sample]) -> list[float]:
    """A group reward: 1 for the first half of the group, 0 for the rest."""
    return [1.0 if i < len(samples) // 2 else 0.0 for i in range(len(samples))]


async def scripted_generate(ctx: Any, sample: Sample) -> Sample:
    """No engine: even prompt groups get one right answer per two samples, odd groups only wrong ones."""
    from rollout_bus.executor.sample import Generation
    from rollout_bus.lm import tokenizer

    right = sample.group_index % 2 == 0 and sample.index % 2 == 0
    ids = tokenizer.encode(str(sample.label) if right else "x") + [tokenizer.EOS_ID]
    sample.add_response(Generation(ids, [-1.0] * len(ids), "stop", [3], ["fake"]))
    return sample


def bad_group_reward(samples: list[Sample]) -> list[float]:
    return [1.0, 0.0]


# --- agent episodes (executor --agent) -----------------------------------------------------------

async def steady_episode(client: Any, item: dict[str, Any]) -> float:
    """Six turns whose messages depend only on the replies (so a retried episode asks the same things),
    with a pause between turns as an environment would take: the reward is the number of turns / 6."""
    import asyncio

    messages: list[dict[str, Any]] = [{"role": "user", "content": f"game {item['index']}. say something."}]
    for turn in range(6):
        reply = await client.chat.completions.create(model="p", messages=messages, max_tokens=6)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        messages.append({"role": "user", "content": f"turn {turn + 1}. again."})
        await asyncio.sleep(0.3)
    return 1.0


async def raising_episode(client: Any, item: dict[str, Any]) -> float:
    """One turn, then the environment breaks."""
    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    raise RuntimeError("the sandbox fell over")


GATES_ENV = "ROLLOUT_BUS_TEST_GATES"


async def gated_generate(ctx: Any, sample: Sample) -> Sample:
    """No engine: holds the job until the file ``$ROLLOUT_BUS_TEST_GATES/<request id>`` exists, then answers the
    right label (a test decides when each job finishes)."""
    import asyncio
    import os
    from pathlib import Path

    from rollout_bus.executor.sample import Generation
    from rollout_bus.lm import tokenizer

    gate = Path(os.environ[GATES_ENV]) / ctx.request.request_id
    while not gate.exists():
        await asyncio.sleep(0.05)
    ids = tokenizer.encode(str(sample.label)) + [tokenizer.EOS_ID]
    sample.add_response(Generation(ids, [-1.0] * len(ids), "stop", [0], ["gated"]))
    return sample
