"""Bad input to a Hugging Face model run gets a clear error before any process starts: a model directory
without a tokenizer, prompts that do not fit in the model's context. (A GGUF file that does not convert:
tests/unit/test_lm_prepare.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_bus.launch.config import MODEL_TASK, RunConfig, RunFailed
from rollout_bus.launch.job import check_context, resolve_model, task_options
from rollout_bus.lm import hf
from rollout_bus.trainer.config import ConfigError
from rollout_bus.trainer.service import _tokenizer_of

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def test_a_model_directory_without_a_tokenizer_is_refused_by_the_job_and_the_trainer(tmp_path: Path) -> None:
    model = hf.write_random_llama(tmp_path / "m", seed=0)
    assert resolve_model(str(model)) == model.resolve()
    for name in TOKENIZER_FILES:
        (model / name).unlink()
    with pytest.raises(RunFailed, match=r"has no tokenizer .*tokenizer\.save_pretrained"):
        resolve_model(str(model))
    with pytest.raises(ConfigError, match="has no usable tokenizer"):
        _tokenizer_of(str(model))


def test_a_directory_that_is_no_model_is_named_as_such(tmp_path: Path) -> None:
    with pytest.raises(RunFailed, match="neither a known model .*smollm2.* nor a Hugging Face model directory"):
        resolve_model(str(tmp_path))


def test_prompts_longer_than_the_context_are_refused_with_what_to_change(tmp_path: Path) -> None:
    model = hf.write_random_llama(tmp_path / "m", seed=0, max_positions=320)
    task = task_options(RunConfig(model=str(model)), model)
    assert task == {**MODEL_TASK, "tokenizer": str(model), "seed": 0}
    longest = check_context(model, task, 8)  # byte tokens: the prompts are 150-300 long
    assert 100 < longest < 320 - 8
    with pytest.raises(RunFailed, match=rf"up to {longest} tokens and --max-new-tokens is 200: .* context of m "
                                        r"\(320 tokens.*lower --max-new-tokens"):
        check_context(model, task, 200)
