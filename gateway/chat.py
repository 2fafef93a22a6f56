"""Chat messages in, tokens out: validation, the model's chat template, and incremental rendering.

The gateway never tokenizes the model's own output again (token-in, token-out). On each call it renders
only the messages the client added since the last turn: ``ChatFormat.suffix`` renders the recorded
history with and without the new messages, checks that the template wrote the history the same way both
times (a template that re-renders earlier turns, as one that drops old "thinking" blocks, is reported
with the first differing character, never hidden), and tokenizes only the difference, after the text the
template writes behind an assistant message that the model did not write itself (``"\\n"`` after
``<|im_end|>``, or the whole end-of-turn when the reply was cut at its length limit).

Two formats: ``HFChat`` (a model directory's tokenizer and its Jinja chat template, through
``transformers``) and ``CharChat`` (the project's tiny character-level LM, whose vocabulary has no room for
a Jinja template's markup: ``role:content|`` per message, the assistant's ended by ``<eos>``).
"""

from __future__ import annotations

import json
import re
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rollout_bus.events.errors import Failure

ROLES = ("system", "user", "assistant", "tool", "developer")
Message = dict[str, Any]


class ChatError(Failure):
    """A request the gateway cannot serve as sent; ``param`` names the field, ``code`` is OpenAI-style."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_request",
                 status: int = 400, position: int | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status
        self.position = position


# --- messages ------------------------------------------------------------------------------------

def canonical(message: Any, where: str) -> Message:
    """One message in the one form the gateway compares and renders: role, content (text), and, where
    present, name, tool_calls (id, type, function name and arguments as a string) and tool_call_id.
    Fields an OpenAI client echoes back with no meaning here (``refusal``, ``annotations``, None values)
    are dropped; anything malformed is a ``ChatError`` naming the field."""
    if not isinstance(message, Mapping):
        raise ChatError(f"{where} must be an object with 'role' and 'content', got {type(message).__name__}",
                        param=where)
    role = message.get("role")
    if role not in ROLES:
        raise ChatError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
    out: Message = {"role": "system" if role == "developer" else role, "content": _content(message, where)}
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise ChatError(f"{where}.name must be a string", param=f"{where}.name")
        out["name"] = name
    calls = message.get("tool_calls")
    if calls:
        if role != "assistant":
            raise ChatError(f"{where}.tool_calls is only allowed on assistant messages", param=f"{where}.tool_calls")
        if not isinstance(calls, list):
            raise ChatError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise ChatError(f"{where}.tool_call_id must be a string", param=f"{where}.tool_call_id")
        if call_id:
            out["tool_call_id"] = call_id
    return out


def _content(message: Mapping[str, Any], where: str) -> str:
    content = message.get("content")
    if content is None:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            return ""
        raise ChatError(f"{where}.content is missing", param=f"{where}.content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatError(f"{where}.content[{i}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                                "supported", param=f"{where}.content[{i}]")
            texts.append(part["text"])
        return "".join(texts)
    raise ChatError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}",
                    param=f"{where}.content")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise ChatError(f"{where} must be an object with a 'function'", param=where)
    fn = call["function"]
    name, arguments = fn.get("name"), fn.get("arguments", "{}")
    if not isinstance(name, str) or not name:
        raise ChatError(f"{where}.function.name must be a non-empty string", param=f"{where}.function.name")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {"id": str(call.get("id") or ""), "type": "function", "function": {"name": name, "arguments": arguments}}


def canonical_messages(messages: Any) -> list[Message]:
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list of messages", param="messages")
    return [canonical(m, f"messages[{i}]") for i, m in enumerate(messages)]


def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    """``tools`` as OpenAI defines them (function tools), or None."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatError("tools must be a list of function tools", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if (not isinstance(tool, Mapping) or tool.get("type") != "function"
                or not isinstance(tool.get("function"), Mapping)
                or not isinstance(tool["function"].get("name"), str)):
            raise ChatError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                            "...}}", param=f"tools[{i}]")
        out.append(json.loads(json.dumps(tool)))
    return out or None


