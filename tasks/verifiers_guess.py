"""The number-guessing game as a ``verifiers`` (0.4.0) environment: a taskset, its task and rubric, the
environment's turn loop and an in-process chat harness, written with verifiers' own classes.

verifiers 0.4.0 splits an environment into a ``Taskset`` (data in, typed tasks out), a ``Task`` whose
``@vf.reward`` methods are the rubric, an ``Env`` whose ``run(task, agents)`` is the interaction protocol
(here: the model guesses, the environment answers "higher" or "lower" as the user, until a win or
``max_turns`` guesses), and a ``Harness``, the program that plays the seat and reaches the model only
through verifiers' interception server, which records every call on the trace and relays it to the
endpoint of the run's ``ModelContext``. The harness here is the smallest chat loop, run in-process
(verifiers' own ``null`` harness runs the same loop as a ``uv`` script that it installs from the
network). The game is ``tasks.guess``'s: the same secrets, answers and reward.

This module imports verifiers; ``tasks.verifiers_env`` loads it only when an episode runs. verifiers
resolves tasksets, environments and harnesses by package name (``PLUGIN_ID``); ``tasks.verifiers_env``
registers this module under it.
"""

from __future__ import annotations

import functools
import itertools
import ssl
from collections.abc import Iterator
from typing import Any, Literal

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

from rollout_bus.tasks.guess import CLOSENESS_CREDIT, MAX_TURNS, GuessSource, answer, first_number

PLUGIN_ID = "rollout_bus_verifiers_guess"
"""The package name verifiers loads this module as (``taskset.id`` and the harness id)."""
WIN = "yes."
CONNECT_TIMEOUT_S = 120.0


class GuessTasksetConfig(vf.TasksetConfig):
    low: int = 1
    high: int = 100
    max_turns: int = MAX_TURNS
    seed: int = 0
    size: int | None = None
    """Games before the taskset repeats; None: endless."""
    split: Literal["train", "eval"] = "train"


class GuessData(vf.TaskData):
    secret: int
    low: int
    high: int
    max_turns: int


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    """One game; its rewards are the rubric: 1 for a win, else ``CLOSENESS_CREDIT`` times how close the
    last real guess came (``tasks.guess.score``)."""

    @vf.reward(weight=1.0)
    async def won(self, task: GuessData, trace: vf.Trace) -> float:
        return 1.0 if task.secret in guesses(trace) else 0.0

    @vf.reward(weight=CLOSENESS_CREDIT)
    async def closeness(self, task: GuessData, trace: vf.Trace) -> float:
        said = guesses(trace)
        real = [g for g in said if g is not None]
        if task.secret in said or not real:
            return 0.0
        return max(0.0, 1.0 - abs(real[-1] - task.secret) / max(task.high - task.low, 1))

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


def guesses(trace: vf.Trace) -> list[int | None]:
    """The number in each of the model's replies (None where it gave none)."""
    return [first_number(m.content if isinstance(m.content, str) else "") for m in trace.assistant_messages]


class GuessTaskset(vf.Taskset[GuessTask, GuessTasksetConfig]):
    """Game ``i`` has ``GuessSource``'s secret for index ``i``: the same games as ``tasks.guess``."""

    def __init__(self, config: GuessTasksetConfig) -> None:
        super().__init__(config)
        self.source = GuessSource(low=config.low, high=config.high, max_turns=config.max_turns, seed=config.seed,
                                  size=config.size, split=config.split)
        self.INFINITE = config.size is None

    def task(self, index: int) -> GuessTask:
        item = self.source.item(index)
        data = GuessData(idx=index, name=f"guess-{index}", prompt=str(item["prompt"]), secret=int(item["label"]),
                         low=self.config.low, high=self.config.high, max_turns=self.config.max_turns)
        return GuessTask(data, self.config.task)

    def load(self) -> Iterator[GuessTask]:
        indices = itertools.count() if self.config.size is None else range(self.config.size)
        return (self.task(i) for i in indices)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())
    """The seat the policy plays, with the taskset's harness (``ChatHarness``, exported beside it); the
    harness runs in-process, so the runtime is the host's."""


class GuessEnv(vf.Env[GuessEnvConfig]):
    """The interaction protocol: the model guesses, the environment answers as the run's user."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        data = task.data
        assert isinstance(data, GuessData)
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()  # the rules are the prompt: the model guesses first
            for _ in range(data.max_turns - 1):
                if segment.terminated:
                    break
                said = answer(first_number(segment.last_reply), data.secret)
                if said == WIN:
                    break
                segment = await interaction.turn(said)


def env_config(taskset: dict[str, Any]) -> GuessEnvConfig:
    """The environment's config over a taskset with these options (one interception server, on loopback)."""
    from verifiers.v1.interception import InterceptionServerConfig

    return GuessEnvConfig(taskset=GuessTasksetConfig(id=PLUGIN_ID, **taskset), interception=InterceptionServerConfig())


class ChatHarnessConfig(vf.HarnessConfig):
    id: str = PLUGIN_ID


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """One chat completion per segment through the interception endpoint, in-process; a later segment
    is the default ``resume``: the conversation so far plus the user's new message."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def setup(self, runtime: vf.Runtime) -> None:
        return None

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData, **_: Any) -> vf.ProgramResult:
        import httpx
        import openai

        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages.extend(message_to_wire(m) for m in prompt)
        # the endpoint is on loopback, but a busy event loop may take long to accept: the rollout's own
        # timeouts bound the wait, not a connect timeout of the SDK's
        http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S), verify=_tls())
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=http) as client:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)  # type: ignore[arg-type]
        return vf.ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "", stderr="")


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every segment's client: building one reads the CA store (tens of ms), which
    per segment would cost more than the model call on the tiny LM."""
    return ssl.create_default_context()


__all__ = ["ChatHarness", "GuessEnv", "GuessTaskset"]
