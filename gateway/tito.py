"""Token-in, token-out: what one call adds to a session, and what a session becomes as a sample.

Pure functions over a session's state (``events.sessions``): no Redis, no HTTP, no clock.

A session's tokens are the concatenation, turn by turn, of the tokens appended for the messages the
client added (``new_ids``, loss mask 0: prompt, user, tool and environment text) and the tokens the
engine made (``output_ids``, loss mask 1, each with its log-prob and the weight version that made it).
The messages a client sends must start with the session's recorded history (its earlier messages and
the replies the gateway gave): a history that differs is refused (``history_mismatch``, HTTP 409) with
the first differing message, the field that differs and the token position where that message's
tokens begin; the client starts a new session instead. Refusing, rather than branching the session,
keeps one session one trajectory: a sample is never a splice of two histories.

A gateway that served a session's last turn keeps a ``Memo`` of it (the recorded messages, the tokens and
the template's text of the history): derived from that one committed state and equal to what the full path
derives from it, so a call planned with the memo appends the same ids as one planned without.

``position`` counts the turns of the journal the current attempt of the episode has reached. A
retried episode (its executor died) reopens the session with ``position`` 0: each call whose new
messages and parameters equal the journal's next turn is answered from it, with the same tokens and
no engine; the first call that differs discards the journal from that turn on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from rollout_bus.gateway.chat import (
    ChatError,
    ChatFormat,
    Message,
    Rendered,
    canonical,
    canonical_messages,
    first_render,
    suffix,
)

CHAT = "chat"
COMPLETION = "completion"


class ContextOverflow(ChatError):
    """The session's context would pass the model's: the session ends with status ``overflow``."""

    def __init__(self, needed: int, limit: int) -> None:
        super().__init__(f"this call needs {needed} context tokens but the model takes {limit}: the session ends "
                         "here (status overflow); start a new session with a shorter history",
                         code="context_length_exceeded", param="messages", status=400)
        self.needed = needed
        self.limit = limit


@dataclass
class Plan:
    """What a call will do: answer from the journal, or generate after appending ``new_ids``."""

    kind: str
    new: list[Any]
    """The new messages (chat) or the new prompt text (completion), as the journal records them."""
    new_ids: list[int]
    context: list[int]
    """Every token the engine sees: the session's so far, then ``new_ids``."""
    turn: int
    journal: dict[str, Any] | None = None
    discarded: int = 0
    """Journal turns dropped because this call differs from them."""
    history: list[Message] = field(default_factory=list)
    repeat: bool = False
    """A retried call of the session's last turn (its reply was lost on the way): answered again from the
    journal, the session unchanged, so a client's retry never makes a second trajectory."""
    digest: str = ""
    """The call's parameters (``params_digest``), recorded with the turn so a journal answers only the same call."""
    memo: Memo | None = None
    """The memo the call was planned with (``plan_chat``)."""


@dataclass
class Memo:
    """What the full path derives from one committed state (``state``, by identity) at its position: the
    recorded messages (``history``; each canonical), the tokens (``tokens``), the template's text of the
    history without the generation prompt per tool list (``rendered``, filled once known) and the text of
    the last reply's tokens (``made``)."""

    state: Mapping[str, Any]
    history: list[Message]
    tokens: list[int]
    rendered: dict[str, str] = field(default_factory=dict)
    made: str | None = None
    packed: list[bytes] | None = None
    """The state's turns as its commit packed them (``events.sessions.pack_turn``), where known."""

    def fits(self, state: Mapping[str, Any]) -> bool:
        return self.state is state

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> Memo | None:
        """A memo of a state read whole (from the bus): None when its recorded messages are not all in
        canonical form (only canonical messages can stand in for the ones a client sends)."""
        recorded = history(state)
        try:
            if not all(type(m) is dict and canonical(m, "") == m for m in recorded):
                return None
        except ChatError:
            return None
        return cls(state, recorded, tokens(state))