# --- tool calls in the model's output (the Hermes / Qwen form many templates use) ------------------

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """The reply's content and its tool calls: each ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
    block becomes a call; a block that is not such JSON stays in the content, as the model wrote it."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        arguments = body.get("arguments", body.get("parameters", {}))
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": body["name"],
                                   "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
    kept.append(text[last:])
    return ("".join(kept).strip() if calls else text), calls


# --- formats ---------------------------------------------------------------------------------------

class ChatFormat(Protocol):
    name: str
    supports_tools: bool
    max_context: int
    stop_token_ids: tuple[int, ...]

    def render(self, messages: Sequence[Message], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str:
        """Every token as text, special tokens included."""
        ...

    def reply_text(self, ids: Sequence[int]) -> str:
        """A reply's text: up to its first stop token, special tokens left out."""
        ...


@dataclass
class Rendered:
    ids: list[int]
    text: str


def first_render(fmt: ChatFormat, messages: Sequence[Message], tools: list[dict[str, Any]] | None) -> Rendered:
    text = fmt.render(messages, tools=tools, add_generation_prompt=True)
    return Rendered(fmt.encode(text), text)


def suffix(fmt: ChatFormat, history: Sequence[Message], new: Sequence[Message], *, last_output: Sequence[int],
           tools: list[dict[str, Any]] | None, before: str | None = None, made: str | None = None) -> Rendered:
    """Tokens to append after the recorded session for the ``new`` messages, ready for the next reply.

    ``history`` ends with the assistant message whose tokens (``last_output``) the engine made. Raises
    ``ChatError`` (code ``template_mismatch``) when the template writes the history differently once the
    new messages follow it. ``before`` and ``made``, when known: ``fmt.render(history, tools=tools,
    add_generation_prompt=False)`` and ``fmt.decode(last_output)``, rendered and decoded earlier."""
    if before is None:
        before = fmt.render(history, tools=tools, add_generation_prompt=False)
    after = fmt.render([*history, *new], tools=tools, add_generation_prompt=True)
    if not after.startswith(before):
        at = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), min(len(before), len(after)))
        raise ChatError(
            f"the chat template renders the earlier turns differently once the new messages follow them "
            f"(first difference at character {at}: {before[at:at + 40]!r} became {after[at:at + 40]!r}); the "
            "session's tokens would no longer be what a fresh render gives, so the call is refused",
            code="template_mismatch", status=409, param="messages", position=at)
    tail = turn_tail(fmt, history[-1], tools)
    if made is None:
        made = fmt.decode(last_output)
    overlap = max((j for j in range(len(tail) + 1) if made.endswith(tail[:j])), default=0)
    text = tail[overlap:] + after[len(before):]
    return Rendered(fmt.encode(text), text)


def turn_tail(fmt: ChatFormat, assistant: Message, tools: list[dict[str, Any]] | None) -> str:
    """What the template writes after an assistant message's content (its end-of-turn and separator).

    Rendered once per format and tool list (a probe conversation, whatever ``assistant`` says), then kept."""
    tools_json = json.dumps(tools, sort_keys=True) if tools else ""
    known = _TAILS.setdefault(fmt, {})
    tail = known.get(tools_json)
    if tail is None:
        marker = "\u2063TAIL\u2063" if fmt.name != "char" else "qqzzqq"
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}]
        text = fmt.render(probe, tools=tools, add_generation_prompt=False)
        at = text.rfind(marker)
        tail = text[at + len(marker):] if at >= 0 else ""
        if len(known) < 256:
            known[tools_json] = tail
    return tail


_TAILS: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()
"""``turn_tail`` per format (while it lives) and tool list."""


