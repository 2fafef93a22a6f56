"""The gateway's fast path gives the full path's tokens: a call planned with the memo of the session's last
turn (kept history, tokens and render), the template called directly, the tokenizer's Rust core called
directly, and a state the store does not send again, each against what it stands in for."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import fakeredis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_bus.events.names import Keys
from rollout_bus.events.sessions import (
    BadState,
    SessionBusy,
    SessionNotFound,
    SessionStore,
    _pack,
    check_state,
    new_state,
    pack_state,
    pack_turn,
)
from rollout_bus.gateway.chat import CharChat, ChatError, ChatFormat, HFChat, canonical, parse_tool_calls
from rollout_bus.gateway.tito import Memo, apply_turn, memo_after, plan_chat, tokens, tools_key
from tests.support.gateway import CHATML_TOOLS_TEMPLATE
from tests.support.models import copy_dir, llama_dir

TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "calc", "description": "arithmetic",
                                           "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> HFChat:
    return HFChat(str(llama_dir(tmp_path_factory.mktemp("llama") / "v0", seed=3)))


@pytest.fixture(scope="module")
def tooled(tmp_path_factory: pytest.TempPathFactory) -> HFChat:
    base = llama_dir(tmp_path_factory.mktemp("llama") / "v0", seed=3)
    directory = copy_dir(base, Path(tmp_path_factory.mktemp("tooled")) / "v0")
    (directory / "chat_template.jinja").write_text(CHATML_TOOLS_TEMPLATE)
    return HFChat(str(directory))


def test_the_direct_template_and_encoder_are_in_use(chatml: HFChat, tooled: HFChat) -> None:
    assert chatml.direct is not None and tooled.direct is not None and tooled.supports_tools
    assert chatml.encode("<|im_start|>user\nhi") == [int(t) for t in chatml.hf("<|im_start|>user\nhi",
                                                                                add_special_tokens=False)["input_ids"]]


# --- a session played turn by turn, every call planned both ways -------------------------------------

texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=24)
specials = st.sampled_from(["", "<|im_end|>", "<|im_start|>assistant\n", "\n", " "])


@st.composite
def episodes(draw: st.DrawFn, tools: bool) -> list[dict[str, Any]]:
    """Turns of an agent: each the messages it adds (user, tool, system) and the reply text the engine makes,
    ended (or cut at the length limit), maybe a tool call, maybe echoed back with an OpenAI client's Nones."""
    turns = []
    for k in range(draw(st.integers(1, 5))):
        added = []
        if k == 0 and draw(st.booleans()):
            added.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(texts)})
        for _ in range(draw(st.integers(1, 2))):
            role = draw(st.sampled_from(["user", "tool"] if tools and k else ["user"]))
            content: Any = draw(texts) + draw(specials)
            if draw(st.booleans()):
                content = [{"type": "text", "text": content}]
            message = {"role": role, "content": content}
            if role == "tool":
                message["tool_call_id"] = draw(st.sampled_from(["", "c1"]))
            added.append(message)
        reply = draw(texts)
        if tools and draw(st.booleans()):
            reply += '<tool_call>{"name": "calc", "arguments": {"e": "1+1"}}</tool_call>'
        turns.append({"added": added, "reply": reply, "ended": draw(st.booleans()), "echo_nones": draw(st.booleans())})
    return turns


