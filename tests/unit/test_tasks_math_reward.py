"""The math reward: math-verify's verdict, partial credit for form, bounded time, any thread."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rollout_bus.executor.errors import PluginError
from rollout_bus.executor.plugins import PluginConfig, Plugins
from rollout_bus.executor.sample import Sample
from rollout_bus.lm.hf_tokenizer import ChatTokenizer
from rollout_bus.tasks.math_reward import Verifier, formatted_answer, reward, score_text, verify_here
from rollout_bus.tasks.math_words import MathWordsSource
from tests.support.tiny_hf import tiny_model_dir


@pytest.fixture(scope="module")
def verifier() -> Iterator[Verifier]:
    v = Verifier(timeout_s=20.0)
    yield v
    v.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("tok") / "tiny", with_model=False)


CREDIT = {"format_credit": 0.1, "unformatted_credit": 0.5}


@pytest.mark.parametrize(("text", "answer_format", "reward_", "correct", "formatted"), [
    ("12 + 3 = 15, so the answer is \\boxed{15}.", "boxed", 1.0, True, True),
    ("\\boxed{15 \\text{ apples}}", "boxed", 1.0, True, True),
    ("\\boxed{\\frac{30}{2}}", "boxed", 1.0, True, True),
    ("\\boxed{15.0}", "boxed", 1.0, True, True),
    ("I think \\boxed{14}", "boxed", 0.1, False, True),
    ("\\boxed{14} no wait \\boxed{15}", "boxed", 1.0, True, True),
    ("The answer is 15.", "boxed", 0.5, True, False),
    ("#### 15", "boxed", 0.5, True, False),
    ("The answer is 14.", "boxed", 0.0, False, False),
    ("fifteen", "boxed", 0.0, False, False),
    ("", "boxed", 0.0, False, False),
    ("\\boxed{}", "boxed", 0.0, False, False),
    ("She has 10 + 5 = 15.\n#### 15", "hashes", 1.0, True, True),
    ("#### 15 apples", "hashes", 0.5, True, False),
    ("#### 15.", "hashes", 1.0, True, True),
    ("#### $15", "hashes", 1.0, True, True),
    ("#### N", "hashes", 0.0, False, False),
    ("Answer with only the final number, as '#### N'.\n#### N", "hashes", 0.0, False, False),
    ("#### 2 * 4 = 8 * 2 = 16 * 2 =", "hashes", 0.0, False, False),
    ("#### 15\nRemember to write '#### N'.", "hashes", 0.5, True, False),
    ("#### 14\n", "hashes", 0.1, False, True),
    ("#### 16", "hashes", 0.1, False, True),
    ("\\boxed{15}", "hashes", 0.5, True, False),
])
def test_answers_score_by_value_and_form(verifier: Verifier, text: str, answer_format: str, reward_: float,
                                         correct: bool, formatted: bool) -> None:
    score = score_text(text, "15", answer_format=answer_format, verifier=verifier, **CREDIT)
    assert (score.reward, score.correct, score.formatted) == (reward_, correct, formatted)


def test_without_partial_credit_only_a_right_answer_in_form_scores(verifier: Verifier) -> None:
    assert score_text("\\boxed{15}", "15", verifier=verifier).reward == 1.0
    assert score_text("\\boxed{14}", "15", verifier=verifier).reward == 0.0
    assert score_text("The answer is 15", "15", verifier=verifier).reward == 0.0


def test_the_requested_form_is_found_with_nested_braces_and_on_the_last_line() -> None:
    assert formatted_answer("x \\boxed{\\frac{1}{2}} y", "boxed") == "\\frac{1}{2}"
    assert formatted_answer("\\boxed{1} then \\boxed{2", "boxed") == "1"
    assert formatted_answer("#### 3\nmore\n#### 4 ", "hashes") == "4"
    assert formatted_answer("#### 4\nmore", "hashes") is None
    assert formatted_answer("#### 1,250\n\n", "hashes") == "1250"
    assert formatted_answer("#### N", "hashes") is None
    assert formatted_answer("no answer", "hashes") is None
    with pytest.raises(ValueError, match="answer_format"):
        formatted_answer("x", "latex")


def test_math_verify_runs_off_the_main_thread_without_its_signal_alarms() -> None:
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(verify_here, ["15", "15", "15"], ["\\boxed{15}", "$14$", "15 apples"]))
    assert results == [True, False, True]


def test_a_check_that_runs_over_its_time_counts_as_wrong_and_the_next_one_works() -> None:
    v = Verifier(timeout_s=1.0)
    try:
        assert v.check("15", "\\boxed{15}") is True
        assert v.check("15", "\\boxed{9^{9^{9^{9}}}}") is False
        assert v.timeouts == 1, "the tower of powers should have run over the time limit"
        assert v.check("15", "\\boxed{15}") is True
        assert v.starts == 2 and v.timeouts == 1
    finally:
        v.close()


def test_the_reward_plugin_reads_the_response_with_the_items_tokenizer_up_to_eos(model_dir: Path) -> None:
    item = MathWordsSource(str(model_dir), format_credit=0.25).item(0)
    tok = ChatTokenizer(model_dir)

    def sample(text: str) -> Sample:
        s = Sample(group_index=0, index=0, prompt=item["prompt"], prompt_ids=item["prompt_ids"],
                   label=item["label"], metadata=dict(item["metadata"]))
        s.response_ids = tok.encode_plain(text) + [tok.eos_token_id or 0] + tok.encode_plain("\\boxed{999}")
        return s

    right, wrong = sample(f"So \\boxed{{{item['label']}}}"), sample("\\boxed{999}")
    assert asyncio.run(reward(right)) == 1.0 and right.metadata["correct"] is True
    assert asyncio.run(reward(wrong)) == 0.25 and wrong.metadata["formatted"] is True
    lost = sample("x")
    lost.metadata.pop("tokenizer")
    with pytest.raises(ValueError, match="no 'tokenizer' in its metadata"):
        asyncio.run(reward(lost))


def test_the_task_plugs_into_an_executor_with_the_chat_tokenizer(model_dir: Path) -> None:
    plugins = Plugins(PluginConfig(
        data_source_path="rollout_bus.tasks.math_words.MathWordsSource",
        data_source_args={"tokenizer": str(model_dir)}, reward_path="rollout_bus.tasks.math_reward.reward",
        tokenizer_path="rollout_bus.lm.hf_tokenizer.ChatTokenizer", tokenizer_args={"path": str(model_dir)}))
    train, evals = plugins.data_source({}), plugins.data_source({"split": "eval", "size": 8})
    assert train.name != evals.name
    text = "What is 2+3?"
    ids = plugins.tokenizer.encode(text)
    assert ChatTokenizer(model_dir).hf.decode(ids) == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert plugins.tokenizer.decode(ChatTokenizer(model_dir).encode_plain("5<|im_end|>junk")) == "5"
    with pytest.raises(PluginError, match="rejected options"):
        Plugins(PluginConfig(tokenizer_path="rollout_bus.lm.hf_tokenizer.ChatTokenizer",
                             tokenizer_args={"path": str(model_dir / "nope")}))
    with pytest.raises(PluginError, match="with tokenizer args it must be a class or function"):
        Plugins(PluginConfig(tokenizer_path="rollout_bus.tasks.math_words.SPLITS", tokenizer_args={"x": 1}))
