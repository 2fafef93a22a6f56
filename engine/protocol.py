"""Parsing and validation of request bodies, following SGLang's native API (see engine/README.md).

Every problem raises ``BadRequest`` with a message that names the field and says what to send. As in
SGLang's HTTP layer, unknown top-level keys are ignored, while unknown ``sampling_params`` keys and
wrong types are 400s. Parameters SGLang has but this engine does not implement are accepted only at
their neutral value.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

from rollout_bus.engine.errors import BadRequest
from rollout_bus.events.rollouts import MIN_TEMPERATURE

DEFAULT_MAX_NEW_TOKENS = 128
FIT = -1  # max_new_tokens not given: as many as fit in max_seq_len, at most DEFAULT_MAX_NEW_TOKENS
MAX_N = 64
DEFAULT_MAX_SEQS = 4096
"""Most sequences one /generate request may ask for (prompts times ``n``): ``--max-seqs-per-request``."""
MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays and objects a request body may have (SGLang's shapes need 3)."""
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "retract", "in_place")

_SAMPLING_NEUTRAL: dict[str, Any] = {
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop_regex": None,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
    "logit_bias": None,
    "beam_width": None,
    "watermark": None,
    "choice": None,
}
_SAMPLING_ACCEPTED = {"spaces_between_special_tokens", "stream_interval"}  # no effect here
_GENERATE_NEUTRAL: dict[str, Any] = {
    "logprob_start_len": -1,
    "top_logprobs_num": 0,
    "token_ids_logprob": None,
    "return_hidden_states": False,
    "custom_logit_processor": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "input_embeds": None,
    "session_params": None,
}


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = FIT
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence to generate: a prompt, or one of the ``n`` samples of a prompt."""

    rid: str
    input_ids: tuple[int, ...]
    params: SamplingParams
    lora: str | None  # the adapter serving this sequence; None: the base weights
    seed: int | None
    return_logprob: bool
    return_text_in_logprobs: bool


@dataclass(frozen=True)
class GenerateInput:
    sequences: list[SequenceSpec]
    batched: bool
    stream: bool


@dataclass(frozen=True)
class Limits:
    """What a /generate request is checked against: the served model and its loaded adapters."""

    vocab_size: int
    max_seq_len: int
    encode: Callable[[str], list[int]]
    adapters: frozenset[str]
    lora_enabled: bool
    has_tokenizer: bool = True
    max_seqs: int = DEFAULT_MAX_SEQS


def parse_json(raw: bytes) -> dict[str, Any]:
    """The JSON object in ``raw``; an empty body is ``{}``. Nesting deeper than ``MAX_JSON_DEPTH``, and
    what Python's parser refuses on its own (an integer past its digit limit, nesting past the recursion
    limit) are ``BadRequest`` too."""
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest(f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {str(exc)[:200]}") from None
    except ValueError as exc:  # an integer past Python's digit limit for int-string conversion
        raise BadRequest(f"request body has a number too long to parse: {str(exc)[:120]}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    _check_depth(body)
    return body


def _check_depth(body: dict[str, Any]) -> None:
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
        for child in value.values() if isinstance(value, dict) else value:
            if isinstance(child, list | dict):
                stack.append((child, depth + 1))


def reject_unknown(body: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown} in {where}; known fields are {sorted(allowed)}")


def get_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {value!r}")
    return value


def get_optional_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise BadRequest(f"{name} must be an integer, got {value!r}")
    return value


def get_int(body: dict[str, Any], name: str, default: int) -> int:
    value = get_optional_int(body, name)
    return default if value is None else value


def get_float(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    try:
        number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer too large for a float
        number = math.nan
    if not math.isfinite(number):
        raise BadRequest(f"{name} must be a finite number, got {value!r}"[:300])
    return number


def get_str(body: dict[str, Any], name: str, default: str | None) -> str | None:
    value = body.get(name, default)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"{name} must be a string, got {value!r}")
    return value


def get_version(body: dict[str, Any], name: str) -> str | None:
    """A weight version: a string, as SGLang requires (an integer is a 400 there too)."""
    value = body.get(name)
    if value is None or isinstance(value, str):
        return value
    raise BadRequest(f"{name} must be a string, got {value!r}")


def parse_sampling_params(raw: Any, vocab_size: int) -> SamplingParams:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"sampling_params must be a JSON object, got {raw!r}")
    allowed = {f for f in SamplingParams.__dataclass_fields__} | set(_SAMPLING_NEUTRAL) | _SAMPLING_ACCEPTED
    reject_unknown(raw, allowed, "sampling_params")
    _check_neutral(raw, _SAMPLING_NEUTRAL, "sampling_params")
    get_bool(raw, "spaces_between_special_tokens", True)
    get_optional_int(raw, "stream_interval")
    temperature = get_float(raw, "temperature", 1.0)
    top_p = get_float(raw, "top_p", 1.0)
    top_k = get_int(raw, "top_k", -1)
    min_p = get_float(raw, "min_p", 0.0)
    max_new_tokens = get_optional_int(raw, "max_new_tokens")
    n = get_int(raw, "n", 1)
    if temperature != 0.0 and not temperature >= MIN_TEMPERATURE:
        raise BadRequest(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE} (smaller ones are 0 in "
                         f"float32 and cannot be sampled), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}")
    if top_k == 0 or top_k < -1:
        raise BadRequest(f"top_k must be -1 (off) or >= 1, got {top_k}")
    if not 0.0 <= min_p <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {min_p}")
    if max_new_tokens is not None and max_new_tokens < 0:
        raise BadRequest(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be between 1 and {MAX_N}, got {n}")
    seed = get_optional_int(raw, "sampling_seed")
    if seed is not None and not 0 <= seed < 2**63 - MAX_N:
        raise BadRequest(f"sampling_seed must be in [0, 2**63 - {MAX_N}), got {seed}")
    stop = raw.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"stop must be a non-empty string or a list of them, got {raw.get('stop')!r}")
    stop_ids = raw.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else stop_ids
    if not isinstance(stop_ids, list):
        raise BadRequest(f"stop_token_ids must be a list of token ids, got {stop_ids!r}")
    _check_ids(stop_ids, vocab_size, "stop_token_ids")
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        max_new_tokens=FIT if max_new_tokens is None else max_new_tokens,
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=get_bool(raw, "ignore_eos", False),
        skip_special_tokens=get_bool(raw, "skip_special_tokens", True),
        no_stop_trim=get_bool(raw, "no_stop_trim", False),
        n=n,
        sampling_seed=seed,
    )


def parse_generate(body: dict[str, Any], limits: Limits) -> GenerateInput:
    """Expand a /generate body into one spec per sequence (prompt-major: prompt 0's n samples first,
    the order of SGLang's replies). Unknown top-level keys are ignored, as SGLang does."""
    _check_neutral(body, _GENERATE_NEUTRAL, "the /generate request")
    _check_extras(body)
    prompts, batched = _prompts(body, limits)
    count = len(prompts)
    groups = _request_ids(body.get("rid"), count)
    adapters = _adapters(body.get("lora_path"), count, limits)
    raw_params = body.get("sampling_params")
    if isinstance(raw_params, list):
        if not batched:
            raise BadRequest("sampling_params is a list, but there is one prompt: send one JSON object")
        param_list = raw_params
    else:
        param_list = [raw_params] * count
    if len(param_list) != count:
        raise BadRequest(f"sampling_params is a list of {len(param_list)}, but there are {count} prompts")
    return_logprob = get_bool(body, "return_logprob", False)
    text_in_logprobs = get_bool(body, "return_text_in_logprobs", False)
    stream = get_bool(body, "stream", False)
    per_prompt: list[SamplingParams] = []
    for index, prompt in enumerate(prompts):
        where = f"input_ids[{index}]" if batched else "input_ids"
        params = _fit(parse_sampling_params(param_list[index], limits.vocab_size), len(prompt), limits.max_seq_len, where)
        if params.stop and not limits.has_tokenizer:
            raise BadRequest("stop strings need a tokenizer, and the engine runs with --skip-tokenizer-init: "
                             "use stop_token_ids")
        per_prompt.append(params)
    total = sum(p.n for p in per_prompt)
    if total > limits.max_seqs:
        raise BadRequest(f"this request asks for {total} sequences ({count} prompt(s) times n), over the engine's "
                         f"--max-seqs-per-request {limits.max_seqs}: split it into smaller requests")
    sequences: list[SequenceSpec] = []
    for index, (prompt, params) in enumerate(zip(prompts, per_prompt, strict=True)):
        group = groups[index]
        for sample in range(params.n):
            seed = None if params.sampling_seed is None else params.sampling_seed + sample
            rid = group if params.n == 1 else f"{group}_{sample}"
            sequences.append(
                SequenceSpec(
                    rid=rid,
                    input_ids=tuple(prompt),
                    params=params,
                    lora=adapters[index],
                    seed=seed,
                    return_logprob=return_logprob,
                    return_text_in_logprobs=text_in_logprobs,
                )
            )
    return GenerateInput(sequences=sequences, batched=batched or len(sequences) > 1, stream=stream)


def _prompts(body: dict[str, Any], limits: Limits) -> tuple[list[list[int]], bool]:
    """The prompts as token ids (``text`` is tokenized) and whether the request is a batch."""
    text, raw_ids = body.get("text"), body.get("input_ids")
    if text is not None and raw_ids is not None:
        raise BadRequest("send either text or input_ids, not both")
    if text is not None:
        if isinstance(text, str):
            texts, batched = [text], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            texts, batched = text, True
        else:
            raise BadRequest(f"text must be a string or a non-empty list of strings, got {text!r}"[:300])
        _check_count(len(texts), limits)
        try:
            prompts = [limits.encode(t) for t in texts]
        except ValueError as exc:
            raise BadRequest(f"cannot tokenize text: {exc}") from None
        for index, prompt in enumerate(prompts):
            if not prompt:
                raise BadRequest(f"text{f'[{index}]' if batched else ''} encodes to no tokens")
        return prompts, batched
    if raw_ids is None or (isinstance(raw_ids, list) and not raw_ids):
        raise BadRequest("input_ids is required: a non-empty list of token ids, or a list of such lists (or send text)")
    if not isinstance(raw_ids, list):
        raise BadRequest(f"input_ids must be a list of token ids or a list of such lists, got {raw_ids!r}"[:300])
    batched = all(isinstance(x, list) for x in raw_ids)
    id_lists: list[Any] = raw_ids if batched else [raw_ids]
    _check_count(len(id_lists), limits)
    for index, prompt in enumerate(id_lists):
        where = f"input_ids[{index}]" if batched else "input_ids"
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest(f"{where} must be a non-empty list of token ids")
        _check_ids(prompt, limits.vocab_size, where)
    return id_lists, batched


def _check_count(prompts: int, limits: Limits) -> None:
    if prompts > limits.max_seqs:
        raise BadRequest(f"this request has {prompts} prompts, over the engine's --max-seqs-per-request "
                         f"{limits.max_seqs}: split it into smaller requests")


def _check_extras(body: dict[str, Any]) -> None:
    """Fields SGLang accepts that change nothing here, type-checked as SGLang does."""
    priority = body.get("priority")
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
        raise BadRequest(f"priority must be an integer, got {priority!r}")
    labels = body.get("custom_labels")
    if labels is not None and (not isinstance(labels, dict)
                               or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())):
        raise BadRequest(f"custom_labels must be an object of strings, got {labels!r}"[:300])


