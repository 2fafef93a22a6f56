"""The CPU engine on the tiny LM over real HTTP: reply shapes, real generation, log-probs, stops, LoRA
adapters, and SGLang's HTTP rules (unknown top-level keys ignored, unknown sampling keys and wrong types 400)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_bus.lm.model import TinyLM, build_model, generate, load_model, save_weights, token_logprobs
from rollout_bus.lm.tokenizer import EOS_ID, VOCAB_SIZE, decode, encode
from tests.engine_proc import EngineProcess, call, make_weights_dir
from tests.support.models import TINY_TARGETS, lora, tiny_adapter

pytestmark = pytest.mark.integration

PROMPT = encode("12+34=", add_bos=True)
META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
             "e2e_latency", "num_retractions", "reasoning_tokens"}
MODEL_INFO_KEYS = {"model_path", "served_model_name", "tokenizer_path", "is_generation", "preferred_sampling_params",
                   "weight_version", "load_format", "reasoning_parser", "tool_call_parser", "disaggregation_mode",
                   "has_image_understanding", "has_audio_understanding", "model_type", "architectures"}


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    eos_dir = make_weights_dir(root / "eos", seed=0)
    eos_model = load_model(eos_dir)
    with torch.no_grad():  # EOS is always the argmax: the final LN emits ones, only the EOS row of the head is set
        eos_model.ln_f.weight.zero_()
        eos_model.ln_f.bias.fill_(1.0)
        eos_model.head.weight.zero_()
        eos_model.head.weight[EOS_ID] = 1.0
    save_weights(eos_model, eos_dir)
    return {"base": make_weights_dir(root / "base", seed=0), "eos": eos_dir,
            "lora_a": tiny_adapter(root / "lora_a", seed=1), "lora_b": tiny_adapter(root / "lora_b", seed=2)}


@pytest.fixture(scope="module")
def engine(weights: dict[str, Path]) -> Iterator[EngineProcess]:
    with EngineProcess(weights["base"], weight_version="7", extra_args=["--enable-lora"]) as proc:
        for name in ("a", "b"):
            status, reply = proc.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(weights[f"lora_{name}"])})
            assert status == 200 and reply["success"] is True, reply
        yield proc


@pytest.fixture(scope="module")
def base_model(weights: dict[str, Path]) -> TinyLM:
    return load_model(weights["base"]).eval()


def gen(engine: EngineProcess, input_ids: Any = PROMPT, expect: int = 200, **body: Any) -> Any:
    status, reply = engine.post("/generate", {"input_ids": input_ids, **body})
    assert status == expect, reply
    return reply


def recomputed_logprobs(model: TinyLM, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    with torch.no_grad():
        logps = token_logprobs(model, torch.tensor([prompt + output]), temperature=temperature)[0]
    return logps[len(prompt) - 1 :].tolist()


def test_health_ready_and_health_generate_answer_200(engine: EngineProcess) -> None:
    assert engine.get("/health")[0] == 200
    assert engine.get("/ready")[0] == 200
    assert engine.get("/health_generate")[0] == 200


def test_model_info_has_sglangs_keys_and_no_per_adapter_versions(engine: EngineProcess, weights: dict[str, Path]) -> None:
    for path in ("/model_info", "/get_model_info"):
        status, info = engine.get(path)
        assert status == 200
        assert set(info) == MODEL_INFO_KEYS  # SGLang keeps no weight_versions: adapters carry none
        assert info["model_path"] == str(weights["base"])
        assert info["served_model_name"] == str(weights["base"])
        assert info["is_generation"] is True
        assert info["weight_version"] == "7"
        assert info["architectures"] == ["TinyLM"]
        assert info["model_type"] == "tiny_lm"


def test_server_info_carries_args_and_no_request_counts_where_sglang_has_none(engine: EngineProcess) -> None:
    for path in ("/server_info", "/get_server_info"):
        status, info = engine.get(path)
        assert status == 200
        assert info["port"] == engine.port and info["token_delay_ms"] == 0
        assert info["version"].startswith("rollout-bus-cpu-engine")
        internal = info["internal_states"][0]
        assert not {"running", "queued", "num_running_reqs", "num_queue_reqs"} & set(internal)
        state = internal["cpu_engine"]
        assert {"running", "queued", "paused", "memory_released", "weight_bytes", "adapters"} <= set(state)
        assert state["paused"] is False and state["memory_released"] == [] and state["adapters"] == ["a", "b"]


def test_loads_are_reported_at_v1_loads(engine: EngineProcess) -> None:
    status, body = engine.get("/v1/loads")
    assert status == 200 and body["accelerator"] is None
    (load,) = body["loads"]
    assert load["dp_rank"] == 0 and (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 0)
    assert engine.get("/v1/loads?dp_rank=3")[1]["loads"] == []


def test_v1_models_lists_the_model_and_its_adapters(engine: EngineProcess, weights: dict[str, Path]) -> None:
    cards = engine.get("/v1/models")[1]["data"]
    assert [c["id"] for c in cards] == [str(weights["base"]), "a", "b"]
    assert cards[1]["root"] == str(weights["lora_a"]) and cards[1]["parent"] == str(weights["base"])


def test_greedy_generation_is_the_models_own_and_has_the_reference_shape(engine: EngineProcess, base_model: TinyLM) -> None:
    reply = gen(engine, sampling_params={"temperature": 0, "max_new_tokens": 12}, rid="greedy-1")
    assert set(reply) == {"text", "output_ids", "meta_info"}
    meta = reply["meta_info"]
    assert set(meta) == META_KEYS
    assert meta["id"] == "greedy-1"
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (len(PROMPT), 12, 0)
    assert meta["weight_version"] == "7"
    assert reply["output_ids"] == generate(base_model, [PROMPT], 12, stop_at_eos=False)[0]
    assert reply["text"] == decode(reply["output_ids"])


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_logprobs_are_those_of_the_model_under_the_sampling_temperature(
    engine: EngineProcess, base_model: TinyLM, temperature: float
) -> None:
    reply = gen(engine, sampling_params={"temperature": temperature, "max_new_tokens": 20, "ignore_eos": True}, return_logprob=True)
    entries = reply["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == reply["output_ids"]
    assert all(e[2] is None for e in entries)
    expected = recomputed_logprobs(base_model, PROMPT, reply["output_ids"], temperature or 1.0)
    assert [e[0] for e in entries] == pytest.approx(expected, abs=1e-4)


def test_return_text_in_logprobs_fills_the_third_field(engine: EngineProcess) -> None:
    reply = gen(engine, sampling_params={"max_new_tokens": 5, "ignore_eos": True}, return_logprob=True, return_text_in_logprobs=True)
    assert "".join(e[2] for e in reply["meta_info"]["output_token_logprobs"]) == reply["text"]


def test_a_batch_gets_a_list_of_replies_in_prompt_order(engine: EngineProcess) -> None:
    prompts = [PROMPT, encode("9*9=", add_bos=True), encode("x", add_bos=True)]
    replies = gen(engine, prompts, sampling_params={"max_new_tokens": 4, "ignore_eos": True}, rid="batch")
    assert [r["meta_info"]["prompt_tokens"] for r in replies] == [len(p) for p in prompts]
    assert [r["meta_info"]["id"] for r in replies] == ["batch_0", "batch_1", "batch_2"]
    assert all(len(r["output_ids"]) == 4 for r in replies)


def test_n_samples_of_one_prompt_come_back_as_a_list(engine: EngineProcess) -> None:
    replies = gen(engine, sampling_params={"max_new_tokens": 8, "n": 4, "sampling_seed": 5, "ignore_eos": True}, rid="nn")
    assert [r["meta_info"]["id"] for r in replies] == ["nn_0", "nn_1", "nn_2", "nn_3"]
    assert len({tuple(r["output_ids"]) for r in replies}) > 1
    both = gen(engine, [PROMPT, PROMPT[:3]], sampling_params={"max_new_tokens": 2, "n": 2})
    assert [r["meta_info"]["prompt_tokens"] for r in both] == [len(PROMPT)] * 2 + [3] * 2


def test_sampling_seed_makes_sampling_reproducible(engine: EngineProcess) -> None:
    params = {"max_new_tokens": 16, "sampling_seed": 1234, "ignore_eos": True, "top_p": 0.9, "top_k": 20, "min_p": 0.01}
    first, second = gen(engine, sampling_params=params), gen(engine, sampling_params=params)
    assert first["output_ids"] == second["output_ids"]
    greedy = gen(engine, sampling_params={"temperature": 0, "max_new_tokens": 16})
    top1 = gen(engine, sampling_params={"top_k": 1, "max_new_tokens": 16, "ignore_eos": True})
    assert top1["output_ids"] == greedy["output_ids"]


def test_stop_token_ids_stop_at_the_first_match_and_keep_the_token_in_output_ids(engine: EngineProcess) -> None:
    free = gen(engine, sampling_params={"temperature": 0, "max_new_tokens": 12})["output_ids"]
    target = free[3]
    reply = gen(engine, sampling_params={"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [target]})
    cut = free.index(target) + 1
    assert reply["output_ids"] == free[:cut]
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    assert reply["text"] == decode(free[: cut - 1])
    kept = gen(engine, sampling_params={"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [target], "no_stop_trim": True})
    assert kept["text"] == decode(free[:cut])


def test_stop_strings_match_on_text(engine: EngineProcess) -> None:
    free = gen(engine, sampling_params={"temperature": 0, "max_new_tokens": 12})["output_ids"]
    stop = decode(free[4:6])
    reply = gen(engine, sampling_params={"temperature": 0, "max_new_tokens": 12, "stop": [stop]})
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert decode(reply["output_ids"]).endswith(stop)
    assert reply["text"] + stop == decode(reply["output_ids"])


def test_eos_stops_generation_unless_ignore_eos(engine: EngineProcess, weights: dict[str, Path]) -> None:
    assert engine.post("/update_weights_from_disk", {"model_path": str(weights["eos"]), "weight_version": "eos"})[0] == 200
    try:
        reply = gen(engine, sampling_params={"max_new_tokens": 6})
        assert reply["output_ids"] == [EOS_ID]
        assert reply["text"] == ""
        assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS_ID}
        assert reply["meta_info"]["weight_version"] == "eos"
        ignored = gen(engine, sampling_params={"max_new_tokens": 6, "ignore_eos": True})
        assert ignored["output_ids"] == [EOS_ID] * 6
        assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    finally:
        status, _ = engine.post("/update_weights_from_disk", {"model_path": str(weights["base"]), "weight_version": "7"})
    assert status == 200


def test_lora_path_picks_an_adapter_per_prompt_and_matches_a_direct_peft_forward(engine: EngineProcess) -> None:
    direct = {name: lora(build_model(seed=0), TINY_TARGETS, seed=seed, scale=0.5) for name, seed in (("a", 1), ("b", 2))}
    replies = gen(engine, [PROMPT, PROMPT, PROMPT], sampling_params={"max_new_tokens": 10, "ignore_eos": True},
                  lora_path=["a", None, "b"], return_logprob=True)
    outputs = [r["output_ids"] for r in replies]
    for reply, model in zip(replies, [direct["a"], build_model(seed=0).eval(), direct["b"]], strict=True):
        assert reply["meta_info"]["weight_version"] == "7"  # SGLang reports the base version for adapter rows too
        logps = [e[0] for e in reply["meta_info"]["output_token_logprobs"]]
        assert logps == pytest.approx(recomputed_logprobs(model, PROMPT, reply["output_ids"]), abs=1e-4)
    greedy = gen(engine, [PROMPT, PROMPT], sampling_params={"temperature": 0, "max_new_tokens": 8}, lora_path=["a", None])
    assert greedy[0]["output_ids"] != greedy[1]["output_ids"] and len(set(map(tuple, outputs))) == 3


def test_an_adapter_never_loaded_is_a_400_naming_the_loaded_ones(engine: EngineProcess) -> None:
    reply = gen(engine, expect=400, lora_path="nope")
    assert "never been loaded: nope" in reply["error"]["message"]
    assert "['a', 'b']" in reply["error"]["message"]


def test_max_new_tokens_zero_finishes_at_once(engine: EngineProcess) -> None:
    reply = gen(engine, sampling_params={"max_new_tokens": 0})
    assert reply["output_ids"] == [] and reply["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_text_prompts_are_tokenized_by_the_served_models_tokenizer(engine: EngineProcess) -> None:
    by_text = gen(engine, None, text="12+34=", sampling_params={"temperature": 0, "max_new_tokens": 5})
    by_ids = gen(engine, sampling_params={"temperature": 0, "max_new_tokens": 5})
    assert by_text["output_ids"] == by_ids["output_ids"] and by_text["meta_info"]["prompt_tokens"] == len(PROMPT)
    both = gen(engine, None, text=["12+34=", "9*9="], sampling_params={"temperature": 0, "max_new_tokens": 2})
    assert [r["meta_info"]["prompt_tokens"] for r in both] == [len(PROMPT), 5]


def test_unknown_top_level_keys_are_ignored_and_sglang_fields_accepted(engine: EngineProcess) -> None:
    reply = gen(engine, sampling_params={"max_new_tokens": 2}, bogus=1, priority=3, custom_labels={"team": "x"})
    assert reply["meta_info"]["completion_tokens"] == 2


def test_default_max_new_tokens_fill_the_context(engine: EngineProcess) -> None:
    reply = gen(engine, sampling_params={"ignore_eos": True})
    assert reply["meta_info"]["completion_tokens"] == 64 - len(PROMPT)


def test_streaming_sends_cumulative_chunks_then_done(engine: EngineProcess) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 6}, "stream": True}
    request = urllib.request.Request(engine.url + "/generate", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        lines = [line.decode().strip() for line in response if line.strip()]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5, 6]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert chunks[-1]["output_ids"] == gen(engine, sampling_params={"temperature": 0, "max_new_tokens": 6})["output_ids"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"input_ids": PROMPT, "sampling_params": {"temperature": "hot"}}, "temperature must be a finite number"),
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be >= 0"),
        ({"input_ids": PROMPT, "sampling_params": {"max_tokens": 3}}, "unknown field(s) ['max_tokens'] in sampling_params"),
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": "x"}}, "max_new_tokens must be an integer"),
        ({"input_ids": PROMPT, "priority": "high"}, "priority must be an integer"),
        ({"input_ids": PROMPT, "custom_labels": {"a": 1}}, "custom_labels must be an object of strings"),
        ({"input_ids": PROMPT, "rid": 5}, "rid must be a string"),
        ({"input_ids": [1.0, 2]}, "input_ids[0] must be an integer"),
        ({"input_ids": "abc"}, "input_ids must be a list"),
        ({"input_ids": PROMPT, "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty = 0.5"),
        ({"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]"),
        ({"input_ids": [1, VOCAB_SIZE]}, f"input_ids[1] = {VOCAB_SIZE} is outside the vocabulary"),
        ({"input_ids": [1, "a"]}, "input_ids[1] must be an integer"),
        ({"input_ids": []}, "input_ids is required"),
        ({"input_ids": [5] * 60, "sampling_params": {"max_new_tokens": 10}}, "exceeds max_seq_len 64"),
        ({"input_ids": PROMPT, "return_logprob": "yes"}, "return_logprob must be true or false"),
        ({"text": "HELLO"}, "is not in the vocabulary"),
        ({"input_ids": PROMPT, "sampling_params": {"n": 0}}, "n must be between"),
    ],
)
def test_bad_generate_requests_get_a_400_saying_what_to_fix(engine: EngineProcess, body: dict[str, Any], fragment: str) -> None:
    status, reply = engine.post("/generate", body)
    assert status == 400
    assert fragment in reply["error"]["message"]


def test_malformed_json_is_a_400(engine: EngineProcess) -> None:
    status, reply = call(engine.url + "/generate", "POST", raw=b'{"input_ids": [1,')
    assert status == 400 and "not valid JSON" in reply["error"]["message"]
    status, reply = call(engine.url + "/generate", "POST", raw=b"[1, 2]")
    assert status == 400 and "JSON object" in reply["error"]["message"]


def test_flush_cache_answers_200_when_idle(engine: EngineProcess) -> None:
    assert engine.get("/flush_cache")[0] == 200
    assert engine.post("/flush_cache")[0] == 200


def test_control_requests_follow_sglangs_rules(engine: EngineProcess) -> None:
    assert engine.post("/abort_request", {}) == (200, None)  # an empty rid is ignored
    status, reply = engine.post("/pause_generation", {"mode": "sideways"})
    assert status == 400 and "mode must be one of" in reply["error"]["message"]
    status, reply = engine.post("/release_memory_occupation", {"tags": ["gpu"]})
    assert status == 400 and "tags must be" in reply["error"]["message"]
    status, reply = engine.post("/update_weight_version", {})
    assert status == 400 and reply["success"] is False and "new_version" in reply["message"]
    status, reply = engine.post("/update_weight_version", {"new_version": 11})
    assert status == 400 and "must be a string" in reply["message"]
    status, reply = call(engine.url + "/continue_generation", "POST", raw=b"")
    assert status == 400 and "JSON object body" in reply["error"]["message"]
    status, reply = engine.post("/update_weights_from_disk", {"weight_version": "8", "unknown_key": True})
    assert status == 400 and "model_path is required" in reply["message"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_engine_runs_on_cuda(weights: dict[str, Path], base_model: TinyLM) -> None:
    with EngineProcess(weights["base"], extra_args=["--device", "cuda"]) as cuda_engine:
        params = {"max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 3}
        first = gen(cuda_engine, sampling_params=params, return_logprob=True)
        logps = [e[0] for e in first["meta_info"]["output_token_logprobs"]]
        assert logps == pytest.approx(recomputed_logprobs(base_model, PROMPT, first["output_ids"]), abs=1e-3)
        assert cuda_engine.post("/release_memory_occupation", {"tags": None})[0] == 200
        assert cuda_engine.state()["weight_bytes"] == 0
        assert cuda_engine.post("/resume_memory_occupation", {"tags": None})[0] == 200
        again = gen(cuda_engine, sampling_params=params, return_logprob=True)
        assert again["output_ids"] == first["output_ids"]
        assert again["meta_info"]["output_token_logprobs"] == first["meta_info"]["output_token_logprobs"]
