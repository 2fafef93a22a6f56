"""The engine's prefix cache over real HTTP on a small random Llama: a multi-turn session whose turn ``k``
sends every earlier token again gets, from an engine with the cache, the tokens and log-probs an
engine started with ``--disable-radix-cache`` gives (and a trainer's forward recomputes), with
``cached_tokens`` saying how much of the prompt was not recomputed. Every change of the weights,
version, adapters or memory drops the cache, as ``/flush_cache`` does; the budget evicts the least
recently used session; concurrent turns that share a prefix all reuse it."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_bus.engine.scheduler import FLUSHED
from rollout_bus.lm import hf
from tests.engine_proc import EngineProcess, call, wait_until
from tests.support.models import llama_adapter, llama_dir

pytestmark = pytest.mark.integration

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
DELAY_MS = 10
LONG = {"temperature": 0, "max_new_tokens": 150, "ignore_eos": True}  # about 1.5 s at DELAY_MS per step


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefix")
    base = llama_dir(root / "base", seed=0)
    return {"base": base, "other": llama_dir(root / "other", seed=1), "lora": llama_adapter(base, root / "lora", seed=1)}


@pytest.fixture(scope="module")
def engine(dirs: dict[str, Path]) -> Iterator[EngineProcess]:
    with EngineProcess(dirs["base"], weight_version="0", token_delay_ms=DELAY_MS, extra_args=["--enable-lora"],
                       startup_timeout_s=120) as proc:
        yield proc


@pytest.fixture(scope="module")
def uncached(dirs: dict[str, Path]) -> Iterator[EngineProcess]:
    with EngineProcess(dirs["base"], weight_version="0", extra_args=["--disable-radix-cache"],
                       startup_timeout_s=120) as proc:
        yield proc


@pytest.fixture(scope="module")
def model(dirs: dict[str, Path]) -> Any:
    return hf.load_model(dirs["base"])


@pytest.fixture()
def base(engine: EngineProcess, dirs: dict[str, Path]) -> None:
    """The seed-0 weights at version "0" (which drops the cache)."""
    status, reply = engine.post("/update_weights_from_disk", {"model_path": str(dirs["base"]), "weight_version": "0"})
    assert status == 200, reply


def gen(engine: EngineProcess, ids: Any, params: dict[str, Any] | None = None, **body: Any) -> Any:
    status, reply = engine.post("/generate", {"input_ids": ids, "sampling_params": params or GREEDY,
                                              "return_logprob": True, **body}, timeout_s=60)
    assert status == 200, reply
    return reply


def user(seed: int, n: int) -> list[int]:
    """``n`` token ids of a user or tool message (bytes of the byte tokenizer)."""
    return torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def lps(reply: dict[str, Any]) -> list[float]:
    return [e[0] for e in reply["meta_info"]["output_token_logprobs"]]


def logprobs(model: Any, prompt: list[int], output: list[int]) -> list[float]:
    """A trainer's recomputation: one forward over prompt + output, ``log_softmax`` at the outputs."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    picked = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1].gather(1, torch.tensor(output)[:, None])
    return list(picked[:, 0].tolist())


def cache_state(engine: EngineProcess) -> dict[str, Any]:
    return dict(engine.state()["prefix_cache"])


def test_each_turn_reuses_the_earlier_turns_and_gives_the_uncached_engines_tokens_and_logprobs(
        engine: EngineProcess, uncached: EngineProcess, model: Any, base: None) -> None:
    ids = [1, *user(1, 40)]
    sampled = {"temperature": 0.8, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 4}
    previous: list[int] = []
    for turn in range(4):
        params = sampled if turn == 2 else GREEDY
        got, want = gen(engine, ids, params), gen(uncached, ids, params)
        assert got["output_ids"] == want["output_ids"]
        assert lps(got) == pytest.approx(lps(want), abs=1e-4)
        if params is GREEDY:
            assert lps(got) == pytest.approx(logprobs(model, ids, got["output_ids"]), abs=1e-4)
        assert want["meta_info"]["cached_tokens"] == 0
        cached = got["meta_info"]["cached_tokens"]
        if turn == 0:
            assert cached == 0
        else:  # all of the previous turn but its last output token, whose KV was never computed
            assert cached == len(previous) - 1, (turn, cached)
        assert got["meta_info"]["prompt_tokens"] == len(ids)
        previous = ids + got["output_ids"]
        ids = previous + user(10 + turn, 30 + 7 * turn)
    state = cache_state(engine)
    assert state["entries"] == 1 and state["hits"] >= 3  # each turn replaced the one before
    assert engine.get("/v1/loads")[1]["loads"][0]["cache_hit_rate"] > 0