def memo_after(state: Mapping[str, Any], plan: Plan, turn: Mapping[str, Any], *,
               packed: list[bytes] | None = None) -> Memo | None:
    """The memo of ``state``, the state after ``plan`` (planned with a memo) made ``turn`` (its reply in
    canonical form); None for a plan without one, or one that did not append a turn at the memo's position.
    ``packed``: ``state``'s turns as its commit packed them."""
    memo = plan.memo
    if (memo is None or plan.kind != CHAT or plan.journal is not None or plan.turn != memo.state["position"]
            or state["position"] != plan.turn + 1):
        return None
    return Memo(state, [*memo.history, *plan.new, turn["reply"]], [*plan.context, *turn["output_ids"]],
                packed=packed)


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools, sort_keys=True) if tools else ""


def params_digest(params: Mapping[str, Any]) -> str:
    """A digest of the parameters that shape a reply, so a journal turn answers only the same call."""
    return hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:32]


def history(state: Mapping[str, Any], upto: int | None = None) -> list[Message]:
    """The chat messages of the first ``upto`` turns, with the replies the gateway gave."""
    out: list[Message] = []
    for turn in state["turns"][: state["position"] if upto is None else upto]:
        out.extend(turn["messages"])
        out.append(turn["reply"])
    return out


def tokens(state: Mapping[str, Any], upto: int | None = None) -> list[int]:
    out: list[int] = []
    for turn in state["turns"][: state["position"] if upto is None else upto]:
        out.extend(turn["new_ids"])
        out.extend(turn["output_ids"])
    return out


def _offsets(state: Mapping[str, Any], upto: int) -> list[tuple[int, int]]:
    """(message count, token offset) at the start of each of the first ``upto`` turns' blocks."""
    marks = []
    n_msgs = n_tok = 0
    for turn in state["turns"][:upto]:
        marks.append((n_msgs, n_tok))
        n_msgs += len(turn["messages"])
        n_tok += len(turn["new_ids"])
        marks.append((n_msgs, n_tok))
        n_msgs += 1
        n_tok += len(turn["output_ids"])
    marks.append((n_msgs, n_tok))
    return marks


def _token_position(state: Mapping[str, Any], upto: int, message_index: int) -> int:
    position = 0
    for n_msgs, n_tok in _offsets(state, upto):
        if n_msgs <= message_index:
            position = n_tok
    return position


def plan_chat(fmt: ChatFormat, state: Mapping[str, Any], raw_messages: Any, *,
              tools: list[dict[str, Any]] | None, digest: str, memo: Memo | None = None) -> Plan:
    """What a chat call does to the session; ``memo`` (of this very ``state``) spares rebuilding the history,
    the tokens and the history's render, and gives the same plan."""
    if memo is not None and not memo.fits(state):
        memo = None
    plan = _plan_chat(fmt, state, raw_messages, tools=tools, digest=digest, memo=memo)
    plan.digest = digest
    plan.memo = memo
    return plan


def canonical_against(raw_messages: Any, recorded: Sequence[Message]) -> list[Message]:
    """``canonical_messages(raw_messages)`` where ``recorded`` holds canonical messages: a message equal to
    the recorded one at its index is that one (``canonical`` of it gives it back, and raises nothing)."""
    if not isinstance(raw_messages, list) or not raw_messages:
        return canonical_messages(raw_messages)
    n = len(recorded)
    return [recorded[i] if i < n and m == recorded[i] else canonical(m, f"messages[{i}]")
            for i, m in enumerate(raw_messages)]


