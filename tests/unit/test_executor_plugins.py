"""Loading plug-ins by dotted path: clear messages for every way a path can be wrong."""

from __future__ import annotations

import pytest

from rollout_bus.executor.errors import PluginError
from rollout_bus.executor.filters import no_aborted, nonzero_reward_std
from rollout_bus.executor.plugins import FilterResult, PluginConfig, Plugins, load_callable, load_object
from rollout_bus.executor.sample import Sample, Status


def test_a_good_path_loads_with_either_separator() -> None:
    assert load_object("rollout_bus.executor.filters.no_aborted", "filter") is no_aborted
    assert load_object("rollout_bus.executor.filters:no_aborted", "filter") is no_aborted


@pytest.mark.parametrize(("path", "message"), [
    ("", "path is empty"),
    ("nodots", "is not a dotted path"),
    ("executor..filters.x", "is not a dotted path"),
    ("rollout_bus.executor.no_such_module.f", "cannot import module 'rollout_bus.executor.no_such_module'"),
    ("rollout_bus.executor.filters.nonzero_reward_sdt", "has no attribute 'nonzero_reward_sdt'; did you mean "
                                             "'rollout_bus.executor.filters.nonzero_reward_std'"),
])
def test_a_bad_path_says_what_is_wrong(path: str, message: str) -> None:
    with pytest.raises(PluginError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_object(path, "reward function")


def test_kinds_are_checked() -> None:
    with pytest.raises(PluginError, match="is a str, not a function"):
        load_callable("events.submit.JOB_FUNC", "reward function")
    with pytest.raises(PluginError, match="must be an async function"):
        load_callable("rollout_bus.executor.filters.no_aborted", "generate function", is_async=True)


def test_plugins_fail_at_load_time_not_per_request() -> None:
    with pytest.raises(PluginError, match="generate function 'rollout_bus.tasks.arithmetic.exact_match' must be an async"):
        Plugins(PluginConfig(generate_path="rollout_bus.tasks.arithmetic.exact_match"))
    with pytest.raises(PluginError, match="rejected options .*digits must be an integer"):
        Plugins(PluginConfig(data_source_args={"digits": 0}))
    with pytest.raises(PluginError, match="tokenizer 'rollout_bus.executor.filters' has no encode"):
        Plugins(PluginConfig(tokenizer_path="rollout_bus.executor.filters"))


def test_data_sources_are_built_once_per_option_set() -> None:
    plugins = Plugins(PluginConfig())
    assert plugins.data_source({}) is plugins.data_source({})
    assert plugins.data_source({"digits": 3}).name == "arith-+-d3-s0"
    assert plugins.data_source({"digits": 3}) is not plugins.data_source({})


def group(rewards: list[float], statuses: list[Status] | None = None) -> list[Sample]:
    out = [Sample(group_index=0, index=i, prompt="1+1=", prompt_ids=[3], reward=r) for i, r in enumerate(rewards)]
    for s, status in zip(out, statuses or [Status.COMPLETED] * len(out), strict=True):
        s.status = status
    return out


def test_builtin_filters() -> None:
    assert nonzero_reward_std(group([1.0, 0.0])) == FilterResult(True)
    dropped = nonzero_reward_std(group([1.0, 1.0]))
    assert not dropped.keep and "zero reward spread" in dropped.reason
    assert no_aborted(group([1.0, 0.0])).keep
    assert not no_aborted(group([1.0, 0.0], [Status.COMPLETED, Status.ABORTED])).keep
