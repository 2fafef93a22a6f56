"""One rollout request, from prompts to train data, on the executor's event loop.

Per sampling round: reserve prompts (``CursorStore``), generate every sample of every
group concurrently, score each group as soon as its samples are done, apply the dynamic
filter, and stop as soon as ``n_groups`` groups are kept; unfinished groups are
cancelled and their prompts go back to the pool. Rounds repeat (up to
``max_sampling_rounds``) while the filter leaves fewer than ``n_groups``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from rollout_bus.events.rollouts import RolloutRequest
from rollout_bus.events.train_data import TrainData
from rollout_bus.executor.agents import split_turns
from rollout_bus.executor.convert import is_correct, pass_at_n, sample_metrics, to_train_data
from rollout_bus.executor.cursor import CursorStore, Item
from rollout_bus.executor.engines import EngineCaller, EngineTime
from rollout_bus.executor.errors import (
    DataError,
    DeadlineExceeded,
    FilterError,
    NoServingEngine,
    Permanent,
    RewardError,
)
from rollout_bus.executor.generate import GenerateContext
from rollout_bus.executor.plugins import DataSource, FilterResult, Plugins
from rollout_bus.executor.sample import Sample
from rollout_bus.tasks.stats import wilson

log = logging.getLogger(__name__)


@dataclass
class RolloutConfig:
    max_sampling_rounds: int = 4
    reward_eps: float = 1e-6


@dataclass
class RolloutOutcome:
    train_data: TrainData | None
    """None for eval requests (metrics only)."""
    used_indices: list[int]
    """Prompt indices consumed (kept or filtered out); the rest of the reservations go back."""
    metrics: dict[str, float] = field(default_factory=dict)
    problems: list[list[int]] = field(default_factory=list)
    """Eval requests: ``[index, right answers, samples]`` per problem (``convert.is_correct``)."""
    engine_ids: list[str] = field(default_factory=list)
    """The engines that generated the samples (as the generate plug-in recorded them)."""


@dataclass
class _Group:
    item: Item
    samples: list[Sample]
    verdict: FilterResult = field(default_factory=lambda: FilterResult(True))


class RolloutRunner:
    def __init__(self, plugins: Plugins, caller: EngineCaller, cursor: CursorStore,
                 config: RolloutConfig | None = None) -> None:
        self.plugins = plugins
        self.caller = caller
        self.cursor = cursor
        self.config = config or RolloutConfig()

    async def run(self, request: RolloutRequest, *, source: DataSource, cursor_key: str,
                  timer: EngineTime) -> RolloutOutcome:
        remaining = request.remaining_s()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded(f"the deadline passed {-remaining:.1f}s before the request started")
        deadline = None if remaining is None else time.monotonic() + remaining
        self.caller.router.starved_since.pop(request.policy, None)
        ctx = GenerateContext(request=request, sampling_params=request.sampling.to_sglang(),
                              tokenizer=self.plugins.tokenizer, caller=self.caller, timer=timer, deadline=deadline)
        try:
            async with asyncio.timeout(remaining):
                if request.eval:
                    return await self._eval(ctx, source)
                return await self._train(ctx, source, cursor_key)
        except TimeoutError:
            starved_since = self.caller.router.starved_since.get(request.policy)
            if starved_since is not None:
                raise NoServingEngine(f"no engine served policy {request.policy!r} within the deadline (waited "
                                      f"{time.monotonic() - starved_since:.1f}s of {remaining:.1f}s)") from None
            raise DeadlineExceeded(f"the request's deadline passed after {remaining:.1f}s") from None

    # --- train ------------------------------------------------------------------------------
    async def _train(self, ctx: GenerateContext, source: DataSource, cursor_key: str) -> RolloutOutcome:
        request = ctx.request
        kept: list[_Group] = []
        used: list[int] = []
        reasons: Counter[str] = Counter()
        drawn = rounds = 0
        for round_ in range(self.config.max_sampling_rounds):
            need = request.n_groups - len(kept)
            n_draw = max(need, request.over_sample_groups or 0)
            items = await asyncio.to_thread(self.cursor.reserve, cursor_key, source, request.request_id,
                                            round_, n_draw, request.returned)
            if not items:
                raise DataError(f"data source {source.name!r} has no more prompts")
            groups = self._groups(items, request)
            drawn += len(groups)
            rounds += 1
            async with aclosing(self._completed(ctx, groups)) as finished:
                async for group in finished:
                    used.append(int(group.item["index"]))
                    if group.verdict.keep:
                        kept.append(group)
                        if len(kept) == request.n_groups:
                            break
                    else:
                        reasons[group.verdict.reason or "rejected"] += 1
            if len(kept) == request.n_groups:
                break
        if not kept:
            raise FilterError(f"the dynamic filter dropped all {drawn} groups drawn in {rounds} round(s): "
                              f"{dict(reasons)}")
        kept.sort(key=lambda g: int(g.item["index"]))
        samples = split_turns([s for g in kept for s in g.samples])
        metrics = sample_metrics(samples)
        metrics.update(groups_drawn=float(drawn), groups_kept=float(len(kept)), sampling_rounds=float(rounds))
        if self.plugins.filter is not None:  # only a filter leaves groups out
            metrics["groups_filtered"] = float(sum(reasons.values()))
        metadata = {
            "policy": request.policy, "request_id": request.request_id, "rollout_id": request.rollout_id,
            "n_groups": len(kept), "n_groups_requested": request.n_groups,
            "n_samples_per_group": request.n_samples_per_group, "data_source": source.name,
            "prompt_indices": [int(g.item["index"]) for g in kept],
            "consumed_indices": sorted(used), "filtered": dict(reasons),
            "labels": [g.item.get("label") for g in kept], "metrics": metrics,
            "engine_ids": engines_of(samples),
        }
        sessions = session_records(samples)
        if sessions:
            metadata["sessions"] = sessions
        data = to_train_data(samples, rollout_id=request.rollout_id, std_normalise=request.std_normalise,
                             eps=self.config.reward_eps, metadata=metadata)
        return RolloutOutcome(data, used, metrics)

    # --- eval -------------------------------------------------------------------------------
    async def _eval(self, ctx: GenerateContext, source: DataSource) -> RolloutOutcome:
        items = await asyncio.to_thread(self.cursor.draw_fresh, source, ctx.request.n_groups)
        groups = self._groups(items, ctx.request)
        async with aclosing(self._completed(ctx, groups, apply_filter=False)) as finished:
            done = [g async for g in finished]
        done.sort(key=lambda g: int(g.item["index"]))
        samples = [s for g in done for s in g.samples]
        metrics = sample_metrics(samples)
        problems = [[int(g.item["index"]), sum(is_correct(s) for s in g.samples), len(g.samples)] for g in done]
        metrics.update(wilson(sum(p[1] for p in problems), len(samples)).to_dict("accuracy"))
        solved = pass_at_n([g.samples for g in done])
        metrics.update(wilson(round(solved * len(done)), len(done)).to_dict("pass_at_n"))
        return RolloutOutcome(None, [], metrics, problems, engines_of(samples))

    # --- groups -----------------------------------------------------------------------------
    async def _completed(self, ctx: GenerateContext, groups: Sequence[_Group], *,
                         apply_filter: bool = True) -> AsyncGenerator[_Group, None]:
        """Yield groups as they finish (generated, scored, judged); cancel the rest when the caller stops."""
        tasks = [asyncio.create_task(self._run_group(ctx, g, apply_filter)) for g in groups]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_group(self, ctx: GenerateContext, group: _Group, apply_filter: bool) -> _Group:
        generate = self.plugins.generate
        try:
            async with asyncio.TaskGroup() as tg:
                made = [tg.create_task(generate(ctx, s)) for s in group.samples]
        except BaseExceptionGroup as group_error:  # one sample failed: raise its error, not the group
            raise first_error(group_error) from None
        group.samples = [t.result() for t in made]
        await self._score(group.samples)
        if apply_filter:
            group.verdict = self._judge(group.samples)
        return group

    def _groups(self, items: list[Item], request: RolloutRequest) -> list[_Group]:
        """A group per item; ``DataError`` naming every malformed item."""
        groups: list[_Group] = []
        errors: list[DataError] = []
        for item in items:
            try:
                groups.append(self._group(item, request))
            except DataError as exc:
                errors.append(exc)
        if errors:
            known = [i for e in errors for i in (e.indices or ())]
            indices = tuple(known) if all(e.indices for e in errors) else None
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise DataError(f"{errors[0]}{more}", indices)
        return groups

    def _group(self, item: Any, request: RolloutRequest) -> _Group:
        if not isinstance(item, dict) or not isinstance(item.get("index"), int):
            raise DataError(f"malformed prompt data: an item must be a map with an integer 'index', got "
                            f"{str(item)[:200]}")
        index = item["index"]
        prompt = item.get("prompt", "")
        ids = item.get("prompt_ids")
        if ids is None:
            if not isinstance(prompt, str) or not prompt:
                raise DataError(f"malformed prompt data: item {index} has neither prompt_ids nor a prompt text",
                                (index,))
            try:
                ids = list(self.plugins.tokenizer.encode(prompt))
            except Exception as exc:
                raise DataError(f"malformed prompt data: item {index}: cannot tokenize {prompt!r}: {exc}",
                                (index,)) from None
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise DataError(f"malformed prompt data: item {index}: prompt_ids must be a non-empty list of "
                            f"token ids, got {str(ids)[:200]}", (index,))
        n = request.n_samples_per_group
        samples = [Sample(group_index=index, index=index * n + j, prompt=str(prompt), prompt_ids=list(ids),
                          label=item.get("label"), metadata=dict(item.get("metadata") or {}))
                   for j in range(n)]
        return _Group(item, samples)

    async def _score(self, samples: list[Sample]) -> None:
        reward = self.plugins.reward
        path = self.plugins.config.reward_path
        try:
            if self.plugins.config.group_reward:
                values = reward(samples)
                if inspect.isawaitable(values):
                    values = await values
                values = list(values)
            else:
                values = []
                for s in samples:
                    value = reward(s)
                    values.append(await value if inspect.isawaitable(value) else value)
        except (asyncio.CancelledError, Permanent):
            raise
        except Exception as exc:
            raise RewardError(f"reward function {path!r} raised {type(exc).__name__}: {exc}") from exc
        if len(values) != len(samples):
            raise RewardError(f"reward function {path!r} returned {len(values)} rewards for {len(samples)} samples")
        for s, value in zip(samples, values, strict=True):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise RewardError(f"reward function {path!r} returned {value!r}; rewards must be finite numbers")
            s.reward = float(value)

    def _judge(self, samples: list[Sample]) -> FilterResult:
        check = self.plugins.filter
        if check is None:
            return FilterResult(True)
        try:
            verdict = check(samples)
        except Exception as exc:
            raise FilterError(f"filter {self.plugins.config.filter_path!r} raised {type(exc).__name__}: "
                              f"{exc}") from exc
        if isinstance(verdict, bool):
            return FilterResult(verdict, "" if verdict else "rejected by filter")
        if isinstance(verdict, FilterResult):
            return verdict
        raise FilterError(f"filter {self.plugins.config.filter_path!r} returned {verdict!r}; "
                          "return a bool or a FilterResult")


SESSION_FIELDS = ("session_id", "session_status", "turn", "turns", "tool_calls", "generation_s", "environment_s",
                  "engine_switches", "attempt", "engine_calls", "engine_tokens", "digest")


def session_records(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """Per sample made by an agent episode: its session and what happened in it (the batch metadata's
    ``sessions``, which ``replay verify`` checks against the sessions stream)."""
    return [{"index": s.index, **{k: s.metadata[k] for k in SESSION_FIELDS if k in s.metadata}}
            for s in samples if "session_id" in s.metadata]


def engines_of(samples: Sequence[Sample]) -> list[str]:
    """The engine ids the samples were generated on (``sample.metadata["engines"]``), sorted, each once."""
    return sorted({str(e) for s in samples for e in s.metadata.get("engines") or () if isinstance(e, str)})


def first_error(group_error: BaseExceptionGroup[Any]) -> BaseException:
    """The error to report for a group of them: a permanent one if any, else the first."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for inner in e.exceptions:
                walk(inner)
        else:
            leaves.append(e)

    walk(group_error)
    return next((e for e in leaves if isinstance(e, Permanent)), leaves[0])
