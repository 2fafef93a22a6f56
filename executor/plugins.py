"""Plug-ins by dotted path, as in miles: data source, generate function, reward, dynamic filter.

Paths are ``package.module.attr`` (or ``package.module:attr``). They are loaded once, when
the executor starts, so a typo fails the start with a message that says what is wrong,
instead of failing every request later.

Shapes:
- data source factory: ``factory(**options) -> DataSource`` (see ``DataSource``);
- generate: ``async generate(ctx: GenerateContext, sample: Sample) -> Sample``;
- reward: ``reward(sample) -> float`` or, with ``group_reward``, ``reward(samples) -> list[float]``;
  either may be ``async``;
- filter: ``filter(samples) -> bool | FilterResult`` (keep the group or not, with a reason);
- tokenizer: a module or object with ``encode(text) -> list[int]`` and ``decode(ids) -> str``;
  with ``tokenizer_args``, a factory called with them that returns one (e.g.
  ``rollout_bus.lm.hf_tokenizer.ChatTokenizer`` with ``{"path": model_dir}``).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rollout_bus.executor.errors import PluginError

log = logging.getLogger(__name__)


@runtime_checkable
class DataSource(Protocol):
    """Prompts in a deterministic order with a saveable position.

    Items are msgpack-able dicts with an int ``index`` (unique and stable: the prompt's
    sequence number), and ``prompt`` (text) or ``prompt_ids`` (token ids), plus optional
    ``label`` and ``metadata``. ``name`` identifies the prompt stream (it names the saved
    cursor), so it must change when options change which prompts come out.
    """

    name: str

    def get_samples(self, n: int) -> list[dict[str, Any]]: ...

    def add_samples(self, items: list[dict[str, Any]]) -> None: ...

    def save(self) -> dict[str, Any]: ...

    def load(self, state: dict[str, Any] | None) -> None: ...


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class FilterResult:
    keep: bool
    reason: str = ""


def load_object(path: str, kind: str) -> Any:
    """The object at dotted ``path``; ``PluginError`` saying what is wrong with it."""
    if not isinstance(path, str) or not path.strip():
        raise PluginError(f"{kind} path is empty: give a dotted path like 'package.module.name'")
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr or not all(p.isidentifier() for p in [*module_name.split("."), attr]):
        raise PluginError(f"{kind} path {path!r} is not a dotted path like 'package.module.name'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise PluginError(f"{kind} {path!r}: cannot import module {module_name!r} ({exc})") from None
    except Exception as exc:
        raise PluginError(f"{kind} {path!r}: importing module {module_name!r} raised "
                          f"{type(exc).__name__}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=3)
        hint = f"; did you mean {', '.join(repr(f'{module_name}.{c}') for c in close)}?" if close else ""
        raise PluginError(f"{kind} {path!r}: module {module_name!r} has no attribute {attr!r}{hint}") from None


def load_callable(path: str, kind: str, *, is_async: bool | None = None) -> Callable[..., Any]:
    obj = load_object(path, kind)
    if not callable(obj):
        raise PluginError(f"{kind} {path!r} is a {type(obj).__name__}, not a function or class")
    if is_async is True and not inspect.iscoroutinefunction(obj):
        raise PluginError(f"{kind} {path!r} must be an async function (async def)")
    return obj  # type: ignore[no-any-return]


def load_tokenizer(path: str, args: dict[str, Any] | None = None) -> Tokenizer:
    obj = load_object(path, "tokenizer")
    if args:
        if not callable(obj):
            raise PluginError(f"tokenizer {path!r} is a {type(obj).__name__}; with tokenizer args it must be "
                              "a class or function that builds the tokenizer")
        try:
            obj = obj(**args)
        except Exception as exc:
            raise PluginError(f"tokenizer {path!r} rejected options {args}: {type(exc).__name__}: {exc}") from None
    for method in ("encode", "decode"):
        if not callable(getattr(obj, method, None)):
            raise PluginError(f"tokenizer {path!r} has no {method}() function")
    return obj  # type: ignore[no-any-return]


@dataclass
class PluginConfig:
    """Dotted paths of the plug-ins and the options handed to them."""

    data_source_path: str = "rollout_bus.tasks.arithmetic.ArithmeticSource"
    data_source_args: dict[str, Any] = field(default_factory=dict)
    generate_path: str = "rollout_bus.executor.generate.single_turn"
    reward_path: str = "rollout_bus.tasks.arithmetic.exact_match"
    group_reward: bool = False
    filter_path: str | None = None
    tokenizer_path: str = "rollout_bus.lm.tokenizer"
    tokenizer_args: dict[str, Any] = field(default_factory=dict)


class Plugins:
    """The loaded plug-ins of one executor; data sources are built once per option set."""

    def __init__(self, config: PluginConfig) -> None:
        self.config = config
        self.data_source_factory = load_callable(config.data_source_path, "data source")
        self.generate = load_callable(config.generate_path, "generate function", is_async=True)
        self.reward = load_callable(config.reward_path, "reward function")
        self.filter = load_callable(config.filter_path, "dynamic sampling filter") if config.filter_path else None
        self.tokenizer = load_tokenizer(config.tokenizer_path, config.tokenizer_args)
        self._sources: dict[tuple[tuple[str, Any], ...], DataSource] = {}
        self.data_source({})  # build the default one now: bad options fail the start, not a request

    def data_source(self, options: dict[str, Any]) -> DataSource:
        """The data source for the configured args overlaid with ``options`` (cached)."""
        merged = {**self.config.data_source_args, **options}
        key = tuple(sorted((k, _freeze(v)) for k, v in merged.items()))
        source = self._sources.get(key)
        if source is None:
            try:
                source = self.data_source_factory(**merged)
            except Exception as exc:
                raise PluginError(f"data source {self.config.data_source_path!r} rejected options {merged}: "
                                  f"{type(exc).__name__}: {exc}") from None
            missing = [m for m in ("get_samples", "add_samples", "save", "load")
                       if not callable(getattr(source, m, None))]
            if missing or not isinstance(getattr(source, "name", None), str):
                raise PluginError(f"data source {self.config.data_source_path!r} built a "
                                  f"{type(source).__name__} without {missing or ['name']}")
            self._sources[key] = source
        return source


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value
