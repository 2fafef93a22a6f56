"""Token-in, token-out over a session's state (pure: no Redis, no engine), with the tiny LM's chat form."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bus.events.sessions import new_state
from rollout_bus.gateway.chat import CharChat, ChatError, canonical, parse_tool_calls, suffix
from rollout_bus.gateway.tito import (
    ContextOverflow,
    apply_turn,
    digest,
    per_turn,
    plan_chat,
    plan_completion,
    replay_journal,
    trajectory,
    trajectory_digest,
)
from rollout_bus.lm import tokenizer

FMT = CharChat(max_context=400)


def made(fmt: CharChat, text: str) -> list[int]:
    """What the engine would make for ``text``: its tokens and the end of turn."""
    return tokenizer.encode(text) + [tokenizer.EOS_ID]


def turn_of(plan: Any, output: list[int], version: int = 0) -> dict[str, Any]:
    return {"kind": plan.kind, "messages": plan.new, "new_ids": plan.new_ids, "output_ids": output,
            "logprobs": [-0.5] * len(output), "versions": [version] * len(output), "engine_id": "e0",
            "finish": "stop", "reply": {"role": "assistant", "content": FMT.reply_text(output)},
            "params": plan.digest, "gen_ms": 1.0, "env_ms": 0.0}


def play(state: dict[str, Any], messages: list[dict[str, Any]], reply: str, digest_: str = "d",
         version: int = 0) -> tuple[dict[str, Any], Any]:
    plan = plan_chat(FMT, state, messages, tools=None, digest=digest_)
    assert plan.journal is None
    return apply_turn(state, plan, turn_of(plan, made(FMT, reply), version)), plan


def three_turns() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    state = new_state("s1", "p", max_context=400)
    messages = [{"role": "user", "content": "guess 1 to 9"}]
    for k, reply in enumerate(("5", "7", "6")):
        state, _ = play(state, messages, reply, version=k)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "higher."}]
    return state, messages


def test_the_sample_is_every_turns_tokens_and_the_mask_covers_the_engines() -> None:
    state, messages = three_turns()
    t = trajectory(state)
    assert t.prompt_ids == FMT.encode("user:guess 1 to 9|assistant:")
    whole = FMT.decode(t.prompt_ids + t.response_ids)
    assert whole == "user:guess 1 to 9|assistant:5<eos>user:higher.|assistant:7<eos>user:higher.|assistant:6<eos>"
    made_ids = [tid for tid, m in zip(t.response_ids, t.loss_mask, strict=True) if m]
    assert FMT.decode(made_ids) == "5<eos>7<eos>6<eos>"
    assert [v for v, m in zip(t.versions, t.loss_mask, strict=True) if m] == [0, 0, 1, 1, 2, 2]
    assert all(v == -1 for v, m in zip(t.versions, t.loss_mask, strict=True) if not m)
    assert trajectory_digest(t) == digest(t.prompt_ids + t.response_ids, [0] * len(t.prompt_ids) + t.loss_mask)
    turns = per_turn(state)
    assert len(turns) == 3 and turns[2].prompt_ids + turns[2].response_ids == t.prompt_ids + t.response_ids
    assert all(set(x.loss_mask) == {1} for x in turns)


def test_an_edited_history_is_refused_with_the_first_differing_message_and_its_token_position() -> None:
    state, messages = three_turns()
    edited = [dict(m) for m in messages]
    edited[3] = {"role": "user", "content": "lower."}
    with pytest.raises(ChatError) as caught:
        plan_chat(FMT, state, edited, tools=None, digest="d")
    assert caught.value.code == "history_mismatch" and caught.value.param == "messages[3]"
    first, second = state["turns"][0], state["turns"][1]  # messages[3] is turn 1's reply
    assert caught.value.position == len(first["new_ids"]) + len(first["output_ids"]) + len(second["new_ids"])
    with pytest.raises(ChatError) as caught:
        plan_chat(FMT, state, messages[:2], tools=None, digest="d")
    assert caught.value.code == "history_mismatch"


def test_an_assistant_message_the_engine_did_not_write_is_refused() -> None:
    state, messages = three_turns()
    with pytest.raises(ChatError) as caught:
        plan_chat(FMT, state, [*messages, {"role": "assistant", "content": "8"}, {"role": "user", "content": "x"}],
                  tools=None, digest="d")
    assert caught.value.code == "history_mismatch" and caught.value.param == f"messages[{len(messages)}]"


def test_a_retried_episode_is_answered_from_the_journal_until_it_differs() -> None:
    state, messages = three_turns()
    retry = replay_journal({**state, "position": 0}, plan_chat(FMT, {**state, "position": 0}, messages[:1],
                                                               tools=None, digest="d"))
    assert retry["position"] == 1  # turn 0 from the journal
    plan = plan_chat(FMT, retry, messages[:3], tools=None, digest="d")
    assert plan.journal is state["turns"][1]
    retry = replay_journal(retry, plan)
    plan = plan_chat(FMT, retry, [*messages[:4], {"role": "user", "content": "lower."}], tools=None, digest="d")
    assert plan.journal is None and plan.discarded == 1  # the differing call drops the rest of the journal
    after = apply_turn(retry, plan, turn_of(plan, made(FMT, "3")))
    assert len(after["turns"]) == 3 and after["position"] == 3
    assert FMT.reply_text(after["turns"][2]["output_ids"]) == "3"


def test_other_parameters_do_not_take_a_journal_answer() -> None:
    state, messages = three_turns()
    plan = plan_chat(FMT, {**state, "position": 0}, messages[:1], tools=None, digest="other")
    assert plan.journal is None and plan.discarded == 3


def test_a_retried_call_of_the_last_turn_gets_the_same_reply_and_no_second_trajectory() -> None:
    state, messages = three_turns()
    plan = plan_chat(FMT, state, messages[:-2], tools=None, digest="d")
    assert plan.repeat and plan.journal is state["turns"][2]


def test_a_context_overflow_says_how_many_tokens() -> None:
    state, messages = three_turns()
    with pytest.raises(ContextOverflow) as caught:
        plan_chat(FMT, state, [*messages[:-1], {"role": "tool", "content": "9" * 500}], tools=None, digest="d")
    assert caught.value.code == "context_length_exceeded" and caught.value.needed > 400


def test_completions_append_only_the_new_text() -> None:
    state = new_state("c", "p", max_context=400)
    plan = plan_completion(FMT, state, "1+1=", digest="d")
    out = tokenizer.encode("2")
    turn = {**turn_of(plan, out), "reply": {"text": "2"}}
    state = apply_turn(state, plan, turn)
    plan = plan_completion(FMT, state, "1+1=2, 2+2=", digest="d")
    assert FMT.decode(plan.new_ids) == ", 2+2=" and plan.context == FMT.encode("1+1=2, 2+2=")
    with pytest.raises(ChatError) as caught:
        plan_completion(FMT, state, "1+1=3", digest="d")
    assert caught.value.position == 4
    with pytest.raises(ChatError):
        plan_completion(FMT, state, {"not": "a prompt"}, digest="d")


class ForgetfulFormat(CharChat):
    """A template that drops earlier assistant replies once a new message follows (as templates that drop
    old "thinking" blocks do)."""

    def render(self, messages: Sequence[dict[str, Any]], *, tools: Any = None, add_generation_prompt: bool) -> str:
        kept = [m for i, m in enumerate(messages) if m["role"] != "assistant" or i == len(messages) - 1]
        return super().render(kept, add_generation_prompt=add_generation_prompt)


def test_a_template_that_re_renders_earlier_turns_is_detected_not_hidden() -> None:
    fmt = ForgetfulFormat()
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(ChatError) as caught:
        suffix(fmt, history, [{"role": "user", "content": "again"}], last_output=made(fmt, "yo"), tools=None)
    assert caught.value.code == "template_mismatch" and caught.value.position == len("user:hi|")


def test_the_tail_the_model_did_not_write_is_appended() -> None:
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    cut = tokenizer.encode("yo")  # cut at the length limit: no end of turn
    rendered = suffix(FMT, history, [{"role": "user", "content": "more"}], last_output=cut, tools=None)
    assert rendered.text == "<eos>user:more|assistant:"
    rendered = suffix(FMT, history, [{"role": "user", "content": "more"}], last_output=made(FMT, "yo"), tools=None)
    assert rendered.text == "user:more|assistant:"


def test_tool_calls_are_parsed_from_the_hermes_form() -> None:
    content, calls = parse_tool_calls('let me check <tool_call>{"name": "calc", "arguments": {"e": "2*3"}}</tool_call>')
    assert content == "let me check" and calls[0]["function"] == {"name": "calc", "arguments": '{"e": "2*3"}'}
    text = "<tool_call>not json</tool_call>"
    assert parse_tool_calls(text) == (text, [])


def test_messages_an_openai_client_echoes_compare_equal() -> None:
    echoed = {"role": "assistant", "content": "5", "refusal": None, "annotations": [], "audio": None,
              "function_call": None, "tool_calls": None}
    assert canonical(echoed, "m") == {"role": "assistant", "content": "5"}


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(message=json_values | st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "name",
                                                              "tool_call_id"]), json_values, max_size=5))
def test_any_message_is_either_canonical_or_a_clear_error(message: Any) -> None:
    try:
        out = canonical(message, "messages[0]")
    except ChatError as exc:
        assert exc.param and exc.param.startswith("messages[0]")
    else:
        assert out["role"] in ("system", "user", "assistant", "tool") and isinstance(out["content"], str)


def test_per_turn_samples_split_a_session_keeping_its_reward_and_group() -> None:
    from rollout_bus.executor.agents import TURN_STRIDE, TURNS_KEY, fill_sample, split_turns
    from rollout_bus.executor.sample import Sample

    state, _ = three_turns()
    state = {**state, "status": "closed", "reward": 0.5}
    sample = fill_sample(Sample(group_index=2, index=5, prompt="p", prompt_ids=[1]), state)
    sample.reward = 0.5
    sample.metadata[TURNS_KEY] = per_turn(state)
    whole = trajectory(state)
    parts = split_turns([sample])
    assert [p.index for p in parts] == [5 * TURN_STRIDE + k for k in range(3)]
    assert {p.group_index for p in parts} == {2} and {p.reward for p in parts} == {0.5}
    assert parts[-1].prompt_ids + parts[-1].response_ids == whole.prompt_ids + whole.response_ids
    assert all(set(p.loss_mask) == {1} for p in parts) and [p.metadata["turn"] for p in parts] == [0, 1, 2]
    assert "digest" not in parts[0].metadata and TURNS_KEY not in sample.metadata