def test_a_weight_update_drops_the_cache_and_the_next_turn_follows_the_new_weights(
        engine: EngineProcess, dirs: dict[str, Path], base: None) -> None:
    other = hf.load_model(dirs["other"])
    for body in ({"weight_version": "1"}, {"weight_version": "2", "flush_cache": False}, {}):
        ids = [1, *user(20, 40)]
        first = gen(engine, ids)
        again = ids + first["output_ids"] + user(21, 30)
        assert gen(engine, again)["meta_info"]["cached_tokens"] > 0  # the cache is in use before the update
        status, reply = engine.post("/update_weights_from_disk", {"model_path": str(dirs["other"]), **body})
        assert status == 200, reply
        assert cache_state(engine)["entries"] == 0
        after = gen(engine, again)
        assert after["meta_info"]["cached_tokens"] == 0
        assert lps(after) == pytest.approx(logprobs(other, again, after["output_ids"]), abs=1e-4)
        later = again + after["output_ids"] + user(22, 30)  # cached again, under the new weights
        reply = gen(engine, later)
        assert reply["meta_info"]["cached_tokens"] > 0
        assert lps(reply) == pytest.approx(logprobs(other, later, reply["output_ids"]), abs=1e-4)


def test_an_in_place_update_with_a_request_held_caches_nothing_that_request_computed(
        engine: EngineProcess, dirs: dict[str, Path], base: None) -> None:
    """The held request's KV mixes both weights: it is not kept when it ends."""
    other = hf.load_model(dirs["other"])
    ids = [1, *user(30, 40)]
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(gen, engine, ids, LONG)
        wait_until("running", lambda: engine.state()["running"] == 1)
        assert engine.post("/pause_generation", {"mode": "in_place"})[0] == 200
        try:
            status, reply = engine.post("/update_weights_from_disk",
                                        {"model_path": str(dirs["other"]), "weight_version": "1", "flush_cache": False})
            assert status == 200, reply
        finally:
            assert engine.post("/continue_generation", {})[0] == 200
        out = held.result(60)
    assert cache_state(engine)["entries"] == 0
    again = ids + out["output_ids"] + user(31, 30)
    after = gen(engine, again)
    assert after["meta_info"]["cached_tokens"] == 0
    assert lps(after) == pytest.approx(logprobs(other, again, after["output_ids"]), abs=1e-4)


def test_a_retracted_request_resumes_from_its_own_cached_kv(engine: EngineProcess, uncached: EngineProcess,
                                                            base: None) -> None:
    ids = [1, *user(35, 40)]
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(gen, engine, ids, LONG)
        wait_until("running", lambda: engine.state()["running"] == 1)
        steps = engine.state()["steps"]
        wait_until("a few tokens out", lambda: engine.state()["steps"] > steps + 5)
        assert engine.post("/pause_generation", {"mode": "retract"})[0] == 200
        try:
            wait_until("requeued", lambda: (engine.state()["running"], engine.state()["queued"]) == (0, 1))
            assert engine.state()["kv_cache_bytes"] == 0 and cache_state(engine)["entries"] == 1
        finally:
            assert engine.post("/continue_generation", {})[0] == 200
        out = pending.result(60)
    want = gen(uncached, ids, LONG)
    assert out["meta_info"]["num_retractions"] == 1 and out["output_ids"] == want["output_ids"]
    assert lps(out) == pytest.approx(lps(want), abs=1e-4)
    assert out["meta_info"]["cached_tokens"] > len(ids)  # all it had computed: the prompt and some output


def test_flush_cache_drops_the_cache_with_sglangs_replies(engine: EngineProcess, base: None) -> None:
    ids = [1, *user(40, 40)]
    again = ids + gen(engine, ids)["output_ids"] + user(41, 30)
    assert cache_state(engine)["entries"] == 1
    assert call(engine.url + "/flush_cache", "POST") == (200, FLUSHED)
    assert cache_state(engine)["entries"] == 0
    assert gen(engine, again)["meta_info"]["cached_tokens"] == 0
    with ThreadPoolExecutor(1) as pool:  # refused while a request runs; with a timeout, done once it ends
        pending = pool.submit(gen, engine, ids, LONG)
        wait_until("running", lambda: engine.state()["running"] == 1)
        status, text = call(engine.url + "/flush_cache", "POST")
        assert status == 400 and text.startswith("Cache not flushed because there are pending requests.")
        assert cache_state(engine)["entries"] == 1
        assert call(engine.url + "/flush_cache?timeout=60", "GET") == (200, FLUSHED)
        assert pending.result(30)["meta_info"]["finish_reason"]["type"] == "length"
    assert cache_state(engine)["entries"] == 0  # flushed after the request ended and was cached
    status, reply = call(engine.url + "/flush_cache?timeout=soon", "POST")
    assert status == 400 and "timeout must be a number of seconds" in reply["error"]["message"]


