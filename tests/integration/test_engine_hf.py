"""The CPU engine on a Hugging Face model over real HTTP: a small random Llama (built here, sharded,
with an offline byte-level tokenizer), checked against the same model run by transformers and peft
in this process: greedy tokens, log-probs, stops, n x batch, streaming, aborts, every pause mode, a
sharded weight update under load, memory release, two LoRA adapters side by side, and bad input."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_bus.lm import hf
from rollout_bus.lm.files import INDEX_FILE
from tests.engine_proc import EngineProcess, wait_until
from tests.support.models import llama_adapter, llama_dir

pytestmark = pytest.mark.integration

DELAY_MS = 20
LONG = 30


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    base = llama_dir(root / "base", seed=0, shards=True)
    other = llama_dir(root / "other", seed=1, shards=True)
    wide = llama_dir(root / "wide", seed=2, hidden_size=32, heads=2, kv_heads=1)
    return {"base": base, "other": other, "wide": wide,
            "lora_a": llama_adapter(base, root / "lora_a", seed=1), "lora_b": llama_adapter(base, root / "lora_b", seed=2),
            "lora_wide": llama_adapter(wide, root / "lora_wide", seed=3)}


@pytest.fixture(scope="module")
def engine(dirs: dict[str, Path]) -> Iterator[EngineProcess]:
    with EngineProcess(dirs["base"], weight_version="0", token_delay_ms=DELAY_MS, extra_args=["--enable-lora"],
                       startup_timeout_s=120) as proc:
        yield proc


@pytest.fixture(scope="module")
def model(dirs: dict[str, Path]) -> Any:
    return hf.load_model(dirs["base"])


@pytest.fixture(scope="module")
def tokenizer(dirs: dict[str, Path]) -> Any:
    return hf.load_tokenizer(dirs["base"])


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


@pytest.fixture()
def base(engine: EngineProcess, dirs: dict[str, Path]) -> None:
    """The seed-0 weights at version "0"."""
    status, reply = engine.post("/update_weights_from_disk", {"model_path": str(dirs["base"]), "weight_version": "0"})
    assert status == 200, reply


def gen(engine: EngineProcess, expect: int = 200, timeout_s: float = 60, **body: Any) -> Any:
    status, reply = engine.post("/generate", body, timeout_s=timeout_s)
    assert status == expect, reply
    return reply


def greedy(model: Any, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
    return list(out[0, len(ids):].tolist())


def logprobs(model: Any, prompt: list[int], output: list[int], temperature: float = 1.0, **kw: Any) -> list[float]:
    """What a trainer computes: one forward over prompt + output, ``log_softmax(logits / T)`` at the outputs."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output]), **kw).logits[0].float()
    picked = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1:-1].gather(1, torch.tensor(output)[:, None])
    return list(picked[:, 0].tolist())


def in_background(pool: ThreadPoolExecutor, engine: EngineProcess, **body: Any) -> Future[Any]:
    body.setdefault("sampling_params", {"temperature": 0, "max_new_tokens": LONG, "ignore_eos": True})
    body.setdefault("input_ids", [1, 20, 21])
    return pool.submit(gen, engine, **body)


def running(engine: EngineProcess, count: int) -> None:
    wait_until(f"{count} running", lambda: engine.state()["running"] == count)