def _plan_chat(fmt: ChatFormat, state: Mapping[str, Any], raw_messages: Any, *,
               tools: list[dict[str, Any]] | None, digest: str, memo: Memo | None) -> Plan:
    pos = state["position"]
    if memo is not None:
        recorded = memo.history
        messages = canonical_against(raw_messages, recorded)
    else:
        messages = canonical_messages(raw_messages)
        recorded = history(state, pos)
    if pos and messages == recorded[:-1] and state["turns"][pos - 1].get("params") == digest:
        last = state["turns"][pos - 1]
        return Plan(CHAT, list(last["messages"]), list(last["new_ids"]), tokens(state, pos - 1) + list(last["new_ids"]),
                    pos - 1, journal=last, repeat=True)
    for i, want in enumerate(recorded):
        if i >= len(messages):
            raise ChatError(f"the messages stop after {len(messages)} of the session's {len(recorded)} recorded "
                            "messages: send the whole history, then the new messages", code="history_mismatch",
                            status=409, param=f"messages[{len(messages)}]",
                            position=_token_position(state, pos, len(messages)))
        got = messages[i]
        if got != want:
            fields = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
            raise ChatError(f"messages[{i}] differs from the session's recorded message ({', '.join(fields)}: "
                            f"{_short(got, fields)} is not the recorded {_short(want, fields)}) at token position "
                            f"{_token_position(state, pos, i)}; a session's history cannot be edited: start a new "
                            "session", code="history_mismatch", status=409, param=f"messages[{i}]",
                            position=_token_position(state, pos, i))
    new = messages[len(recorded):]
    if not new:
        raise ChatError("no new message after the session's recorded history: add the user or tool message to "
                        "answer", param="messages")
    for j, m in enumerate(new, len(recorded)):
        if m["role"] == "assistant":
            raise ChatError(f"messages[{j}] is an assistant message this session's engine did not write; a "
                            "session's assistant turns are its engine's replies, exactly as returned",
                            code="history_mismatch", status=409, param=f"messages[{j}]",
                            position=_token_position(state, pos, j))
    journal, discarded = _journal_turn(state, CHAT, new, digest)
    if journal is not None:
        return Plan(CHAT, new, list(journal["new_ids"]), tokens(state, pos) + list(journal["new_ids"]), pos,
                    journal=journal, history=recorded)
    if pos == 0:
        rendered = first_render(fmt, new, tools)
    elif memo is not None:
        last_output = state["turns"][pos - 1]["output_ids"]
        if memo.made is None:
            memo.made = fmt.decode(last_output)
        rendered = suffix(fmt, recorded, new, last_output=last_output, tools=tools,
                          before=memo.rendered.get(tools_key(tools)), made=memo.made)
    else:
        rendered = suffix(fmt, recorded, new, last_output=state["turns"][pos - 1]["output_ids"], tools=tools)
    return _generate_plan(state, CHAT, new, rendered, pos, discarded, recorded,
                          have=memo.tokens if memo is not None else None)


def plan_completion(fmt: ChatFormat, state: Mapping[str, Any], prompt: Any, *, digest: str) -> Plan:
    """``/v1/completions``: the prompt (text, or token ids) must start with everything the session holds."""
    plan = _plan_completion(fmt, state, prompt, digest=digest)
    plan.digest = digest
    return plan


def _plan_completion(fmt: ChatFormat, state: Mapping[str, Any], prompt: Any, *, digest: str) -> Plan:
    pos = state["position"]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        have = tokens(state, pos)
        if prompt[:len(have)] != have:
            at = next((i for i, (a, b) in enumerate(zip(have, prompt, strict=False)) if a != b), len(prompt))
            raise ChatError(f"prompt token {at} differs from the session's recorded tokens", code="history_mismatch",
                            status=409, param="prompt", position=at)
        new_ids = list(prompt[len(have):])
        new: list[Any] = [{"ids": new_ids}]
        rendered = Rendered(new_ids, "")
    elif isinstance(prompt, str) and prompt:
        have_text = "".join(t["messages"][0].get("text", "") + t["reply"].get("text", "")
                            for t in state["turns"][:pos])
        if not prompt.startswith(have_text):
            at = next((i for i, (a, b) in enumerate(zip(have_text, prompt, strict=False)) if a != b),
                      len(prompt))
            raise ChatError(f"prompt character {at} differs from the session's recorded text (the earlier prompts "
                            "and completions): a session's text cannot be edited", code="history_mismatch",
                            status=409, param="prompt", position=at)
        text = prompt[len(have_text):]
        if pos and not text:
            raise ChatError("the prompt adds nothing after the session's recorded text", param="prompt")
        new = [{"text": text}]
        rendered = Rendered(fmt.encode(text) if text else [], text)
    else:
        raise ChatError("prompt must be a non-empty string or a list of token ids (one prompt per session)",
                        param="prompt")
    journal, discarded = _journal_turn(state, COMPLETION, new, digest)
    if journal is not None:
        return Plan(COMPLETION, new, list(journal["new_ids"]), tokens(state, pos) + list(journal["new_ids"]), pos,
                    journal=journal)
    return _generate_plan(state, COMPLETION, new, rendered, pos, discarded, [])


