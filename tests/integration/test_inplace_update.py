"""An ``in_place`` weight update, sent by the controller's own updater to a real CPU engine, never leaves
generation on KV the old weights computed.

The CPU engine's prefix cache is dropped by every weight update, so a new request that shares a prefix
with an earlier one is computed afresh (``cached_tokens`` 0: checked here, on a prompt long enough to be
cached; reuse across turns and updates is ``test_engine_prefix_cache``), and what can go stale here is
checked too: the KV of a request held by the pause. Its tokens after the update must have exactly the new weights' log-probs over everything
before them, as SGLang's would once the held requests are retracted and its cache flushed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fakeredis
import pytest
import torch

from rollout_bus.controller.config import ControllerConfig
from rollout_bus.controller.service import InferenceController
from rollout_bus.controller.versions import Target
from rollout_bus.engine.http_client import close_shared_session
from rollout_bus.events.registry import EngineState
from rollout_bus.lm.model import load_model, token_logprobs
from rollout_bus.lm.tokenizer import encode
from tests.engine_proc import EngineProcess, make_weights_dir
from tests.integration.test_engine_control import generate, logprobs_under, wait_running

pytestmark = pytest.mark.integration

LONG = 24
CACHED = encode("12+30=42. 7+8=15. 9+9=", add_bos=True)  # longer than a prefix-cache block


@pytest.fixture()
def weights(tmp_path: Path) -> dict[str, Path]:
    return {"old": make_weights_dir(tmp_path / "w" / "v000000", seed=0),
            "new": make_weights_dir(tmp_path / "w" / "v000001", seed=1)}


@pytest.fixture()
def engine(weights: dict[str, Path]) -> Iterator[EngineProcess]:
    with EngineProcess(weights["old"], weight_version="0", token_delay_ms=40) as proc:
        yield proc


def test_after_an_in_place_update_held_and_new_requests_get_exactly_the_new_weights_log_probs(
        engine: EngineProcess, weights: dict[str, Path], tmp_path: Path) -> None:
    config = ControllerConfig(namespace="inplace", num_engines=0, adopt_urls=[engine.url], pause_mode="in_place",
                              weights_root=str(tmp_path / "w"), log_dir=str(tmp_path / "logs"))
    ctl = InferenceController(config, fakeredis.FakeRedis())
    h = ctl.lifecycle.new_handle("engine-0", engine.url, managed=False, state=EngineState.SERVING)
    h.record.versions = {"default": 0}
    target = Target("default", 1, str(tmp_path / "w"), "0" * 64, str(weights["new"]))

    async def update() -> str:
        try:
            async with ctl.core.operate(h):
                return (await ctl.updater.push(h, target, pause=True)).status
        finally:
            await close_shared_session()

    before = generate(engine, 4, return_logprob=True, input_ids=CACHED)  # an earlier request with the same prompt
    assert generate(engine, 4, input_ids=CACHED)["meta_info"]["cached_tokens"] == len(CACHED) - 1  # and cached
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(generate, engine, LONG, return_logprob=True)
        wait_running(engine)
        try:
            assert asyncio.run(update()) == "applied"
        finally:
            ctl.core.bus.close()
        out = held.result(timeout=60)
    after = generate(engine, 4, return_logprob=True, input_ids=CACHED)

    old, new = load_model(weights["old"]).eval(), load_model(weights["new"]).eval()
    got = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    under_old, under_new = logprobs_under(old, out["output_ids"]), logprobs_under(new, out["output_ids"])
    switch = next(i for i, (g, o) in enumerate(zip(got, under_old, strict=True)) if abs(g - o) > 1e-4)
    assert 0 < switch < LONG, "the update landed while the request was held"
    assert got[:switch] == pytest.approx(under_old[:switch], abs=1e-4)
    assert got[switch:] == pytest.approx(under_new[switch:], abs=1e-4)  # no KV of the old weights used
    # a request sharing the earlier one's prefix: the new weights' log-probs, under the new version
    assert after["meta_info"]["weight_version"] == "1" and before["meta_info"]["weight_version"] == "0"
    assert after["meta_info"]["cached_tokens"] == 0
    with torch.no_grad():
        expected = token_logprobs(new, torch.tensor([CACHED + after["output_ids"]]))[0, len(CACHED) - 1:].tolist()
    assert [e[0] for e in after["meta_info"]["output_token_logprobs"]] == pytest.approx(expected, abs=1e-4)
    assert engine.state()["flushes"] >= 1
