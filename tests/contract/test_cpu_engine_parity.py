"""The CPU engine answers what SGLang's HTTP layer answers: the same bodies sent to SGLang's real app and
to a real CPU engine process get the same status class, the same reply shapes and the same keys, so
the fast suite (CPU engines only) catches what SGLang would refuse."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.contract.lane import require_sglang

require_sglang()

from tests.contract.sglang_harness import Harness  # noqa: E402
from tests.engine_proc import EngineProcess, call, make_weights_dir  # noqa: E402

P = [1, 5, 6, 7]
GENERATE_CASES: list[tuple[str, dict[str, Any]]] = [
    ("plain", {"input_ids": P, "sampling_params": {"max_new_tokens": 2}}),
    ("text", {"text": "hello", "sampling_params": {"max_new_tokens": 2}}),
    ("unknown top-level key", {"input_ids": P, "sampling_params": {"max_new_tokens": 2}, "foo": 1}),
    ("priority and custom_labels", {"input_ids": P, "sampling_params": {"max_new_tokens": 2}, "priority": 3,
                                    "custom_labels": {"team": "x"}}),
    ("logprobs", {"input_ids": P, "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}),
    ("batch with n", {"input_ids": [P, P[:2]], "sampling_params": {"max_new_tokens": 2, "n": 2}, "rid": "b"}),
    ("unknown sampling key", {"input_ids": P, "sampling_params": {"bogus": 1}}),
    ("priority not an int", {"input_ids": P, "priority": "high"}),
    ("input_ids a string", {"input_ids": "abc"}),
    ("input_ids floats", {"input_ids": [1.0, 2]}),
    ("rid an int", {"input_ids": P, "rid": 5}),
    ("custom_labels not strings", {"input_ids": P, "custom_labels": {"a": 1}}),
    ("max_new_tokens a string", {"input_ids": P, "sampling_params": {"max_new_tokens": "x"}}),
    ("return_logprob a string", {"input_ids": P, "return_logprob": "yes"}),
    ("temperature a string", {"input_ids": P, "sampling_params": {"temperature": "0.5"}}),
    ("empty input_ids", {"input_ids": []}),
    ("no input", {"sampling_params": {"max_new_tokens": 2}}),
    ("negative max_new_tokens", {"input_ids": P, "sampling_params": {"max_new_tokens": -1}}),
    ("negative temperature", {"input_ids": P, "sampling_params": {"temperature": -1}}),
    ("top_p above 1", {"input_ids": P, "sampling_params": {"top_p": 2}}),
    ("a list of sampling_params for one prompt", {"input_ids": P, "sampling_params": [{"max_new_tokens": 2}]}),
    ("duplicate rids", {"input_ids": [P, P], "rid": ["a", "a"]}),
    ("lora_path without LoRA", {"input_ids": P, "lora_path": "x"}),
]
CONTROL_CASES: list[tuple[str, str, Any]] = [
    ("version missing", "/update_weight_version", {}),
    ("version an int", "/update_weight_version", {"new_version": 11}),
    ("version with an unknown key", "/update_weight_version", {"new_version": "9", "foo": 1}),
    ("weights without model_path", "/update_weights_from_disk", {"flush_cache": True}),
    ("pause in a made-up mode", "/pause_generation", {"mode": "sideways"}),
    ("pause without a body", "/pause_generation", None),
    ("continue without a body", "/continue_generation", None),
    ("continue", "/continue_generation", {"torch_empty_cache": True}),
    ("abort nothing", "/abort_request", {}),
    ("abort an unknown rid", "/abort_request", {"rid": "nobody", "abort_all": False}),
    ("adapter without LoRA", "/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"}),
    ("adapter without a path", "/load_lora_adapter", {"lora_name": "a"}),
    ("group without master_address", "/init_weights_update_group", {"master_port": 29500, "rank_offset": 1,
                                                                     "world_size": 2}),
    ("group with a port that is no number", "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1, "world_size": 2}),
    ("group without a body", "/init_weights_update_group", None),
    ("bucket without names", "/update_weights_from_distributed", {"dtypes": ["float32"], "shapes": [[1]]}),
    ("bucket with shapes not lists", "/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"],
                                                                          "shapes": "x"}),
]
# Deliberately stricter than SGLang (a 400 where SGLang answers 200): a release of a tag SGLang does not
# know ("gpu"), which SGLang records and ignores.


@pytest.fixture(scope="module")
def sglang() -> Any:
    return Harness(["--weight-version", "0"]).client()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with EngineProcess(make_weights_dir(tmp_path_factory.mktemp("tiny") / "m"), weight_version="0") as proc:
        yield proc


def both(sglang: Any, engine: EngineProcess, method: str, path: str, body: Any) -> tuple[tuple[int, Any], tuple[int, Any]]:
    if body is None:
        theirs = sglang.request(method, path, content=b"")
        ours = call(engine.url + path, method, raw=b"")
    else:
        theirs = sglang.request(method, path, json=body)
        ours = call(engine.url + path, method, body)
    try:
        their_body = theirs.json()
    except ValueError:
        their_body = theirs.text
    return (theirs.status_code, their_body), ours


@pytest.mark.parametrize(("case", "body"), GENERATE_CASES, ids=[c for c, _ in GENERATE_CASES])
def test_generate_bodies_get_the_same_answer(sglang: Any, engine: EngineProcess, case: str, body: dict[str, Any]) -> None:
    (theirs, their_reply), (ours, our_reply) = both(sglang, engine, "POST", "/generate", body)
    assert theirs // 100 == ours // 100, f"{case}: SGLang {theirs} {their_reply}, CPU engine {ours} {our_reply}"
    if theirs != 200:
        return
    assert isinstance(their_reply, list) == isinstance(our_reply, list)
    theirs_list = their_reply if isinstance(their_reply, list) else [their_reply]
    ours_list = our_reply if isinstance(our_reply, list) else [our_reply]
    if "input_ids" in body:  # (the stand-in behind SGLang's app does not tokenize text)
        assert [r["meta_info"]["prompt_tokens"] for r in theirs_list] == [r["meta_info"]["prompt_tokens"] for r in ours_list]
    for mine, reference in zip(ours_list, theirs_list, strict=True):
        assert set(mine) == set(reference)
        missing = set(reference["meta_info"]) - set(mine["meta_info"]) - {"input_token_logprobs"}
        assert not missing, f"{case}: meta_info lacks {sorted(missing)}"


@pytest.mark.parametrize(("case", "path", "body"), CONTROL_CASES, ids=[c for c, _, _ in CONTROL_CASES])
def test_control_bodies_get_the_same_answer(sglang: Any, engine: EngineProcess, case: str, path: str, body: Any) -> None:
    (theirs, their_reply), (ours, our_reply) = both(sglang, engine, "POST", path, body)
    assert theirs // 100 == ours // 100, f"{case}: SGLang {theirs} {their_reply}, CPU engine {ours} {our_reply}"


def test_pausing_release_resume_and_ready_answer_alike(sglang: Any, engine: EngineProcess) -> None:
    for path, body in (("/pause_generation", {}), ("/release_memory_occupation", {}), ("/resume_memory_occupation", {})):
        (theirs, their_reply), (ours, our_reply) = both(sglang, engine, "POST", path, body)
        assert (theirs, ours) == (200, 200)
        if "memory" in path:
            assert their_reply is None and our_reply is None  # a bare null, no success/message
    assert (sglang.get("/ready").status_code, call(engine.url + "/ready")[0]) == (503, 503)
    assert both(sglang, engine, "POST", "/continue_generation", {})[0][0] == 200
    assert (sglang.get("/ready").status_code, call(engine.url + "/ready")[0]) == (200, 200)


def test_weight_group_replies_carry_success_and_message(sglang: Any, engine: EngineProcess) -> None:
    """SGLang answers the three weight-group routes with ``{"success", "message"}``; so does the CPU engine
    (here refusing: it has no group of that name, where the stand-in behind SGLang's app has no groups)."""
    for path, body in (("/destroy_weights_update_group", {"group_name": "none"}),
                       ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]],
                                                             "group_name": "none"})):
        (_, their_reply), (ours, our_reply) = both(sglang, engine, "POST", path, body)
        assert set(our_reply) == set(their_reply) == {"success", "message"}, (path, our_reply, their_reply)
        assert ours == 400 and our_reply["success"] is False


def test_info_replies_carry_the_keys_sglang_has(sglang: Any, engine: EngineProcess) -> None:
    assert set(call(engine.url + "/model_info")[1]) == set(sglang.get("/model_info").json())
    theirs, ours = sglang.get("/v1/loads").json(), call(engine.url + "/v1/loads")[1]
    assert set(ours) == set(theirs)
    assert set(theirs["loads"][0]) - set(ours["loads"][0]) <= {"memory", "speculative", "lora", "disaggregation",
                                                                 "queues"}
    card_keys = {"id", "root", "parent"}
    assert card_keys <= set(sglang.get("/v1/models").json()["data"][0]) and card_keys <= set(call(engine.url + "/v1/models")[1]["data"][0])
    their_info, our_info = sglang.get("/server_info").json(), call(engine.url + "/server_info")[1]
    for counts in ("num_running_reqs", "num_waiting_reqs", "running", "queued"):
        assert counts not in their_info["internal_states"][0] and counts not in our_info["internal_states"][0]

