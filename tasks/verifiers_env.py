"""``verifiers`` environments as agents: a verifiers environment's own rollout and rubric, run unchanged
through the session gateway.

``VerifiersSource`` serves a verifiers taskset's tasks as items (each carries its task's wire data);
``episode`` plays one through the environment's own machinery (``Env.run_episode``: its interaction
protocol, its harness behind verifiers' interception server, its rubric) with the session's
``openai.AsyncOpenAI`` client as the endpoint, and returns the rubric's reward. Every model call reaches
the session's base URL, so the session records the episode token for token.

    rollout-bus run --agent verifiers-guess      # the number game as a verifiers environment, tiny LM

verifiers is an optional dependency (``pip install -e '.[agents]'``): it is imported only when a source
or an episode is made, and its absence is an error that says so. ``ENVS`` names the environments: ``guess``
is ``tasks.verifiers_guess``, the number game of ``tasks.guess`` written with verifiers' classes.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from rollout_bus.tasks.guess import MAX_TURNS
from rollout_bus.tasks.indexed import IndexedSource

ENVS = {"guess": "rollout_bus.tasks.verifiers_guess"}
"""``env`` option -> the module that defines the environment: its ``Env``, taskset and harness exported
through ``__all__``, ``PLUGIN_ID`` (the package name verifiers loads it by) and ``env_config(options)``."""
MODEL = "policy"
"""The model name the environment asks for; the session serves its own policy whatever the name."""
MAX_TOKENS = 8
"""Tokens per reply (``tasks.guess.episode`` asks for as many)."""
VERSION = "0.4."
"""The verifiers releases the environments are written for (its API changes between minor releases)."""
API_KEY_ENV = "ROLLOUT_BUS_GATEWAY_API_KEY"
"""verifiers reads an endpoint's key from an environment variable: the client's gateway key
(``gateway.keys.GATEWAY_API_KEY_ENV``, which an executor sets for its own agents), never the engines'."""


def verifiers() -> Any:
    """``verifiers.v1``, or an error that says how to install it."""
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError(f"the verifiers environments need the verifiers package (pip install -e '.[agents]', "
                          f"or verifiers==0.4.0): {exc}") from None
    import verifiers as package

    if not str(package.__version__).startswith(VERSION):
        raise ImportError(f"the verifiers environments are written for verifiers {VERSION}x, whose API differs from "
                          f"the installed {package.__version__}: pip install 'verifiers=={VERSION}0'")
    return vf


def load(env: str) -> Any:
    """The module of environment ``env``, registered under its verifiers package name."""
    if env not in ENVS:
        raise ValueError(f"unknown verifiers environment {env!r}; choose one of {sorted(ENVS)}")
    verifiers()
    module = importlib.import_module(ENVS[env])
    sys.modules.setdefault(module.PLUGIN_ID, module)  # verifiers imports plug-ins by package name
    return module


def make_env(env: str, taskset: dict[str, Any]) -> Any:
    """A fresh verifiers ``Env`` of ``env`` over a taskset with these options (cheap: one per episode, so
    concurrent episodes never share its serving state)."""
    module = load(env)
    return verifiers().load_environment(module.env_config(taskset))


class VerifiersSource(IndexedSource):
    """Tasks of a verifiers environment's taskset by sequence number (``GuessSource``'s options)."""

    def __init__(self, env: str = "guess", low: int = 1, high: int = 100, max_turns: int = MAX_TURNS, seed: int = 0,
                 size: int | None = None, split: str = "train") -> None:
        from rollout_bus.tasks.guess import GuessSource

        GuessSource(low=low, high=high, max_turns=max_turns, seed=seed, size=size, split=split)  # the same checks
        super().__init__()
        self.env_name = env
        self.taskset = {"low": low, "high": high, "max_turns": max_turns, "seed": seed, "size": size, "split": split}
        self.env = make_env(env, self.taskset)
        self.name = f"verifiers-{env}-{split}-{low}-{high}-t{max_turns}-s{seed}" + (f"-n{size}" if size else "")

    def item(self, index: int) -> dict[str, Any]:
        task = self.env.taskset.task(index)
        data = task.data
        return {"index": index, "prompt": data.prompt_text, "label": int(data.secret),
                "metadata": {"env": self.env_name, "taskset": dict(self.taskset),
                             "task": data.model_dump(mode="json", exclude_none=True)}}


def model_context(client: Any, model: str = MODEL, max_tokens: int = MAX_TOKENS) -> Any:
    """verifiers' ``ModelContext`` for the endpoint ``client`` (an ``openai.AsyncOpenAI``) is bound to."""
    vf = verifiers()
    key = str(getattr(client, "api_key", "") or "")
    if key not in ("", "none", "EMPTY") and os.environ.get(API_KEY_ENV) != key:
        raise ValueError(f"verifiers reads the endpoint's API key from ${API_KEY_ENV}: set it to the client's "
                         "gateway key")
    endpoint = vf.EvalClientConfig(base_url=str(client.base_url).rstrip("/"), api_key_var=API_KEY_ENV)
    return vf.ModelContext(model=model, client=endpoint, sampling=vf.Sampling(max_tokens=max_tokens))


def task_of(env: Any, item: dict[str, Any]) -> Any:
    """The verifiers task an item carries (its wire data, validated by the task's own model)."""
    task_type = type(env.taskset).task_type()
    data = task_type.data_type().model_validate((item.get("metadata") or {}).get("task"))
    return task_type(data, env.taskset.config.task)


async def rollout(env: Any, task: Any, client: Any, model: str = MODEL) -> Any:
    """One episode of ``task``: the environment's own rollout and rubric against ``client``'s endpoint;
    verifiers' ``Episode`` (its traces carry the transcript, the rewards and the errors)."""
    async with env.serving():
        return await env.run_episode(task, model_context(client, model))


async def episode(client: Any, item: dict[str, Any]) -> float:
    """The agent: one verifiers episode through ``client`` (bound to the session); the rubric's reward."""
    meta = item.get("metadata") or {}
    env = make_env(str(meta.get("env", "guess")), dict(meta.get("taskset") or {}))
    result = await rollout(env, task_of(env, item), client)
    if not result.ok:
        errors = [e for trace in result.traces for e in trace.errors] + list(result.errors)
        detail = "; ".join(f"{e.type}: {e.message}" for e in errors)[:500] or "no error recorded"
        raise RuntimeError(f"the verifiers episode failed: {detail}")
    return float(sum(trace.reward for trace in result.traces))


__all__ = ["ENVS", "VerifiersSource", "episode", "make_env", "model_context", "rollout", "task_of"]