def play(fmt: ChatFormat, episode: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
    """Each turn planned with no memo (the full render, as after a restart or on another gateway) and with
    the memo the previous turn left, its history rendered ahead as the gateway does after a reply: the same
    appended ids and context every turn, or the same refusal."""
    stop = list(fmt.stop_token_ids[:1])
    state = new_state("s", "p", max_context=1 << 20)
    memo: Memo | None = Memo.of(state)
    messages: list[Any] = []
    packed: list[bytes] = []
    for k, turn in enumerate(episode):
        messages = [*messages, *turn["added"]]
        full_error = fast_error = None
        try:
            full = plan_chat(fmt, state, messages, tools=tools, digest="d")
        except ChatError as exc:
            full_error = (exc.code, exc.param, exc.position, str(exc))
        assert memo is not None
        if state["position"] and fmt.deterministic:  # type: ignore[attr-defined]
            with contextlib.suppress(ChatError):
                memo.rendered[tools_key(tools)] = fmt.render(memo.history, tools=tools, add_generation_prompt=False)
        try:
            fast = plan_chat(fmt, state, messages, tools=tools, digest="d", memo=memo)
        except ChatError as exc:
            fast_error = (exc.code, exc.param, exc.position, str(exc))
        assert fast_error == full_error
        if full_error is not None:
            return
        assert fast.new_ids == full.new_ids and fast.context == full.context and fast.new == full.new, f"turn {k}"
        output = fmt.encode(turn["reply"]) + (stop if turn["ended"] else [])
        content, calls = parse_tool_calls(fmt.reply_text(output))
        reply = canonical({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})},
                          "reply")
        record = {"kind": "chat", "messages": fast.new, "new_ids": fast.new_ids, "output_ids": output,
                  "logprobs": [0.0] * len(output), "versions": [0] * len(output), "engine_id": "e0",
                  "finish": "stop", "reply": reply, "params": "d"}
        state = apply_turn(state, fast, record)
        packed = [*packed, pack_turn(state["turns"][-1])]
        assert pack_state(state, packed) == _pack(state)  # the commit's bytes, the journal packed turn by turn
        memo = memo_after(state, fast, record)
        assert memo is not None and memo.tokens == tokens(state) and Memo.of(state) == Memo(
            state, memo.history, memo.tokens)
        echoed = dict(reply)
        if turn["echo_nones"]:
            echoed.update({"refusal": None, "audio": None, "function_call": None})
            echoed.setdefault("tool_calls", None)
        messages = [*messages, echoed]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(episode=episodes(tools=False))
def test_chatml_sessions_get_the_full_renders_tokens(chatml: HFChat, episode: list[dict[str, Any]]) -> None:
    play(chatml, episode, None)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(episode=episodes(tools=True))
def test_sessions_with_tools_get_the_full_renders_tokens(tooled: HFChat, episode: list[dict[str, Any]]) -> None:
    play(tooled, episode, TOOLS)


lm_text = st.text(alphabet="abcdefghij 0123456789+-=?.", max_size=16)


@settings(max_examples=60, deadline=None)
@given(episode=episodes(tools=False).map(lambda turns: [
    {**t, "added": [{**m, "content": "".join(c for c in str(m["content"]) if c in "abcdefghij 0123456789")}
                    for m in t["added"]], "reply": "".join(c for c in t["reply"] if c in "abcdefghij 0123")}
    for t in turns]))
def test_the_tiny_lms_sessions_get_the_full_paths_tokens(episode: list[dict[str, Any]]) -> None:
    play(CharChat(max_context=1 << 20), episode, None)


def test_an_edited_history_is_refused_alike_with_or_without_the_memo(chatml: HFChat) -> None:
    state = new_state("s", "p", max_context=4096)
    first = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "2+2?"}]
    plan = plan_chat(chatml, state, first, tools=None, digest="d", memo=Memo.of(state))
    output = chatml.encode("4") + list(chatml.stop_token_ids[:1])
    turn = {"kind": "chat", "messages": plan.new, "new_ids": plan.new_ids, "output_ids": output,
            "logprobs": [0.0] * len(output), "versions": [0] * len(output), "engine_id": "e0", "finish": "stop",
            "reply": {"role": "assistant", "content": "4"}, "params": "d"}
    state = apply_turn(state, plan, turn)
    memo = memo_after(state, plan, turn)
    for edited in ([{"role": "system", "content": "be verbose"}, first[1], turn["reply"], {"role": "user", "content": "x"}],
                   [*first, {"role": "assistant", "content": "5"}, {"role": "user", "content": "x"}],
                   [*first, turn["reply"], {"role": "robot", "content": "x"}]):
        caught = []
        for m in (None, memo):
            with pytest.raises(ChatError) as exc:
                plan_chat(chatml, state, edited, tools=None, digest="d", memo=m)
            caught.append((exc.value.code, exc.value.param, exc.value.position, str(exc.value)))
        assert caught[0] == caught[1]


def test_a_memo_of_another_state_is_not_used() -> None:
    fmt = CharChat(max_context=400)
    state = new_state("s", "p", max_context=400)
    stale = Memo(new_state("s", "p", max_context=400), [{"role": "user", "content": "forged"}], [1, 2, 3])
    plan = plan_chat(fmt, state, [{"role": "user", "content": "hi"}], tools=None, digest="d", memo=stale)
    assert plan.memo is None and plan.context == fmt.encode("user:hi|assistant:")