def test_memory_release_a_version_change_and_adapters_each_drop_the_cache(
        engine: EngineProcess, dirs: dict[str, Path], base: None) -> None:
    def cached_then(action: Any) -> int:
        ids = [1, *user(50, 40)]
        again = ids + gen(engine, ids)["output_ids"] + user(51, 30)
        assert cache_state(engine)["entries"] >= 1
        action()
        return int(gen(engine, again)["meta_info"]["cached_tokens"])

    def release() -> None:
        assert engine.post("/release_memory_occupation", {"tags": ["kv_cache"]}) == (200, None)
        assert engine.post("/resume_memory_occupation", {"tags": ["kv_cache"]}) == (200, None)

    def rename() -> None:
        assert engine.post("/update_weight_version", {"new_version": "renamed"})[0] == 200

    def load() -> None:
        status, reply = engine.post("/load_lora_adapter", {"lora_name": "a", "lora_path": str(dirs["lora"])})
        assert status == 200, reply

    def unload() -> None:
        assert engine.post("/unload_lora_adapter", {"lora_name": "a"})[0] == 200

    for action in (release, rename, load, unload):
        assert cached_then(action) == 0, action.__name__
    assert cached_then(lambda: None) > 0  # and the same turn reuses the cache when nothing changed


def test_an_adapter_reuses_only_what_it_computed(engine: EngineProcess, dirs: dict[str, Path], base: None) -> None:
    from peft import PeftModel

    status, reply = engine.post("/load_lora_adapter", {"lora_name": "a", "lora_path": str(dirs["lora"])})
    assert status == 200, reply
    try:
        ids = [1, *user(60, 40)]
        again = ids + gen(engine, ids)["output_ids"] + user(61, 30)  # computed by the base weights
        first = gen(engine, again, lora_path="a")
        assert first["meta_info"]["cached_tokens"] == 0
        later = again + first["output_ids"] + user(62, 30)
        second = gen(engine, later, lora_path="a")
        assert second["meta_info"]["cached_tokens"] == len(again) + len(first["output_ids"]) - 1
        direct = PeftModel.from_pretrained(hf.load_model(dirs["base"]), str(dirs["lora"])).eval()
        assert lps(second) == pytest.approx(logprobs(direct, later, second["output_ids"]), abs=1e-4)
    finally:
        engine.post("/unload_lora_adapter", {"lora_name": "a"})


def test_concurrent_turns_sharing_a_prefix_all_reuse_it(engine: EngineProcess, uncached: EngineProcess,
                                                        base: None) -> None:
    ids = [1, *user(70, 50)]
    shared = ids + gen(engine, ids)["output_ids"]
    branches = [shared + user(71 + i, 20 + 9 * i) for i in range(4)]
    stranger = [1, *user(80, 45)]  # nothing cached: prefilled in the same step as the others
    batch = gen(engine, [*branches, stranger])  # one request: prefilled together
    with ThreadPoolExecutor(4) as pool:  # separate requests at once
        apart = list(pool.map(lambda b: gen(engine, b), [b + user(90, 17) for b in branches]))
    want = gen(uncached, [*branches, stranger])
    for got, expected in zip(batch, want, strict=True):
        assert got["output_ids"] == expected["output_ids"]
        assert lps(got) == pytest.approx(lps(expected), abs=1e-4)
    assert [r["meta_info"]["cached_tokens"] for r in batch] == [len(shared) - 1] * 4 + [0]
    want_apart = gen(uncached, [b + user(90, 17) for b in branches])
    for got, expected in zip(apart, want_apart, strict=True):
        assert got["output_ids"] == expected["output_ids"]
        assert lps(got) == pytest.approx(lps(expected), abs=1e-4)
        assert got["meta_info"]["cached_tokens"] >= len(shared) - 1


def test_the_budget_evicts_the_least_recently_used_session(dirs: dict[str, Path]) -> None:
    with EngineProcess(dirs["base"], extra_args=["--radix-cache-tokens", "100"], startup_timeout_s=120) as small:
        a, b = [1, *user(100, 50)], [1, *user(101, 50)]
        a2 = a + gen(small, a)["output_ids"] + user(102, 20)  # a's first turn cached: 62 tokens
        b2 = b + gen(small, b)["output_ids"] + user(103, 20)  # b's too: past the budget, a's goes
        state = cache_state(small)
        assert (state["entries"], state["tokens"], state["evictions"]) == (1, 62, 1)
        assert gen(small, a2)["meta_info"]["cached_tokens"] == 0
        assert gen(small, b2)["meta_info"]["cached_tokens"] == 0  # a2's turn took the room (LRU)
        assert cache_state(small)["tokens"] <= 100
        too_long = [1, *user(104, 120)]
        gen(small, too_long)
        assert cache_state(small)["tokens"] <= 100  # a sequence longer than the budget is not kept
        assert gen(small, too_long + user(105, 5))["meta_info"]["cached_tokens"] == 0
