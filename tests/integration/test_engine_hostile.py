"""Hostile callers against a real CPU engine process over real HTTP: fencing only from callers that hold
the API key, temperatures too small to sample, bodies too deep or with too many digits, requests that
fan out into too many sequences, a client that goes away with thousands of queued sequences, and a model
directory that holds only a pickled ``.bin``."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from rollout_bus.engine.http_client import FENCE_HEADER, close_shared_session
from rollout_bus.events.names import Keys
from rollout_bus.events.registry import EngineRecord, EngineState, Registry
from rollout_bus.events.rollouts import MIN_TEMPERATURE
from rollout_bus.executor.engines import EngineCaller, EngineRouter, EngineTime, RouterConfig
from rollout_bus.executor.errors import EnginesFailed
from rollout_bus.lm.tokenizer import encode
from tests.engine_proc import ROOT, EngineProcess, call, make_weights_dir, wait_until

pytestmark = pytest.mark.integration

PROMPT = encode("7+8=", add_bos=True)
KEY = "sekret"
MAX_INT64 = str(2**63 - 1)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_weights_dir(tmp_path_factory.mktemp("weights") / "m", seed=0)


@pytest.fixture(scope="module")
def engine(weights: Path) -> Iterator[EngineProcess]:
    with EngineProcess(weights, extra_args=["--max-seqs-per-request", "64", "--max-queued-seqs", "64"]) as proc:
        yield proc


def keyed(proc: EngineProcess, path: str, fence: int | str | None = None, method: str = "GET",
          body: object = None) -> tuple[int, object]:
    headers = {"Authorization": f"Bearer {KEY}"}
    if fence is not None:
        headers[FENCE_HEADER] = str(fence)
    return call(proc.url + path, method, body, headers=headers)


def test_an_anonymous_fence_on_open_routes_does_not_lock_the_controller_out(weights: Path) -> None:
    with EngineProcess(weights, extra_args=["--api-key", KEY]) as proc:
        for path in ("/health", "/health_generate", "/ready"):
            status, _ = call(proc.url + path, headers={FENCE_HEADER: MAX_INT64})
            assert status == 200, path  # the open routes answered, fence header and all
        # without the key a protected route refuses before it reads the fence
        assert call(proc.url + "/model_info", headers={FENCE_HEADER: MAX_INT64})[0] == 401
        assert call(proc.url + "/generate", "POST", {"input_ids": PROMPT},
                    headers={FENCE_HEADER: MAX_INT64})[0] == 401
        # the controller, with the key and a small token, is not fenced
        status, info = keyed(proc, "/model_info", fence=5)
        assert status == 200 and info["weight_version"] == "0"  # type: ignore[index]
        # fencing still works between controllers that hold the key
        assert keyed(proc, "/model_info", fence=10)[0] == 200
        status, body = keyed(proc, "/model_info", fence=7)
        assert status == 409
        assert body == {"success": False, "fenced": True, "highest": 10,
                        "message": "fenced: token 7 is older than 10: another controller took over"}
        assert keyed(proc, "/model_info", fence=10)[0] == 200
        status, body = keyed(proc, "/model_info", fence="9" * 5000)
        assert status == 400 and "must be an integer" in json.dumps(body)


def test_without_an_api_key_the_open_routes_still_never_read_the_fence(engine: EngineProcess) -> None:
    assert call(engine.url + "/health", headers={FENCE_HEADER: MAX_INT64})[0] == 200
    assert call(engine.url + "/model_info", headers={FENCE_HEADER: "3"})[0] == 200


@pytest.mark.parametrize("temperature", [1e-300, 5e-45, MIN_TEMPERATURE / 2, -1])
def test_a_temperature_below_the_minimum_is_a_400_naming_the_minimum(engine: EngineProcess, temperature: float) -> None:
    status, body = engine.post("/generate", {"input_ids": PROMPT, "sampling_params": {"temperature": temperature}})
    assert status == 400 and f"at least {MIN_TEMPERATURE}" in body["error"]["message"]


def test_greedy_and_the_minimum_temperature_are_served(engine: EngineProcess) -> None:
    for temperature in (0, MIN_TEMPERATURE):
        status, body = engine.post("/generate", {"input_ids": PROMPT, "sampling_params": {
            "temperature": temperature, "max_new_tokens": 4, "ignore_eos": True}})
        assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "length", body


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"input_ids": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}", "nested too deeply"),
    (b'{"input_ids": [1], "sampling_params": {"temperature": ' + b"7" * 5000 + b"}}", "number too long"),
    (b'{"input_ids": [1], "sampling_params": {"temperature": ' + b"7" * 400 + b"}}", "finite number"),
    (b'{"input_ids": [1], "sampling_params": {"top_p": 1e999}}', "finite number"),
])
def test_deep_nesting_and_huge_numbers_are_400s(engine: EngineProcess, raw: bytes, message: str) -> None:
    status, body = call(engine.url + "/generate", "POST", raw=raw)
    assert status == 400 and message in body["error"]["message"], body


def test_a_request_for_too_many_sequences_is_refused_at_once_naming_the_bound(engine: EngineProcess) -> None:
    started = time.monotonic()
    status, body = engine.post("/generate", {"input_ids": [[1]] * 400, "sampling_params": {"n": 64}})
    assert status == 400 and "--max-seqs-per-request 64" in body["error"]["message"]
    status, body = engine.post("/generate", {"input_ids": [[1]] * 65})
    assert status == 400 and "65 prompts" in body["error"]["message"]
    assert time.monotonic() - started < 5
    assert engine.state()["queued"] == 0


async def generate_once(engine: EngineProcess, client: redis.Redis, keys: Keys) -> None:
    Registry(client, keys).put_engine(EngineRecord("e0", engine.url, EngineState.SERVING, versions={"default": 0}))
    caller = EngineCaller(EngineRouter(Registry(client, keys), RouterConfig(max_failovers=1, cooldown_s=0.01)))
    try:
        await caller.generate("default", PROMPT, {"max_new_tokens": 2}, rid="full", deadline=None, timer=EngineTime())
    finally:
        await close_shared_session()


def test_a_full_queue_answers_429_with_the_reason_and_serves_again_once_drained(
        engine: EngineProcess, redis_client: redis.Redis, keys: Keys) -> None:
    assert engine.post("/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(engine.post, "/generate", {"input_ids": [PROMPT] * 64,
                                                          "sampling_params": {"max_new_tokens": 2}})
            wait_until("64 queued sequences", lambda: engine.state()["queued"] == 64)
            status, body = engine.post("/generate", {"input_ids": [PROMPT] * 5})
            assert status == 429, body
            assert "queue is full" in body["error"]["message"] and "--max-queued-seqs 64" in body["error"]["message"]
            assert engine.state()["queued"] == 64  # the refused request queued nothing
            with pytest.raises(EnginesFailed, match="429"):  # an executor fails over and retries: not permanent
                asyncio.run(generate_once(engine, redis_client, keys))
            assert engine.post("/continue_generation", {})[0] == 200
            assert held.result(60)[0] == 200
    finally:
        engine.post("/continue_generation", {})
    assert engine.post("/generate", {"input_ids": [PROMPT] * 5, "sampling_params": {"max_new_tokens": 2}})[0] == 200


def test_a_client_gone_with_many_queued_sequences_is_aborted_without_stalling(weights: Path) -> None:
    n = 25_600  # the finding's request: 400 prompts times n = 64
    args = ["--max-seqs-per-request", str(n), "--max-queued-seqs", str(n)]
    with EngineProcess(weights, extra_args=args) as proc:
        assert proc.post("/pause_generation", {"mode": "in_place"})[0] == 200
        body = json.dumps({"input_ids": [[1, 2]] * 400, "sampling_params": {"n": 64, "max_new_tokens": 1}}).encode()
        with socket.create_connection((proc.host, proc.port)) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            wait_until(f"{n} queued sequences", lambda: proc.state()["queued"] == n, timeout_s=60)
        gone = time.monotonic()  # the client went away with every sequence still queued
        wait_until("the queue to drain", lambda: proc.state()["queued"] == 0, timeout_s=60, every_s=0.01)
        drained_s = time.monotonic() - gone
        assert drained_s < 20, f"aborting {n} sequences took {drained_s:.1f} s"  # the rescanning queue: minutes
        assert proc.post("/continue_generation", {})[0] == 200
        assert proc.get("/health_generate")[0] == 200


def test_a_directory_holding_only_a_bin_file_cannot_start_with_a_one_line_reason(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02not a real pickle")
    result = subprocess.run([sys.executable, "-m", "rollout_bus.engine.server", "--model-path", str(tmp_path),
                             "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "cannot start: missing weights file" in output and "model.safetensors" in output
    assert "Traceback" not in output