def _adapters(value: Any, count: int, limits: Limits) -> list[str | None]:
    names = _per_prompt(value, count, "lora_path")
    for name in names:
        if name is None:
            continue
        if not limits.lora_enabled:
            raise BadRequest(f"LoRA adapter {name!r} was requested, but LoRA is not enabled. "
                             "Please launch the server with --enable-lora.")
        if name not in limits.adapters:
            raise BadRequest(f"Got LoRA adapter that has never been loaded: {name}\n"
                             f"All loaded adapters: {sorted(limits.adapters)}.")
    return names


def parse_pause_mode(body: dict[str, Any]) -> PauseMode:
    mode = get_str(body, "mode", "abort") or "abort"
    if mode not in PAUSE_MODES:
        raise BadRequest(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
    return cast(PauseMode, mode)


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def parse_memory_tags(body: dict[str, Any], where: str) -> tuple[str, ...]:
    """The tags of a release or resume; null or [] means all of them (as in SGLang)."""
    tags = body.get("tags")
    if tags is None or tags == []:
        return MEMORY_TAGS
    if not isinstance(tags, list) or any(t not in MEMORY_TAGS for t in tags):
        raise BadRequest(f"tags must be null or a list drawn from {list(MEMORY_TAGS)}, got {tags!r}")
    return tuple(dict.fromkeys(tags))


def _fit(params: SamplingParams, prompt_len: int, max_seq_len: int, where: str) -> SamplingParams:
    room = max_seq_len - prompt_len
    if params.max_new_tokens == FIT:
        if room <= 0:
            raise BadRequest(
                f"{where} has {prompt_len} tokens, leaving no room to generate within max_seq_len "
                f"{max_seq_len}; shorten the prompt"
            )
        return replace(params, max_new_tokens=min(room, DEFAULT_MAX_NEW_TOKENS))
    if params.max_new_tokens > room:
        raise BadRequest(
            f"{where} has {prompt_len} tokens; with max_new_tokens {params.max_new_tokens} that exceeds "
            f"max_seq_len {max_seq_len}: shorten the prompt or set max_new_tokens <= {max(room, 0)}"
        )
    return params


def _per_prompt(value: Any, count: int, name: str) -> list[str | None]:
    """A per-prompt list from one string (shared by every prompt) or a list of ``count`` strings."""
    if value is None or isinstance(value, str):
        return [value] * count
    if isinstance(value, list) and len(value) == count and all(v is None or isinstance(v, str) for v in value):
        return value
    raise BadRequest(f"{name} must be a string or a list of {count} strings, got {value!r}")


def _request_ids(value: Any, count: int) -> list[str]:
    """One id per prompt: the given ones, ``{rid}_{i}`` for a batch under one rid, or random ones."""
    if isinstance(value, str) and value:
        return [value] if count == 1 else [f"{value}_{i}" for i in range(count)]
    rids = [r or uuid.uuid4().hex for r in _per_prompt(value, count, "rid")]
    if len(set(rids)) != count:
        raise BadRequest(f"rid values must be unique within a request, got {value!r}")
    return rids


def _check_ids(ids: list[Any], vocab_size: int, where: str) -> None:
    for position, token in enumerate(ids):
        if not isinstance(token, int) or isinstance(token, bool):
            raise BadRequest(f"{where}[{position}] must be an integer token id, got {token!r}")
        if not 0 <= token < vocab_size:
            raise BadRequest(f"{where}[{position}] = {token} is outside the vocabulary [0, {vocab_size})")


def _check_neutral(body: dict[str, Any], neutral: dict[str, Any], where: str) -> None:
    for name, value in neutral.items():
        if name in body and body[name] != value:
            raise BadRequest(
                f"{name} = {body[name]!r} in {where} is not supported by this engine; "
                f"leave it out or send {json.dumps(value)}"
            )