def _journal_turn(state: Mapping[str, Any], kind: str, new: list[Any], digest: str) -> tuple[dict[str, Any] | None, int]:
    pos = state["position"]
    turns = state["turns"]
    if pos < len(turns):
        turn = turns[pos]
        if turn.get("kind") == kind and turn["messages"] == new and turn.get("params") == digest:
            return turn, 0
        return None, len(turns) - pos
    return None, 0


def _generate_plan(state: Mapping[str, Any], kind: str, new: list[Any], rendered: Rendered, pos: int,
                   discarded: int, recorded: list[Message], have: list[int] | None = None) -> Plan:
    context = (tokens(state, pos) if have is None else have) + rendered.ids
    if len(context) >= state["max_context"]:
        raise ContextOverflow(len(context) + 1, state["max_context"])
    return Plan(kind, new, rendered.ids, context, pos, discarded=discarded, history=recorded)


def apply_turn(state: Mapping[str, Any], plan: Plan, turn: Mapping[str, Any]) -> dict[str, Any]:
    """The state after ``plan`` produced ``turn`` (the journal from ``plan.turn`` on is replaced)."""
    new = dict(state)
    new["turns"] = [*state["turns"][:plan.turn], dict(turn)]
    new["position"] = plan.turn + 1
    return new


def replay_journal(state: Mapping[str, Any], plan: Plan) -> dict[str, Any]:
    new = dict(state)
    new["position"] = plan.turn + 1
    return new


# --- sessions as samples -------------------------------------------------------------------------

@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    log_probs: list[float]
    versions: list[int]
    """Per response token: the weight version that made it (-1 on tokens the engine did not make)."""


def trajectory(state: Mapping[str, Any]) -> Trajectory:
    """The session as one sample: the first turn's appended tokens are the prompt; every later token is
    response, trained (mask 1) where the engine made it."""
    turns = state["turns"][: state["position"]]
    if not turns:
        return Trajectory([], [], [], [], [])
    prompt = list(turns[0]["new_ids"])
    t = Trajectory(prompt, [], [], [], [])
    for i, turn in enumerate(turns):
        if i:
            _extend(t, turn["new_ids"], None)
        _extend(t, turn["output_ids"], turn)
    return t


def per_turn(state: Mapping[str, Any]) -> list[Trajectory]:
    """One sample per turn: everything before the turn's reply is prompt, the reply is the response."""
    out = []
    context: list[int] = []
    for turn in state["turns"][: state["position"]]:
        context = context + list(turn["new_ids"])
        t = Trajectory(list(context), [], [], [], [])
        _extend(t, turn["output_ids"], turn)
        out.append(t)
        context = context + list(turn["output_ids"])
    return out


def _extend(t: Trajectory, ids: Sequence[int], turn: Mapping[str, Any] | None) -> None:
    t.response_ids.extend(ids)
    if turn is None:
        t.loss_mask.extend([0] * len(ids))
        t.log_probs.extend([0.0] * len(ids))
        t.versions.extend([-1] * len(ids))
    else:
        t.loss_mask.extend([1] * len(ids))
        t.log_probs.extend(float(x) for x in turn["logprobs"])
        t.versions.extend(int(v) for v in turn["versions"])


def digest(ids: Sequence[int], mask: Sequence[int]) -> str:
    """xxh3-64 of a sample's token ids and loss mask (prompt tokens count as mask 0)."""
    h = xxhash.xxh3_64()
    h.update(b"".join(int(t).to_bytes(4, "little") for t in ids))
    h.update(bytes(int(m) for m in mask))
    return h.hexdigest()


def trajectory_digest(t: Trajectory) -> str:
    return digest(t.prompt_ids + t.response_ids, [0] * len(t.prompt_ids) + t.loss_mask)


def model_versions(state: Mapping[str, Any]) -> list[int]:
    return sorted({int(v) for turn in state["turns"][: state["position"]] for v in turn["versions"] if v >= 0})


def _short(message: Mapping[str, Any], fields: list[str]) -> str:
    return json.dumps({k: message.get(k) for k in fields})[:160]