class HFChat:
    """A Hugging Face model directory's tokenizer and chat template.

    Renders with the template compiled as ``transformers`` compiles it, called directly (``DirectTemplate``),
    and encodes with the Rust tokenizer directly (``direct_encoder``): the same text and ids as
    ``apply_chat_template`` and the tokenizer's ``__call__``, without their Python wrappers (copying every
    message, building a ``BatchEncoding``). Either falls back to the wrapper for a tokenizer or a message
    list it cannot vouch for."""

    name = "hf"

    def __init__(self, path: str, *, max_context: int | None = None) -> None:
        from rollout_bus.lm.hf_tokenizer import load

        self.tokenizer = load(str(path))
        self.hf = self.tokenizer.hf
        template = str(self.hf.chat_template or "")
        self.supports_tools = "tools" in template
        self.stop_token_ids = self.tokenizer.stop_token_ids
        self.max_context = int(max_context or _model_context(path) or 2048)
        self.direct = DirectTemplate.build(self.hf)
        self._encode = direct_encoder(self.hf)
        self.deterministic = "strftime_now" not in template
        """Whether the same messages always render to the same text (no date in the template), so that a render
        kept from an earlier call is the render this call would make."""

    def render(self, messages: Sequence[Message], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool) -> str:
        try:
            if self.direct is not None and plain_messages(messages) and plain_value(tools):
                return self.direct.render(messages, tools=tools or None, add_generation_prompt=add_generation_prompt)
            text = self.hf.apply_chat_template(list(messages), tools=list(tools) if tools else None,  # type: ignore[arg-type]
                                               tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # a template's own raise_exception (e.g. roles out of order)
            raise ChatError(f"the model's chat template refused the messages: {exc}", param="messages") from None
        return str(text)

    def encode(self, text: str) -> list[int]:
        if self._encode is not None:
            return self._encode(text)
        return [int(t) for t in self.hf(text, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=False))

    def reply_text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


_REASONING_KEYS = frozenset({"reasoning_content", "thinking", "reasoning"})
_SCALARS = (str, int, float, bool)
_STR_TYPE = frozenset({str})


def plain_value(value: Any) -> bool:
    """Whether ``value`` is built of exact JSON types only (dict with str keys, list, str, int, float, bool,
    None), so that ``transformers``' copy of it for the template (``_plain_template_data``) equals it."""
    kind = type(value)
    if value is None or kind in _SCALARS:
        return True
    if kind is dict:
        return all(type(k) is str and plain_value(v) for k, v in value.items())
    if kind is list:
        return all(plain_value(v) for v in value)
    return False


def plain_messages(messages: Sequence[Message]) -> bool:
    """Whether ``apply_chat_template`` would hand the template ``messages`` unchanged: each a plain dict with
    no None value (it drops those) and no reasoning field (it copies those under other names)."""
    for m in messages:
        if type(m) is not dict or not _REASONING_KEYS.isdisjoint(m):
            return False
        if not set(map(type, m.values())) <= _STR_TYPE and not all(
                v is not None and plain_value(v) for v in m.values()):
            return False
    return True


class DirectTemplate:
    """A tokenizer's chat template as ``apply_chat_template`` renders it (``transformers``' own compiled,
    sandboxed template, the tokenizer's special tokens as variables), called without the wrapper. Built
    only where the tokenizer's class renders through ``PreTrainedTokenizerBase.apply_chat_template`` and
    probe conversations render byte for byte as the wrapper renders them."""

    def __init__(self, hf: Any, compile_template: Any, plain: Any) -> None:
        self.hf = hf
        self.templates = {has_tools: compile_template(hf.get_chat_template(None, [] if has_tools else None))
                          for has_tools in (False, True)}
        self.variables = plain(dict(hf.special_tokens_map))

    @classmethod
    def build(cls, hf: Any) -> DirectTemplate | None:
        try:
            from transformers.tokenization_utils_base import PreTrainedTokenizerBase
            from transformers.utils.chat_template_utils import _compile_jinja_template, _plain_template_data

            if type(hf).apply_chat_template is not PreTrainedTokenizerBase.apply_chat_template:
                return None
            direct = cls(hf, _compile_jinja_template, _plain_template_data)
        except Exception:  # another transformers, or a tokenizer without one default template: the wrapper
            return None
        return direct if all(direct.agrees(messages, tools) for messages, tools in _PROBES) else None

    def render(self, messages: Sequence[Message], *, tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool) -> str:
        return str(self.templates[tools is not None].render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
            **self.variables))

    def agrees(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> bool:
        for generation in (False, True):
            try:
                want: str | None = str(self.hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                                                   add_generation_prompt=generation))
            except Exception:
                want = None
            try:
                got: str | None = self.render(messages, tools=tools, add_generation_prompt=generation)
            except Exception:
                got = None
            if got != want:
                return False
        return True


_PROBE_TOOLS = [{"type": "function", "function": {"name": "calc", "description": "arithmetic",
                                                  "parameters": {"type": "object",
                                                                 "properties": {"e": {"type": "string"}}}}}]