def test_a_state_with_a_non_canonical_history_gets_no_memo() -> None:
    state = new_state("s", "p", max_context=400)
    state["turns"] = [{"messages": [{"role": "developer", "content": "x"}], "reply": {"role": "assistant",
                                                                                      "content": "y"},
                       "new_ids": [1], "output_ids": [2]}]
    state["position"] = 1
    assert Memo.of(state) is None


# --- the template and the tokenizer, called directly ------------------------------------------------

message_st = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                    "content": texts}, optional={"name": texts, "tool_call_id": texts})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(message_st, min_size=1, max_size=6), generation=st.booleans(), with_tools=st.booleans())
def test_the_direct_render_is_the_wrappers_byte_for_byte(tooled: HFChat, messages: list[dict[str, Any]],
                                                         generation: bool, with_tools: bool) -> None:
    tools = TOOLS if with_tools else None
    want = tooled.hf.apply_chat_template(messages, tools=tools, tokenize=False,  # type: ignore[arg-type]
                                         add_generation_prompt=generation)
    assert tooled.render(messages, tools=tools, add_generation_prompt=generation) == want


def test_messages_the_wrapper_would_change_go_through_the_wrapper(chatml: HFChat) -> None:
    odd: list[dict[str, Any]] = [{"role": "user", "content": "a", "name": None},
                                 {"role": "assistant", "content": "b", "reasoning": "r"}]
    want = chatml.hf.apply_chat_template(odd, tokenize=False, add_generation_prompt=True)
    assert chatml.render(odd, add_generation_prompt=True) == want


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(st.one_of(texts, specials, st.sampled_from(["<|im_start|>", "<s>", "</s>"])),
                     max_size=6).map("".join))
def test_the_direct_encoder_gives_the_wrappers_ids(chatml: HFChat, text: str) -> None:
    assert chatml.encode(text) == [int(t) for t in chatml.hf(text, add_special_tokens=False)["input_ids"]]


def test_the_encoder_follows_a_changed_split_special_tokens(chatml: HFChat) -> None:
    text = "<|im_end|>x"
    chatml.hf(text, add_special_tokens=False, split_special_tokens=True)  # leaves the Rust flag set
    try:
        assert chatml.encode(text) == [int(t) for t in chatml.hf(text, add_special_tokens=False)["input_ids"]]
        assert chatml.encode(text)[0] in chatml.stop_token_ids
    finally:
        chatml.hf(text, add_special_tokens=False)


# --- the store: a kept state is used only while the session is still at its commit ------------------

@pytest.fixture()
def store() -> SessionStore:
    return SessionStore(fakeredis.FakeRedis(), Keys("t"))


def committed(store: SessionStore, token: str, change: dict[str, Any], known: Any = None) -> Any:
    held = store.begin("s", token, known=known)
    state = {**held.state, **change}
    store.commit(held, state)
    held.state = state
    return held


def test_a_kept_state_is_used_until_someone_else_writes(store: SessionStore) -> None:
    assert store.create(new_state("s", "p", max_context=64))
    mine = committed(store, "a", {"engine_id": "e0"})
    again = store.begin("s", "b", known=mine)
    assert again.state is mine.state  # nothing read: the session is at my commit
    store.release("s", "b")
    other = committed(store, "c", {"engine_id": "e1"})  # another gateway's turn
    fresh = store.begin("s", "d", known=mine)
    assert fresh.state is not mine.state and fresh.state["engine_id"] == "e1"
    store.release("s", "d")
    assert store.begin("s", "e", known=other).state is other.state
    store.release("s", "e")


def test_the_same_revision_by_another_writer_is_read_whole(store: SessionStore) -> None:
    assert store.create(new_state("s", "p", max_context=64))
    mine = committed(store, "a", {"engine_id": "e0"})
    store.delete("s")  # the session re-created: its revisions start again
    assert store.create(new_state("s", "p", max_context=64))
    committed(store, "z", {"engine_id": "e9"})
    assert store.client.hget(Keys("t").session("s"), "rev") == mine.rev  # same revision, other writer
    fresh = store.begin("s", "b", known=mine)
    assert fresh.state is not mine.state and fresh.state["engine_id"] == "e9"


