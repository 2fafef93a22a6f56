from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollout_bus.lm.kv_cache import KVCache
from rollout_bus.lm.model import (
    ModelConfig,
    TinyLM,
    build_model,
    check_state,
    generate,
    load_config,
    load_model,
    load_state,
    pad_batch,
    save_weights,
    token_logprobs,
    token_logprobs_and_entropy,
)
from rollout_bus.lm.tokenizer import VOCAB_SIZE, encode

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
TOL = {"cpu": 1e-5, "cuda": 1e-4}
SMALL = ModelConfig(d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32)
PROMPTS = [encode("12+30=", add_bos=True), encode("7*8", add_bos=True), encode("abc?(x)", add_bos=True)]


@pytest.fixture(scope="module")
def model() -> TinyLM:
    return build_model(SMALL, seed=3).eval()


def test_forward_gives_logits_per_position(model: TinyLM) -> None:
    ids, mask = pad_batch(PROMPTS)
    logits = model(ids, mask)
    assert logits.shape == (3, max(len(p) for p in PROMPTS), VOCAB_SIZE)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_give_the_same_logits_as_unpadded_rows(side: str, device: str) -> None:
    model = build_model(SMALL, seed=3, device=device).eval()
    ids, mask = pad_batch(PROMPTS, side=side, device=device)  # type: ignore[arg-type]
    with torch.no_grad():
        batched = model(ids, mask)
        for row, prompt in enumerate(PROMPTS):
            alone = model(torch.tensor([prompt], device=device))[0]
            real = mask[row].bool()
            torch.testing.assert_close(batched[row][real], alone, atol=TOL[device], rtol=TOL[device])


@pytest.mark.parametrize("device", DEVICES)
def test_kv_cache_decode_equals_full_forward(device: str) -> None:
    model = build_model(SMALL, seed=3, device=device).eval()
    full = [p + encode("42") for p in PROMPTS]
    with torch.no_grad():
        ids, mask = pad_batch([f[:-2] for f in full], device=device)
        _, cache = model.prefill(ids, mask)
        # regroup per row, then stack again: what the engine's scheduler does at every step
        cache = KVCache.stack(list(reversed(cache.split())))
        rows = list(reversed(full))
        step1, cache = model.decode_step(torch.tensor([r[-2] for r in rows], device=device), cache)
        step2, cache = model.decode_step(torch.tensor([r[-1] for r in rows], device=device), cache)
        for row, seq in enumerate(rows):
            reference = model(torch.tensor([seq], device=device))[0]
            torch.testing.assert_close(step1[row], reference[-2], atol=TOL[device], rtol=TOL[device])
            torch.testing.assert_close(step2[row], reference[-1], atol=TOL[device], rtol=TOL[device])
    assert [c.length for c in cache.split()] == [len(r) for r in rows]


def test_greedy_generate_follows_the_argmax_of_full_forwards(model: TinyLM) -> None:
    outputs = generate(model, PROMPTS, max_new_tokens=6, stop_at_eos=False)
    with torch.no_grad():
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            seq = list(prompt)
            for token in out:
                assert token == int(model(torch.tensor([seq]))[0, -1].argmax())
                seq.append(token)


def test_sequences_longer_than_max_seq_len_are_refused(model: TinyLM) -> None:
    with pytest.raises(ValueError, match="exceeds max_seq_len 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_token_logprobs_are_log_softmax_of_the_next_token(model: TinyLM) -> None:
    ids, mask = pad_batch(PROMPTS, side="right")
    logps = token_logprobs(model, ids, mask, temperature=0.5)
    assert logps.shape == (3, ids.shape[1] - 1)
    with torch.no_grad():
        seq = PROMPTS[1]
        logits = model(torch.tensor([seq]))[0]
        expected = torch.log_softmax(logits / 0.5, -1)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
    torch.testing.assert_close(logps[1, : len(seq) - 1], expected, atol=1e-5, rtol=1e-5)
    assert (logps[1, len(seq) - 1 :] == 0).all()
    logps.sum().backward()
    assert model.head.weight.grad is not None
    model.zero_grad()


def test_the_entropy_beside_the_log_probs_is_that_of_the_full_next_token_distribution(model: TinyLM) -> None:
    ids, mask = pad_batch(PROMPTS, side="right")
    with torch.no_grad():
        logps, entropy = token_logprobs_and_entropy(model, ids, mask)
        assert torch.equal(logps, token_logprobs(model, ids, mask))  # bit for bit: training numbers are unchanged
        seq = PROMPTS[2]
        probs = torch.softmax(model(torch.tensor([seq]))[0, :-1], -1)
        expected = -(probs * probs.log()).sum(-1)
    torch.testing.assert_close(entropy[2, : len(seq) - 1], expected, atol=1e-5, rtol=1e-5)
    assert (entropy[0, len(PROMPTS[0]) - 1 :] == 0).all()
    assert float(entropy.max()) <= float(torch.log(torch.tensor(float(VOCAB_SIZE)))) + 1e-5


def test_build_model_is_deterministic_per_seed() -> None:
    a, b, c = build_model(SMALL, 1).state_dict(), build_model(SMALL, 1).state_dict(), build_model(SMALL, 2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tok_emb.weight"], c["tok_emb.weight"])


def test_save_and_load_round_trip_bit_exactly(model: TinyLM, tmp_path: Path) -> None:
    weights = save_weights(model, tmp_path / "w")
    assert weights == tmp_path / "w" / "model.safetensors"
    assert json.loads((tmp_path / "w" / "config.json").read_text()) == SMALL.to_dict()
    assert load_config(tmp_path / "w") == SMALL
    state = load_state(tmp_path / "w")
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    loaded = load_model(weights)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_save_to_a_named_file_puts_the_config_beside_it(model: TinyLM, tmp_path: Path) -> None:
    weights = save_weights(model, tmp_path / "step7.safetensors")
    assert weights.is_file() and (tmp_path / "config.json").is_file()
    assert load_config(weights) == SMALL
    assert not list(tmp_path.glob("*.tmp"))


def test_check_state_names_missing_unexpected_and_misshaped_keys(model: TinyLM) -> None:
    state = dict(model.state_dict())
    del state["head.weight"]
    state["extra.bias"] = torch.zeros(3)
    state["pos_emb.weight"] = torch.zeros(10, 32)
    with pytest.raises(ValueError) as err:
        check_state(model, state)
    message = str(err.value)
    assert "missing keys ['head.weight']" in message
    assert "unexpected keys ['extra.bias']" in message
    assert "pos_emb.weight: shape (10, 32), expected (32, 32)" in message


def test_check_state_rejects_non_finite_values(model: TinyLM) -> None:
    state = dict(model.state_dict())
    state["ln_f.bias"] = torch.full((32,), float("nan"))
    with pytest.raises(ValueError, match="ln_f.bias: contains NaN"):
        check_state(model, state)
    check_state(model, model.state_dict())


def test_config_round_trips_and_rejects_bad_values() -> None:
    assert ModelConfig.from_dict(SMALL.to_dict()) == SMALL
    assert ModelConfig().vocab_size == VOCAB_SIZE
    with pytest.raises(ValueError, match="unknown ModelConfig keys \\['width'\\]"):
        ModelConfig.from_dict({"width": 3})
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=30, n_heads=4)
