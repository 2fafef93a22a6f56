"""Controlling a running CPU engine over real HTTP: weight updates, pause modes, aborts, memory release,
adapters, and the checks SGLang's scheduler makes (answered here as clear 400s instead of a crash).

One engine with a per-step delay serves the module, so requests stay in flight long enough to act on
them. Each test that changes weights starts from the seed-0 weights at version "a" (``base``).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_bus.events.registry import adapter_name
from rollout_bus.lm.model import ModelConfig, TinyLM, load_model, save_weights, token_logprobs
from rollout_bus.lm.tokenizer import encode
from tests.engine_proc import EngineProcess, call, make_weights_dir, wait_until
from tests.support.models import tiny_adapter

pytestmark = pytest.mark.integration

PROMPT = encode("7+8=", add_bos=True)
DELAY_MS = 40
LONG = 30  # tokens: about 1.2 s at DELAY_MS per step


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    return {
        "seed0": make_weights_dir(root / "seed0", seed=0),
        "seed1": make_weights_dir(root / "seed1", seed=1),
        "narrow": make_weights_dir(root / "narrow", seed=0, config=ModelConfig(d_model=32)),
        "two_heads": make_weights_dir(root / "two_heads", seed=0, config=ModelConfig(n_heads=2)),
        "lora": tiny_adapter(root / "lora", seed=3),
        "lora_narrow": tiny_adapter(root / "lora_narrow", seed=3, config=ModelConfig(d_model=32)),
    }


@pytest.fixture(scope="module")
def engine(weights: dict[str, Path]) -> Iterator[EngineProcess]:
    with EngineProcess(weights["seed0"], weight_version="0", token_delay_ms=DELAY_MS,
                       extra_args=["--enable-lora"]) as proc:
        yield proc


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


@pytest.fixture()
def base(engine: EngineProcess, weights: dict[str, Path]) -> None:
    """The seed-0 weights at version "a", nothing paused or released."""
    load(engine, weights["seed0"], weight_version="a")


def load(engine: EngineProcess, path: Path, expect: int = 200, **body: Any) -> dict[str, Any]:
    status, reply = engine.post("/update_weights_from_disk", {"model_path": str(path), **body})
    assert status == expect, reply
    return dict(reply)


def generate(engine: EngineProcess, max_new_tokens: int = LONG, **body: Any) -> dict[str, Any]:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    status, reply = engine.post("/generate", {"input_ids": PROMPT, "sampling_params": params, **body}, timeout_s=60)
    assert status == 200, reply
    return dict(reply)


def in_background(pool: ThreadPoolExecutor, engine: EngineProcess, **body: Any) -> Future[dict[str, Any]]:
    return pool.submit(generate, engine, **body)


def wait_running(engine: EngineProcess, running: int = 1, queued: int = 0) -> None:
    wait_until(
        f"{running} running, {queued} queued",
        lambda: (lambda s: (s["running"], s["queued"]) == (running, queued))(engine.state()),
    )


def version(engine: EngineProcess) -> str:
    return str(engine.get("/model_info")[1]["weight_version"])


def logprobs_under(model: TinyLM, output: list[int]) -> list[float]:
    with torch.no_grad():
        return token_logprobs(model, torch.tensor([PROMPT + output]))[0, len(PROMPT) - 1 :].tolist()


def test_a_weight_update_serves_the_new_weights_under_the_new_version(
    engine: EngineProcess, weights: dict[str, Path], base: None
) -> None:
    reply = load(engine, weights["seed1"], weight_version="b")
    assert reply == {"success": True, "num_paused_requests": 0,
                     "message": "Succeeded to update model weights. Weight version updated to b."}
    info = engine.get("/model_info")[1]
    assert (info["weight_version"], info["model_path"], info["served_model_name"]) == ("b",) + (str(weights["seed1"]),) * 2
    out = generate(engine, 6, return_logprob=True)
    assert out["meta_info"]["weight_version"] == "b"
    expected = logprobs_under(load_model(weights["seed1"]).eval(), out["output_ids"])
    assert [e[0] for e in out["meta_info"]["output_token_logprobs"]] == pytest.approx(expected, abs=1e-4)


def test_a_single_safetensors_file_is_a_valid_model_path(engine: EngineProcess, weights: dict[str, Path], base: None) -> None:
    load(engine, weights["seed1"] / "model.safetensors", weight_version="c")
    assert version(engine) == "c"


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("missing", "does not exist"),
        ("narrow", "blocks.0.attn.proj.bias: shape (32,), expected (64,)"),
        ("two_heads", "differs from the served model's: n_heads: 2 (served: 4)"),
        ("empty_dir", "missing weights file"),
        ("garbage", "cannot read"),
        ("nan", "contains NaN or infinite values"),
    ],
)
def test_a_failed_weight_update_is_a_400_and_keeps_the_old_weights_and_version(
    engine: EngineProcess, weights: dict[str, Path], base: None, tmp_path: Path, path: str, fragment: str
) -> None:
    before = generate(engine, 6)
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "garbage.safetensors").write_bytes(b"not safetensors at all")
    (tmp_path / "bare").mkdir()  # weights without a config.json: only the shapes can tell
    shutil.copy(weights["narrow"] / "model.safetensors", tmp_path / "bare" / "narrow.safetensors")
    nan_model = load_model(weights["seed1"])
    with torch.no_grad():
        nan_model.blocks[0].attn.qkv.weight[0, 0] = float("nan")
    save_weights(nan_model, tmp_path / "nan")
    target = {
        "missing": tmp_path / "missing",
        "narrow": tmp_path / "bare" / "narrow.safetensors",
        "two_heads": weights["two_heads"],
        "empty_dir": tmp_path / "empty_dir",
        "garbage": tmp_path / "garbage.safetensors",
        "nan": tmp_path / "nan",
    }[path]
    reply = load(engine, target, expect=400, weight_version="broken")
    assert reply["success"] is False
    assert fragment in reply["message"]
    assert version(engine) == "a"
    assert generate(engine, 6)["output_ids"] == before["output_ids"]


def test_update_weight_version_renames_the_served_version(engine: EngineProcess, base: None) -> None:
    status, reply = engine.post("/update_weight_version", {"new_version": "renamed"})
    assert status == 200
    assert reply == {"success": True, "message": reply["message"], "new_version": "renamed"}
    assert generate(engine, 2)["meta_info"]["weight_version"] == "renamed"


def test_update_weight_version_aborts_requests_in_flight_by_default(engine: EngineProcess, pool: ThreadPoolExecutor, base: None) -> None:
    pending = in_background(pool, engine)
    wait_running(engine)
    assert engine.post("/update_weight_version", {"new_version": "x"})[0] == 200
    assert pending.result(30)["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_weight_swap_mid_request_is_reported_as_version_spans(
    engine: EngineProcess, pool: ThreadPoolExecutor, weights: dict[str, Path], base: None
) -> None:
    pending = in_background(pool, engine)
    wait_until("a few tokens", lambda: engine.state()["steps"] > 0 and engine.state()["running"] == 1)
    time.sleep(0.2)
    reply = load(engine, weights["seed1"], weight_version="b")
    assert reply["num_paused_requests"] == 1
    meta = pending.result(30)["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": LONG}
    assert meta["weight_version"] == "b"
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["a", "b"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == LONG


def test_an_in_place_pause_with_requests_held_refuses_the_flush_after_loading_the_weights(
    engine: EngineProcess, pool: ThreadPoolExecutor, weights: dict[str, Path], base: None
) -> None:
    """SGLang loads the weights, cannot flush the cache of the held requests, answers 400 and keeps
    reporting the old version; with flush_cache false the same update is a 200."""
    pending = in_background(pool, engine, return_logprob=True)
    wait_running(engine)
    try:
        assert engine.post("/pause_generation", {"mode": "in_place"})[0] == 200
        reply = load(engine, weights["seed1"], expect=400, weight_version="b")
        assert reply["success"] is False and "cache was not flushed" in reply["message"]
        info = engine.get("/model_info")[1]
        assert (info["weight_version"], info["model_path"]) == ("a", str(weights["seed0"]))
        assert load(engine, weights["seed1"], weight_version="b", flush_cache=False)["success"] is True
    finally:
        assert engine.post("/continue_generation")[0] == 200
    assert pending.result(30)["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}
    after = generate(engine, 6, return_logprob=True)
    assert after["meta_info"]["weight_version"] == "b"
    expected = logprobs_under(load_model(weights["seed1"]).eval(), after["output_ids"])
    assert [e[0] for e in after["meta_info"]["output_token_logprobs"]] == pytest.approx(expected, abs=1e-4)


def test_pause_abort_ends_requests_in_flight_with_their_partial_output(engine: EngineProcess, pool: ThreadPoolExecutor) -> None:
    pending = in_background(pool, engine, rid="to-abort")
    wait_running(engine)
    time.sleep(0.2)
    status, reply = engine.post("/pause_generation", {"mode": "abort"})
    assert status == 200 and reply["status"] == "ok" and "message" in reply
    try:
        out = pending.result(30)
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < out["meta_info"]["completion_tokens"] < LONG
        assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"]
        waiting = in_background(pool, engine, max_new_tokens=3)
        wait_running(engine, running=0, queued=1)
        assert engine.state()["paused"] is True
    finally:
        assert engine.post("/continue_generation")[1] == {"message": "Generation continued successfully.", "status": "ok"}
    assert waiting.result(30)["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_retract_requeues_requests_which_resume_on_new_weights_after_continue(
    engine: EngineProcess, pool: ThreadPoolExecutor, weights: dict[str, Path], base: None
) -> None:
    pending = in_background(pool, engine, return_logprob=True)
    wait_running(engine)
    time.sleep(0.2)
    try:
        assert engine.post("/pause_generation", {"mode": "retract"})[0] == 200
        wait_running(engine, running=0, queued=1)
        assert engine.state()["kv_cache_bytes"] == 0
        load(engine, weights["seed1"], weight_version="b")
    finally:
        assert engine.post("/continue_generation")[0] == 200
    out = pending.result(30)
    meta = out["meta_info"]
    assert meta["num_retractions"] == 1
    assert meta["finish_reason"] == {"type": "length", "length": LONG}
    old, new = meta["weight_versions"]
    assert (old["version"], new["version"]) == ("a", "b")
    # retracted sequences are prefilled again, so every token after the swap is exactly the new model's
    logps = [e[0] for e in meta["output_token_logprobs"]]
    expected = logprobs_under(load_model(weights["seed1"]).eval(), out["output_ids"])
    assert logps[new["start"] :] == pytest.approx(expected[new["start"] :], abs=1e-4)


def test_pause_in_place_freezes_requests_until_continue(engine: EngineProcess, pool: ThreadPoolExecutor) -> None:
    pending = in_background(pool, engine)
    wait_running(engine)
    try:
        assert engine.post("/pause_generation", {"mode": "in_place"})[0] == 200
        steps = engine.state()["steps"]
        time.sleep(4 * DELAY_MS / 1000)
        state = engine.state()
        assert (state["steps"], state["running"], state["pause_mode"]) == (steps, 1, "in_place")
        assert state["kv_cache_bytes"] > 0
        assert not pending.done()
    finally:
        assert engine.post("/continue_generation")[0] == 200
    assert pending.result(30)["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}


def test_abort_request_ends_one_request_by_rid(engine: EngineProcess, pool: ThreadPoolExecutor) -> None:
    target = in_background(pool, engine, rid="victim")
    other = in_background(pool, engine, rid="bystander", max_new_tokens=10)
    wait_running(engine, running=2)
    assert engine.post("/abort_request", {"rid": "victim"}) == (200, None)
    finish = target.result(30)["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and "message" in finish
    assert other.result(30)["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_request_hits_only_an_exact_rid_in_flight_like_sglang(engine: EngineProcess, pool: ThreadPoolExecutor) -> None:
    """A batch under rid "grp" runs as grp_0, grp_1: "grp" is in flight nowhere, so it aborts nothing
    (SGLang's tokenizer looks the rid up); "grp_0" aborts that row and every rid it prefixes."""
    pending = pool.submit(
        engine.post, "/generate",
        {"input_ids": [PROMPT, PROMPT], "rid": "grp", "sampling_params": {"max_new_tokens": LONG, "n": 2}}, 60,
    )
    wait_running(engine, running=4)
    assert engine.post("/abort_request", {"rid": "grp"}) == (200, None)
    assert engine.post("/abort_request", {"rid": "grp_0_"}) == (200, None)  # a prefix, not a rid in flight
    assert engine.state()["running"] == 4
    assert engine.post("/abort_request", {"rid": "grp_0_0"})[0] == 200
    wait_running(engine, running=3)
    assert engine.post("/abort_request", {"abort_all": True})[0] == 200
    status, replies = pending.result(30)
    assert status == 200
    assert [r["meta_info"]["id"] for r in replies] == ["grp_0_0", "grp_0_1", "grp_1_0", "grp_1_1"]
    assert {r["meta_info"]["finish_reason"]["type"] for r in replies} == {"abort"}


def test_abort_all_ends_every_request(engine: EngineProcess, pool: ThreadPoolExecutor) -> None:
    pending = [in_background(pool, engine) for _ in range(3)]
    wait_running(engine, running=3)
    assert engine.post("/abort_request", {"abort_all": True})[0] == 200
    assert all(p.result(30)["meta_info"]["finish_reason"]["type"] == "abort" for p in pending)


def test_flush_cache_is_refused_while_requests_run(engine: EngineProcess, pool: ThreadPoolExecutor) -> None:
    pending = in_background(pool, engine, max_new_tokens=10)
    wait_running(engine)
    assert engine.post("/flush_cache")[0] == 400
    pending.result(30)
    assert engine.post("/flush_cache")[0] == 200


def test_released_weights_are_dropped_and_restored_bit_exactly(engine: EngineProcess, pool: ThreadPoolExecutor) -> None:
    before = generate(engine, 12, return_logprob=True)
    status, reply = engine.post("/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
    try:
        assert (status, reply) == (200, None)  # SGLang answers a bare null
        state = engine.state()
        assert state["weight_bytes"] == 0
        assert state["memory_released"] == ["kv_cache", "weights"]
        assert engine.get("/health_generate")[0] == 503
        waiting = in_background(pool, engine, max_new_tokens=12, return_logprob=True)
        wait_running(engine, running=0, queued=1)
    finally:
        status, reply = engine.post("/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
    assert (status, reply) == (200, None)
    assert engine.state()["memory_released"] == []
    assert engine.state()["weight_bytes"] > 0
    for after in (waiting.result(30), generate(engine, 12, return_logprob=True)):
        assert after["output_ids"] == before["output_ids"]
        assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    assert engine.get("/health_generate")[0] == 200


def test_releasing_memory_while_requests_run_is_a_400_and_serving_goes_on(
    engine: EngineProcess, pool: ThreadPoolExecutor
) -> None:
    """SGLang's scheduler asserts it is idle (the server dies); here it is a clear 400. A retract pause
    makes the engine idle enough, as in SGLang."""
    pending = in_background(pool, engine)
    wait_running(engine)
    status, reply = engine.post("/release_memory_occupation", {"tags": ["kv_cache"]})
    assert status == 400 and "only when server is idle" in reply["error"]["message"]
    assert engine.state()["memory_released"] == []
    try:
        assert engine.post("/pause_generation", {"mode": "retract"})[0] == 200
        assert engine.post("/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
        assert engine.post("/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    finally:
        assert engine.post("/continue_generation")[0] == 200
    assert pending.result(30)["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}


def test_resuming_a_tag_never_released_is_a_400(engine: EngineProcess) -> None:
    """SGLang raises KeyError in the scheduler (the server dies); here it is a clear 400."""
    status, reply = engine.post("/resume_memory_occupation", {"tags": ["weights"]})
    assert status == 400 and "never released" in reply["error"]["message"]
    assert engine.get("/health_generate")[0] == 200


def test_ready_is_503_while_paused(engine: EngineProcess) -> None:
    assert engine.get("/ready")[0] == 200
    assert engine.post("/pause_generation", {"mode": "abort"})[0] == 200
    try:
        assert engine.get("/ready")[0] == 503
        assert engine.get("/health")[0] == 200
    finally:
        assert engine.post("/continue_generation")[0] == 200
    assert engine.get("/ready")[0] == 200


def test_weights_loaded_while_released_are_served_after_resume(
    engine: EngineProcess, weights: dict[str, Path], base: None
) -> None:
    expected = generate(engine, 8)["output_ids"]
    assert engine.post("/release_memory_occupation", {"tags": ["weights"]})[0] == 200
    try:
        load(engine, weights["seed1"], weight_version="b")
        load(engine, weights["seed0"], weight_version="c")
        assert engine.state()["weight_bytes"] == 0
    finally:
        assert engine.post("/resume_memory_occupation", {"tags": ["weights"]})[0] == 200
    out = generate(engine, 8)
    assert out["output_ids"] == expected and out["meta_info"]["weight_version"] == "c"


def test_an_adapter_swap_leaves_no_gap_and_unload_waits_for_its_requests(
    engine: EngineProcess, pool: ThreadPoolExecutor, weights: dict[str, Path]
) -> None:
    assert engine.post("/load_lora_adapter", {"lora_name": "p@v1", "lora_path": str(weights["lora"])})[0] == 200
    pending = in_background(pool, engine, lora_path="p@v1")
    wait_running(engine)
    status, reply = engine.post("/load_lora_adapter", {"lora_name": "p@v2", "lora_path": str(weights["lora"])})
    assert status == 200 and set(reply["loaded_adapters"]) == {"p@v1", "p@v2"}
    unloading = pool.submit(engine.post, "/unload_lora_adapter", {"lora_name": "p@v1"}, 60)
    wait_until("p@v1 unloading", lambda: engine.state()["unloading"] == ["p@v1"])
    assert "never been loaded: p@v1" in engine.post("/generate", {"input_ids": PROMPT, "lora_path": "p@v1"})[1]["error"]["message"]
    assert generate(engine, 3, lora_path="p@v2")["meta_info"]["completion_tokens"] == 3
    assert not unloading.done()
    assert pending.result(30)["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}
    status, reply = unloading.result(30)
    assert status == 200 and reply["loaded_adapters"] == {"p@v2": str(weights["lora"])}
    assert engine.post("/unload_lora_adapter", {"lora_name": "p@v2"})[0] == 200
    assert engine.state()["adapters"] == []


@pytest.mark.parametrize(
    ("name", "path", "fragment"),
    [
        ("x", "missing", "is not a PEFT adapter"),
        ("x", "lora_narrow", "does not fit the base model"),
        ("x", "seed1", "is not a PEFT adapter"),
    ],
)
def test_a_bad_adapter_is_a_400_and_nothing_is_loaded(
    engine: EngineProcess, weights: dict[str, Path], tmp_path: Path, name: str, path: str, fragment: str
) -> None:
    target = weights.get(path, tmp_path / path)
    status, reply = engine.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(target)})
    assert status == 400 and reply["success"] is False and fragment in reply["error_message"]
    assert engine.state()["adapters"] == []
    status, reply = engine.post("/unload_lora_adapter", {"lora_name": "never"})
    assert status == 400 and "does not exist" in reply["error_message"]


@pytest.mark.parametrize("name", [adapter_name(p, v) for p, v in
                                  (("p", 0), ("_p", 1), ("P-1_x", 12345), ("0", 7), ("a" * 64, 10 ** 19 - 1))])
def test_every_adapter_name_form_the_controller_makes_loads_serves_and_unloads(
    engine: EngineProcess, weights: dict[str, Path], name: str
) -> None:
    status, reply = engine.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(weights["lora"])})
    assert status == 200 and name in reply["loaded_adapters"], reply
    assert generate(engine, 3, lora_path=name)["meta_info"]["completion_tokens"] == 3
    assert engine.post("/unload_lora_adapter", {"lora_name": name})[0] == 200
    assert engine.state()["adapters"] == []


@pytest.mark.parametrize(("name", "fragment"), [
    ("policy.v2@v3", "character '.' at position 7"),
    ("a:b@v1", "character ':' at position 2"),
    ("p@x", "character '@' at position 2"),
    ("-p", "character '-' at position 1"),
])
def test_a_bad_adapter_name_is_a_400_naming_its_character_and_nothing_is_loaded(
    engine: EngineProcess, weights: dict[str, Path], name: str, fragment: str
) -> None:
    status, reply = engine.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(weights["lora"])})
    assert status == 400 and reply["success"] is False and fragment in reply["error_message"], reply
    assert engine.state()["adapters"] == [] and reply["loaded_adapters"] == {}
    assert generate(engine, 2)["meta_info"]["completion_tokens"] == 2  # the engine serves on


def test_concurrent_requests_are_decoded_together(engine: EngineProcess, pool: ThreadPoolExecutor) -> None:
    steps = engine.state()["steps"]
    results = [f.result(30) for f in [in_background(pool, engine, max_new_tokens=10) for _ in range(8)]]
    assert all(r["meta_info"]["completion_tokens"] == 10 for r in results)
    # one after the other would take 80 steps; batched, they share most of their 10
    assert engine.state()["steps"] - steps < 40


def test_with_an_api_key_only_health_and_ready_are_open(weights: dict[str, Path]) -> None:
    with EngineProcess(weights["seed0"], extra_args=["--api-key", "sekret"]) as proc:
        assert proc.get("/health")[0] == 200 and proc.get("/health_generate")[0] == 200 and proc.get("/ready")[0] == 200
        assert proc.get("/model_info") == (401, {"error": "Unauthorized"})
        assert proc.post("/generate", {"input_ids": PROMPT})[0] == 401
        for header in ("Bearer sekret", "bearer sekret"):
            status, _ = call(proc.url + "/model_info", headers={"Authorization": header})
            assert status == 200
        assert call(proc.url + "/model_info", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert call(proc.url + "/model_info", headers={"X-API-Key": "sekret"})[0] == 401


def test_a_killed_engine_starts_again_on_the_same_port(weights: dict[str, Path]) -> None:
    with EngineProcess(weights["seed0"], weight_version="3") as proc:
        first_pid, port = proc.pid, proc.port
        proc.kill()
        assert proc.proc is not None and proc.proc.returncode == -9
        proc.start()
        assert (proc.port, proc.get("/model_info")[1]["weight_version"]) == (port, "3")
        assert proc.pid != first_pid
    assert proc.proc is not None and proc.proc.returncode == 0