def test_a_kept_state_passes_the_lock_and_tenant_checks_first(store: SessionStore) -> None:
    assert store.create(new_state("s", "p", max_context=64), tenant="a")
    mine = committed(store, "a", {"engine_id": "e0"})
    held = store.begin("s", "b", known=mine, tenant="a")
    with pytest.raises(SessionBusy):
        store.begin("s", "c", known=mine, tenant="a")
    store.release("s", held.token)
    with pytest.raises(SessionNotFound):
        store.begin("s", "d", known=mine, tenant="other")


def test_a_begin_sent_ahead_gives_what_begin_gives(store: SessionStore) -> None:
    assert store.create(new_state("s", "p", max_context=64))
    mine = committed(store, "a", {"engine_id": "e0"})
    pending = store.send_begin("s", "b", known=mine)
    busy = store.send_begin("s", "c", known=mine)
    with pytest.raises(SessionBusy):
        busy.held()
    assert pending.held().state is mine.state
    store.release("s", "b")
    with pytest.raises(SessionNotFound):
        store.send_begin("gone", "x").held()
    read = store.send_begin("s", "d").held()
    assert read.state == mine.state and read.state is not mine.state


def test_a_partial_check_covers_the_header_and_the_new_turns_only() -> None:
    state = new_state("s", "p", max_context=64)
    good = {"new_ids": [1], "output_ids": [2], "logprobs": [0.0], "versions": [0], "messages": [], "engine_id": "e"}
    state["turns"] = [good, {**good, "output_ids": [-1]}]
    state["position"] = 2
    with pytest.raises(BadState):
        check_state("s", state, from_turn=1)
    state["turns"] = [{**good, "output_ids": [-1]}, good]
    assert check_state("s", state, from_turn=1) is state  # turn 0 is taken as checked before
    with pytest.raises(BadState):
        check_state("s", {**state, "engine_id": "no way"}, from_turn=2)


json_like = st.recursive(st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.floats() | st.text(max_size=8)
                         | st.binary(max_size=8),
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                      max_size=3), max_leaves=10)


@settings(max_examples=200, deadline=None)
@given(header=st.dictionaries(st.text(max_size=8), json_like, max_size=24),
       turns=st.lists(st.dictionaries(st.text(max_size=6), json_like, max_size=6), max_size=20))
def test_a_state_packed_around_its_packed_turns_is_the_same_bytes(header: dict[str, Any],
                                                                   turns: list[dict[str, Any]]) -> None:
    state = {**header, "turns": turns}
    assert pack_state(state, [pack_turn(t) for t in turns]) == _pack(state)
    with pytest.raises(ValueError):
        pack_state(state, [pack_turn(t) for t in turns[1:]] if turns else [b"\x80"])


def test_a_commit_sent_ahead_says_what_commit_says(store: SessionStore) -> None:
    from rollout_bus.events.publish import Publisher
    from rollout_bus.events.schema import Producer, SessionTurn
    from rollout_bus.events.sessions import SessionConflict

    publisher = Publisher(store.client, store.keys, Producer("gateway", "t"))

    def event() -> tuple[list[Any], list[Any]]:
        return publisher.prepared(store.keys.session_stream, SessionTurn(
            producer=publisher.producer, policy="p", session_id="s", turn=0, engine_id="e0", new_tokens=1,
            output_tokens=1, cached_tokens=0, oldest_version=0, newest_version=0, finish="stop", gen_ms=1.0,
            env_ms=0.0))

    assert store.create(new_state("s", "p", max_context=64))
    held = store.begin("s", "a")
    rev = held.rev
    sent = store.send_commit(held, {**held.state, "engine_id": "e0"}, publish=event())
    assert held.rev == rev  # nothing known before the reply is read
    sent.done()
    assert held.rev != rev and store.get("s")["engine_id"] == "e0"  # type: ignore[index]
    assert store.client.xlen(store.keys.session_stream) == 1
    late = store.begin("s", "b")
    store.unlock("s")  # a takeover broke the call's lock
    with pytest.raises(SessionConflict):
        store.send_commit(late, {**late.state, "engine_id": "e1"}, publish=event()).done()
    assert store.get("s")["engine_id"] == "e0" and store.client.xlen(store.keys.session_stream) == 1  # type: ignore[index]
