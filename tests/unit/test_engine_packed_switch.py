"""``--no-packed``: the engine's switch back to plain ``F.linear`` (no oneDNN packed weights, no fused
decode projections). Both paths, real torch and transformers on a random Llama wide enough for every
linear layer to be packed, decode a batch of prompts of different lengths to the same greedy tokens
(those of ``model.generate`` on each prompt alone) and the same log-probs to float32 rounding."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_bus.engine import hf_packed
from rollout_bus.engine.args import parse_args
from rollout_bus.engine.protocol import SamplingParams, SequenceSpec
from rollout_bus.engine.runtime import Engine
from rollout_bus.engine.sequence import Seq
from rollout_bus.lm import hf
from tests.support.models import llama_dir

pytestmark = pytest.mark.skipif(not hf_packed.available(), reason="this torch has no oneDNN")

WIDE = {"hidden_size": 512, "heads": 8, "kv_heads": 4, "layers": 2}
"""Every linear layer at least ``MIN_PACKED_ELEMENTS`` (k and v: 256 x 512)."""
PROMPTS = [[1, 40, 41, 42], [1, *range(60, 75)], [1, 90], [1, *range(100, 109)]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama_dir(tmp_path_factory.mktemp("packed") / "m", seed=0, **WIDE)


def engine(path: Path, *flags: str) -> Iterator[Engine]:
    started = Engine(parse_args(["--model-path", str(path), "--skip-tokenizer-init", "--torch-threads", "1", *flags]))
    started.start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def packed(model_dir: Path) -> Iterator[Engine]:
    yield from engine(model_dir)


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> Iterator[Engine]:
    yield from engine(model_dir, "--no-packed")


def submit(engine: Engine, prompts: list[list[int]], tokens: int, tag: str) -> tuple[list[Seq], threading.Event]:
    """Every prompt submitted at once (one batch), greedy; the sequences and an event set when all finished."""
    done = threading.Event()
    left = [len(prompts)]
    lock = threading.Lock()

    def sink(progress: Any) -> None:
        if progress.finish is not None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    params = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
    seqs = [Seq(SequenceSpec(rid=f"{tag}-{i}", input_ids=tuple(p), params=params, lora=None, seed=0,
                             return_logprob=True, return_text_in_logprobs=False), sink) for i, p in enumerate(prompts)]
    engine.scheduler.submit(seqs).result(timeout=60)
    return seqs, done


def decode(engine: Engine, prompts: list[list[int]], tokens: int, tag: str) -> list[tuple[list[int], list[float]]]:
    """Each prompt's output ids and log-probs."""
    seqs, done = submit(engine, prompts, tokens, tag)
    assert done.wait(60)
    return [(list(s.output_ids), list(s.logprobs)) for s in seqs]


def greedy(model: Any, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
    return list(out[0, len(ids):].tolist())


def test_the_flag_reaches_the_model(packed: Engine, plain: Engine) -> None:
    assert packed.args.no_packed is False and plain.args.no_packed is True
    assert packed.model.packed and hf_packed.packed_bytes(packed.model.base) > 0
    assert not plain.model.packed
    assert hf_packed.packed_bytes(plain.model.base) == 0
    assert not any(isinstance(m, hf_packed.PackedLinear) for m in plain.model.base.modules())


def test_both_paths_decode_the_same_greedy_tokens(packed: Engine, plain: Engine, model_dir: Path) -> None:
    fast, slow = decode(packed, PROMPTS, NEW_TOKENS, "same"), decode(plain, PROMPTS, NEW_TOKENS, "same")
    reference = hf.load_model(model_dir)
    for prompt, (fast_ids, fast_lp), (slow_ids, slow_lp) in zip(PROMPTS, fast, slow, strict=True):
        assert fast_ids == slow_ids == greedy(reference, prompt, NEW_TOKENS)
        assert fast_lp == pytest.approx(slow_lp, abs=1e-4)  # float32 rounding apart (another summation order)


def test_rows_joining_a_running_batch_decode_the_same_tokens_on_both_paths(packed: Engine, plain: Engine) -> None:
    """A second wave submitted while the first decodes: its prefill is merged into the running batch."""
    def waves(served: Engine) -> list[list[int]]:
        first, first_done = submit(served, PROMPTS[:2], 3 * NEW_TOKENS, "first")
        while len(first[0].output_ids) < 3 and not first_done.is_set():
            first_done.wait(0.001)
        assert not first_done.is_set()  # the second wave joins a batch that is still decoding
        late = decode(served, PROMPTS[2:], NEW_TOKENS, "late")
        assert first_done.wait(60)
        return [list(s.output_ids) for s in first] + [ids for ids, _ in late]

    assert waves(packed) == waves(plain)
