"""``/health_generate`` of a busy engine, over real HTTP: as SGLang's, it passes on the engine's progress.

An engine decoding a batch that fills it cannot run the check's own token until a slot frees; an eval of
200 problems kept a SmolLM2 engine's probe queued past the timeout three times in a row, and the
controller restarted a healthy engine in the middle of the eval. The check now passes once a decode step
finishes after it began, and still fails an engine that makes no progress within the timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_bus.lm.tokenizer import encode
from tests.engine_proc import EngineProcess, call, make_weights_dir, wait_until

pytestmark = pytest.mark.integration

PROMPT = encode("12+34=", add_bos=True)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_weights_dir(tmp_path_factory.mktemp("weights") / "base", seed=0)


def _long_request(engine: EngineProcess, max_new_tokens: int, out: dict[str, Any]) -> threading.Thread:
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                                     "ignore_eos": True}}

    def run() -> None:
        out["reply"] = call(f"{engine.url}/generate", "POST", body, timeout_s=120)
        out["done_at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until("the long request runs", lambda: engine.state()["running"] == 1)
    return thread


@pytest.fixture()
def busy_engine(weights: Path) -> Iterator[EngineProcess]:
    """One sequence at a time, 100 ms a step, and a 1 s health timeout."""
    with EngineProcess(weights, token_delay_ms=100, extra_args=["--max-batch-size", "1"],
                       env={"SGLANG_HEALTH_CHECK_TIMEOUT": "1"}) as engine:
        yield engine


def test_an_engine_whose_batch_is_full_passes_the_health_check_on_its_progress(busy_engine: EngineProcess) -> None:
    out: dict[str, Any] = {}
    thread = _long_request(busy_engine, 40, out)  # 40 steps of 100 ms: 4 s, the timeout is 1 s
    status, _ = call(f"{busy_engine.url}/health_generate", timeout_s=10)
    answered_at = time.monotonic()
    state = busy_engine.state()
    thread.join(timeout=60)
    assert status == 200
    assert "done_at" in out and out["done_at"] > answered_at  # the probe could not have had its own token
    assert out["reply"][0] == 200 and out["reply"][1]["meta_info"]["completion_tokens"] == 40
    assert state["queued"] == 0  # the probe was taken out of the queue once it passed
    assert call(f"{busy_engine.url}/health_generate", timeout_s=10)[0] == 200  # an idle engine: its own token


def test_an_engine_that_makes_no_progress_within_the_timeout_fails_the_health_check(weights: Path) -> None:
    # a step every 3 s against a 1 s timeout: no step finishes while the check waits
    with EngineProcess(weights, token_delay_ms=3000, extra_args=["--max-batch-size", "1"],
                       env={"SGLANG_HEALTH_CHECK_TIMEOUT": "1"}) as engine:
        out: dict[str, Any] = {}
        thread = _long_request(engine, 3, out)
        wait_until("the first step finished", lambda: engine.state()["steps"] >= 1)  # now inside its delay
        started = time.monotonic()
        status, body = call(f"{engine.url}/health_generate", timeout_s=10)
        waited = time.monotonic() - started
        assert status == 503, body
        assert "no decode step finished within 1.0 s" in body["error"]["message"]
        assert waited >= 1.0
        thread.join(timeout=60)
        assert out["reply"][0] == 200  # the request itself was not touched
        wait_until("the probe is gone", lambda: engine.state()["queued"] == 0 and engine.state()["running"] == 0)
