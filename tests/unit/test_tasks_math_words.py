"""The word-problem task: deterministic problems, disjoint splits, right answers, chat-rendered prompts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rollout_bus.lm.hf_tokenizer import ChatTokenizer, TokenizerError
from rollout_bus.tasks.math_words import INSTRUCTIONS, SPLITS, MathWordsSource, problem, split_of
from tests.support.tiny_hf import tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("tok") / "tiny", with_model=False)


def solve(text: str) -> int:
    """An independent reading of a problem: each sentence pattern applied in order."""
    value: int | None = None
    for sentence in re.split(r"(?<=[.?])\s+", text):
        if m := re.fullmatch(r"\w+ buys (\d+) \w+ with (\d+) .+ in each \w+\.", sentence):
            value = int(m[1]) * int(m[2])
        elif m := re.fullmatch(r"\w+ has (\d+) .+\.", sentence):
            value = int(m[1])
        elif m := re.fullmatch(r"Then \w+ gets (\d+) more .+\.", sentence):
            value = _known(value) + int(m[1])
        elif m := re.fullmatch(r"\w+ gives (\d+) .+ to \w+\.", sentence):
            value = _known(value) - int(m[1])
        elif m := re.fullmatch(r"Then \w+ (doubles|triples) the amount of .+\.", sentence):
            value = _known(value) * (2 if m[1] == "doubles" else 3)
        elif m := re.fullmatch(r"\w+ shares the .+ equally with (a friend|\d+ friends) and keeps one share\.", sentence):
            k = 2 if m[1] == "a friend" else int(m[1].split()[0]) + 1
            assert _known(value) % k == 0, text
            value = _known(value) // k
        else:
            assert re.fullmatch(r"How many .+ does \w+ have now\?", sentence), sentence
    return _known(value)


def _known(value: int | None) -> int:
    assert value is not None
    return value


def test_problems_are_a_pure_function_of_split_seed_index_and_options() -> None:
    assert problem("train", 7) == problem("train", 7)
    assert problem("train", 7) != problem("train", 8)
    assert problem("train", 7, seed=1) != problem("train", 7)
    assert problem("train", 7, max_number=50) != problem("train", 7)
    with pytest.raises(ValueError, match="split must be one of"):
        problem("test", 0)


def test_every_answer_is_what_the_text_says_and_a_positive_integer() -> None:
    for split in SPLITS:
        for index in range(300):
            p = problem(split, index, seed=3, min_steps=1, max_steps=4)
            assert p.answer > 0 and solve(p.text) == p.answer, p.text
            assert p.text.count(".") == p.steps and 1 <= p.steps <= 4


def test_train_and_eval_never_share_a_problem_whatever_the_seeds() -> None:
    train = {problem("train", i, seed=s).text for s in (0, 1) for i in range(1500)}
    evals = {problem("eval", i, seed=s).text for s in (0, 1) for i in range(400)}
    assert not train & evals
    assert {split_of(t) for t in train} == {"train"} and {split_of(t) for t in evals} == {"eval"}
    assert len(evals) > 350, "eval problems should rarely repeat"


def test_the_source_renders_prompts_through_the_models_chat_template(model_dir: Path) -> None:
    source = MathWordsSource(str(model_dir), split="eval", seed=2, answer_format="hashes", format_credit=0.1)
    item = source.get_samples(1)[0]
    p = problem("eval", 0, seed=2)
    tok = ChatTokenizer(model_dir)
    expected = tok.hf.apply_chat_template(
        [{"role": "user", "content": f"{p.text}\n{INSTRUCTIONS['hashes']}"}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert item["prompt_ids"] == list(expected)
    assert item["prompt"].startswith("<|im_start|>user\n" + p.text) and item["prompt"].endswith("<|im_start|>assistant\n")
    assert tok.hf.decode(item["prompt_ids"]) == item["prompt"]
    assert item["label"] == str(p.answer)
    assert item["metadata"] == {"task": "math_words", "tokenizer": str(model_dir), "steps": p.steps,
                                "answer_format": "hashes", "format_credit": 0.1, "unformatted_credit": 0.0}


def test_a_system_prompt_goes_into_the_template(model_dir: Path) -> None:
    item = MathWordsSource(str(model_dir), system_prompt="Be brief.").item(0)
    assert item["prompt"].startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_the_source_saves_and_restores_its_position_and_requeued_items(model_dir: Path) -> None:
    source = MathWordsSource(str(model_dir), seed=1)
    first = source.get_samples(3)
    assert [it["index"] for it in first] == [0, 1, 2]
    source.add_samples([first[1]])
    state = source.save()
    again = MathWordsSource(str(model_dir), seed=1)
    again.load(state)
    assert [it["index"] for it in again.get_samples(2)] == [1, 3]
    assert again.item(3) == source.item(3)


def test_a_sized_source_visits_the_same_problems_every_epoch(model_dir: Path) -> None:
    source = MathWordsSource(str(model_dir), split="eval", size=3)
    items = source.get_samples(7)
    assert [it["label"] for it in items[3:6]] == [it["label"] for it in items[:3]]
    assert items[0]["prompt_ids"] == items[3]["prompt_ids"] and items[6]["index"] == 6
    assert source.name != MathWordsSource(str(model_dir), split="train", size=3).name


@pytest.mark.parametrize(("options", "message"), [
    ({"split": "test"}, "split must be one of"),
    ({"min_steps": 3, "max_steps": 2}, "min_steps <= max_steps"),
    ({"answer_format": "latex"}, "answer_format must be one of"),
    ({"format_credit": 2}, "format_credit must be a number in"),
    ({"size": 0}, "size must be a positive integer"),
])
def test_bad_options_are_refused_with_what_to_fix(model_dir: Path, options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MathWordsSource(str(model_dir), **options)  # type: ignore[arg-type]


def test_a_model_directory_without_a_tokenizer_or_chat_template_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="has no tokenizer"):
        MathWordsSource(str(tmp_path / "empty"))
    with pytest.raises(TokenizerError, match="does not exist"):
        ChatTokenizer(tmp_path / "missing")
    plain = tiny_model_dir(tmp_path / "plain", chat_template=None, with_model=False)
    with pytest.raises(TokenizerError, match="has no chat template"):
        ChatTokenizer(plain)