def test_text_and_token_ids_give_the_models_own_greedy_tokens(engine: EngineProcess, model: Any, tokenizer: Any) -> None:
    ids = tokenizer("What is 2+2?")["input_ids"]
    by_text = gen(engine, text="What is 2+2?", sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    by_ids = gen(engine, input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    assert by_text["output_ids"] == by_ids["output_ids"] == greedy(model, ids, 12)
    assert by_text["text"] == tokenizer.decode(by_text["output_ids"], skip_special_tokens=True)
    assert by_text["meta_info"]["prompt_tokens"] == len(ids)


def test_concurrent_prompts_of_different_lengths_decode_together_as_each_would_alone(
        engine: EngineProcess, model: Any, tokenizer: Any, pool: ThreadPoolExecutor) -> None:
    prompts = ["a", "the quick brown fox", "12+34=", "hello there, how are you?"]
    steps = engine.state()["steps"]
    futures = [pool.submit(gen, engine, text=p, sampling_params={"temperature": 0, "max_new_tokens": 10, "ignore_eos": True})
               for p in prompts]
    replies = [f.result(60) for f in futures]
    for prompt, reply in zip(prompts, replies, strict=True):
        assert reply["output_ids"] == greedy(model, tokenizer(prompt)["input_ids"], 10)
    assert engine.state()["steps"] - steps < 4 * 10  # decoded together, not one after the other


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_what_a_trainer_recomputes_under_the_sampling_temperature(
        engine: EngineProcess, model: Any, temperature: float) -> None:
    prompt = [1, 40, 41, 42]
    reply = gen(engine, input_ids=prompt, return_logprob=True,
                sampling_params={"temperature": temperature, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 3})
    entries = reply["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == reply["output_ids"]
    expected = logprobs(model, prompt, reply["output_ids"], temperature)
    assert [e[0] for e in entries] == pytest.approx(expected, abs=1e-4)


def test_a_batch_with_n_samples_comes_back_prompt_major(engine: EngineProcess) -> None:
    replies = gen(engine, input_ids=[[1, 40, 41], [1, 50]], rid="bn",
                  sampling_params={"max_new_tokens": 4, "n": 2, "ignore_eos": True})
    assert [r["meta_info"]["id"] for r in replies] == ["bn_0_0", "bn_0_1", "bn_1_0", "bn_1_1"]
    assert [r["meta_info"]["prompt_tokens"] for r in replies] == [3, 3, 2, 2]


def test_stop_strings_stop_token_ids_and_eos(engine: EngineProcess, model: Any, tokenizer: Any) -> None:
    free = gen(engine, input_ids=[1, 60, 61], sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    ids = free["output_ids"]
    by_id = gen(engine, input_ids=[1, 60, 61], sampling_params={"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [ids[4]]})
    assert by_id["output_ids"] == ids[:ids.index(ids[4]) + 1]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[4]}
    stop = tokenizer.decode(ids[5:7])
    by_text = gen(engine, input_ids=[1, 60, 61], sampling_params={"temperature": 0, "max_new_tokens": 12, "stop": [stop]})
    assert by_text["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert tokenizer.decode(by_text["output_ids"]).endswith(stop) and not by_text["text"].endswith(stop)
    # a prompt whose greedy next token is EOS (<|im_end|>, id 2): found by one batched forward
    candidates = torch.randint(3, 259, (4096, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        last = model(input_ids=candidates).logits[:, -1].argmax(-1)
    hits = (last == 2).nonzero()
    assert hits.numel(), "no prompt among 4096 ends in EOS"
    prompt = candidates[int(hits[0, 0])].tolist()
    eos = gen(engine, input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 6})
    assert eos["output_ids"] == [2] and eos["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert eos["text"] == ""
    ignored = gen(engine, input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    assert len(ignored["output_ids"]) == 6 and ignored["output_ids"][0] == 2


def test_streaming_sends_cumulative_chunks(engine: EngineProcess) -> None:
    body = {"input_ids": [1, 70, 71], "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
            "stream": True}
    request = urllib.request.Request(engine.url + "/generate", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        lines = [line.decode().strip() for line in response if line.strip()]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_abort_by_rid_and_every_pause_mode_with_requests_in_flight(engine: EngineProcess, pool: ThreadPoolExecutor) -> None:
    victim, bystander = in_background(pool, engine, rid="victim"), in_background(pool, engine, rid="bystander")
    running(engine, 2)
    assert engine.post("/abort_request", {"rid": "victim"}) == (200, None)
    assert victim.result(30)["meta_info"]["finish_reason"]["type"] == "abort"
    assert bystander.result(30)["meta_info"]["finish_reason"]["type"] == "length"
    for mode in ("abort", "retract", "in_place"):
        pending = in_background(pool, engine)
        running(engine, 1)
        time.sleep(0.1)
        try:
            assert engine.post("/pause_generation", {"mode": mode})[0] == 200
            assert engine.get("/ready")[0] == 503
            if mode == "retract":
                wait_until("requeued", lambda: (engine.state()["running"], engine.state()["queued"]) == (0, 1))
                assert engine.state()["kv_cache_bytes"] == 0
            if mode == "in_place":
                steps = engine.state()["steps"]
                time.sleep(4 * DELAY_MS / 1000)
                assert engine.state()["steps"] == steps and engine.state()["kv_cache_bytes"] > 0
        finally:
            assert engine.post("/continue_generation", {})[0] == 200
        out = pending.result(30)
        if mode == "abort":
            assert out["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(out["output_ids"]) < LONG
        else:
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}
            assert out["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)


def test_a_sharded_weight_update_under_load_loses_no_request_and_serves_the_new_model(
        engine: EngineProcess, dirs: dict[str, Path], pool: ThreadPoolExecutor, base: None) -> None:
    assert len(list(dirs["other"].glob("model-*-of-*.safetensors"))) >= 4
    pending = [in_background(pool, engine, input_ids=[1, 80 + i, 81]) for i in range(6)]
    running(engine, 6)
    time.sleep(0.1)
    assert engine.post("/pause_generation", {"mode": "retract"})[0] == 200
    try:
        status, reply = engine.post("/update_weights_from_disk", {"model_path": str(dirs["other"]), "weight_version": "1"})
        assert status == 200 and reply["num_paused_requests"] == 6, reply
    finally:
        assert engine.post("/continue_generation", {})[0] == 200
    replies = [p.result(60) for p in pending]
    assert all(r["meta_info"]["finish_reason"] == {"type": "length", "length": LONG} for r in replies)
    assert all([s["version"] for s in r["meta_info"]["weight_versions"]] == ["0", "1"] for r in replies)
    other = hf.load_model(dirs["other"])
    after = gen(engine, input_ids=[1, 90, 91], return_logprob=True, sampling_params={"max_new_tokens": 8, "ignore_eos": True})
    assert after["meta_info"]["weight_version"] == "1"
    expected = logprobs(other, [1, 90, 91], after["output_ids"])
    assert [e[0] for e in after["meta_info"]["output_token_logprobs"]] == pytest.approx(expected, abs=1e-4)


def test_released_memory_is_restored_bit_exactly(engine: EngineProcess, pool: ThreadPoolExecutor, base: None) -> None:
    params = {"temperature": 0.8, "max_new_tokens": 10, "ignore_eos": True, "sampling_seed": 9}
    before = gen(engine, input_ids=[1, 100], sampling_params=params, return_logprob=True)
    assert engine.post("/release_memory_occupation", {"tags": ["weights", "kv_cache"]}) == (200, None)
    try:
        assert engine.state()["weight_bytes"] == 0 and engine.get("/health_generate")[0] == 503
        waiting = pool.submit(gen, engine, input_ids=[1, 100], sampling_params=params, return_logprob=True)
        wait_until("queued", lambda: engine.state()["queued"] == 1)
    finally:
        assert engine.post("/resume_memory_occupation", {"tags": ["weights", "kv_cache"]}) == (200, None)
    for after in (waiting.result(30), gen(engine, input_ids=[1, 100], sampling_params=params, return_logprob=True)):
        assert after["output_ids"] == before["output_ids"]
        assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]


def test_two_adapters_side_by_side_match_a_direct_peft_forward_and_differ_from_the_base(
        engine: EngineProcess, dirs: dict[str, Path], model: Any, base: None) -> None:
    from peft import PeftModel

    for name in ("a", "b"):
        status, reply = engine.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(dirs[f"lora_{name}"])})
        assert status == 200, reply
    try:
        prompt = [1, 33, 34, 35]
        params = {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 5}
        replies = gen(engine, input_ids=[prompt] * 3, lora_path=["a", None, "b"], return_logprob=True, sampling_params=params)
        direct = PeftModel.from_pretrained(hf.load_model(dirs["base"]), str(dirs["lora_a"]), adapter_name="a")
        direct.load_adapter(str(dirs["lora_b"]), adapter_name="b")
        direct.eval()
        for reply, name in zip(replies, ["a", None, "b"], strict=True):
            output = reply["output_ids"]
            names = [name or "__base__"]
            expected = logprobs(direct, prompt, output, adapter_names=names) if name else logprobs(model, prompt, output)
            assert [e[0] for e in reply["meta_info"]["output_token_logprobs"]] == pytest.approx(expected, abs=1e-4)
        greedy_rows = gen(engine, input_ids=[prompt] * 3, lora_path=["a", None, "b"],
                          sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
        assert len({tuple(r["output_ids"]) for r in greedy_rows}) == 3
        assert greedy_rows[1]["output_ids"] == greedy(model, prompt, 8)
    finally:
        for name in ("a", "b"):
            engine.post("/unload_lora_adapter", {"lora_name": name})
    assert engine.state()["adapters"] == []


def test_bad_input_is_a_clear_400_and_the_engine_keeps_serving_the_previous_version(
        engine: EngineProcess, dirs: dict[str, Path], model: Any, tmp_path: Path, base: None) -> None:
    before = gen(engine, input_ids=[1, 110], sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    missing = shutil.copytree(dirs["other"], tmp_path / "missing")
    shard = json.loads((missing / INDEX_FILE).read_text())["weight_map"]["model.norm.weight"]
    (missing / shard).unlink()
    nan = shutil.copytree(dirs["other"], tmp_path / "nan")
    poisoned = hf.load_model(dirs["other"])
    with torch.no_grad():
        poisoned.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    poisoned.save_pretrained(str(nan), safe_serialization=True, max_shard_size="60KB")
    cases = [
        ("/update_weights_from_disk", {"model_path": str(missing), "weight_version": "x"}, f"missing shard {shard}"),
        ("/update_weights_from_disk", {"model_path": str(nan), "weight_version": "x"}, "model.layers.0.mlp.up_proj.weight: contains NaN"),
        ("/update_weights_from_disk", {"model_path": str(dirs["wide"]), "weight_version": "x"}, "differs from the served model's"),
        ("/load_lora_adapter", {"lora_name": "w", "lora_path": str(dirs["lora_wide"])}, "does not fit the base model"),
    ]
    for path, body, fragment in cases:
        status, reply = engine.post(path, body)
        message = reply.get("message") or reply.get("error_message")
        assert status == 400 and fragment in message, (path, reply)
    assert engine.get("/model_info")[1]["weight_version"] == "0" and engine.state()["adapters"] == []
    after = gen(engine, input_ids=[1, 110], sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    assert after["output_ids"] == before["output_ids"] == greedy(model, [1, 110], 6)