_PROBES: list[tuple[list[Message], list[dict[str, Any]] | None]] = [
    ([{"role": "user", "content": "hi <b>&amp;</b> \u00e9\n"}], None),
    ([{"role": "system", "content": "be terse"}, {"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}], None),
    ([{"role": "user", "content": "12*7?"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{\"e\": \"12*7\"}"}}]},
      {"role": "tool", "content": "84", "tool_call_id": "c1"}], _PROBE_TOOLS),
]
"""Conversations a template must render as the wrapper does before ``DirectTemplate`` replaces it."""


def direct_encoder(hf: Any) -> Any:
    """``text -> ids`` through the Rust tokenizer itself, as ``hf(text, add_special_tokens=False)`` encodes
    (no padding, no truncation, the tokenizer's ``split_special_tokens``); None where the tokenizer's class
    encodes in Python of its own, or where probe texts come out otherwise."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    kind = type(hf)
    if (not isinstance(hf, TokenizersBackend) or kind._encode_plus is not TokenizersBackend._encode_plus
            or kind.__call__ is not PreTrainedTokenizerBase.__call__ or hasattr(hf, "_switch_to_input_mode")):
        return None
    backend = hf.backend_tokenizer

    def encode(text: str) -> list[int]:
        if (backend.truncation is not None or backend.padding is not None
                or backend.encode_special_tokens != bool(hf.split_special_tokens)):
            return [int(t) for t in hf(text, add_special_tokens=False)["input_ids"]]
        return list(backend.encode(text, add_special_tokens=False).ids)

    specials = "".join(str(t) for t in hf.all_special_tokens)
    probes = ["", "hello world", " leading space\n\ttabs", "\u00e9\u4e2d\U0001f600", specials, f"a{specials}b c"]
    try:
        if all(encode(t) == [int(i) for i in hf(t, add_special_tokens=False)["input_ids"]] for t in probes):
            return encode
    except Exception:
        return None
    return None


def _model_context(path: str) -> int | None:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings") or config.get("n_positions") or config.get("max_seq_len")
    return int(value) if isinstance(value, int) and value > 0 else None


class CharChat:
    """The tiny character-level LM's chat form: ``role:content|`` per message, ``assistant:`` to reply, the
    reply ended by ``<eos>``. Only the LM's characters can be written (lowercase letters, digits, a few
    symbols); anything else is a ``ChatError`` naming the character."""

    name = "char"
    supports_tools = False
    deterministic = True

    def __init__(self, *, max_context: int = 512) -> None:
        from rollout_bus.lm import tokenizer

        self._tok = tokenizer
        self.max_context = max_context
        self.stop_token_ids: tuple[int, ...] = (tokenizer.EOS_ID,)

    def render(self, messages: Sequence[Message], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool) -> str:
        parts = []
        for m in messages:
            if m["role"] == "assistant":
                parts.append(f"assistant:{m['content']}<eos>")
            else:
                parts.append(f"{m['role']}:{m['content']}|")
        if add_generation_prompt:
            parts.append("assistant:")
        return "".join(parts)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(text.split("<eos>")):
            if i:
                ids.append(self._tok.EOS_ID)
            try:
                ids.extend(self._tok.encode(piece))
            except ValueError as exc:
                raise ChatError(f"the tiny LM cannot write this text: {exc}", param="messages") from None
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join("<eos>" if t == self._tok.EOS_ID else self._tok.decode([t]) for t in ids)

    def reply_text(self, ids: Sequence[int]) -> str:
        out = []
        for t in ids:
            if t == self._tok.EOS_ID:
                break
            out.append(t)
        return str(self._tok.decode(out))


def load_format(model_path: str | None, *, max_context: int | None = None) -> ChatFormat:
    """``HFChat`` for a Hugging Face model directory (its config names a ``model_type``), ``CharChat``
    for the tiny LM's (or for no directory)."""
    if model_path:
        try:
            config = json.loads((Path(model_path) / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
        if config.get("model_type"):
            return HFChat(model_path, max_context=max_context)
        seq = config.get("max_seq_len")
        if max_context is None and isinstance(seq, int) and seq > 0:
            max_context = seq
    return CharChat(max_context=max_context or 512)
