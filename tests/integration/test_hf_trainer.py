"""The trainer role on a Hugging Face model (a small random Llama built here), with real engine, executor,
controller and trainer processes on a real Redis:

- the trainer's recomputed log-probs match the engine's ``output_token_logprobs`` for the same weights (the
  check that catches tokenizer, mask and offset bugs);
- a base policy (full fine-tune, whole model directories) and a LoRA policy (adapters on the same engines)
  train side by side;
- the main job runs end to end on the model: word problems, held-out eval before and after.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from rollout_bus.events.connection import connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.registry import Registry
from rollout_bus.events.schema import TrainStepDone, WeightVersionServing, decode
from rollout_bus.executor.convert import to_train_data
from rollout_bus.executor.sample import Sample, Status
from rollout_bus.launch.config import MODEL_TASK, RunConfig
from rollout_bus.launch.job import run_job
from rollout_bus.launch.procs import ProcessSet, RestartPolicy
from rollout_bus.lm import hf
from rollout_bus.replay.offline import OfflineConfig, run_offline, write_outputs
from rollout_bus.trainer.config import LossSettings, OptimConfig
from rollout_bus.trainer.hf_config import HFSettings, LoraSettings
from rollout_bus.trainer.hf_learner import HFLearner
from tests.engine_proc import EngineProcess, wait_until
from tests.support.controller_driver import weight_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf.write_random_llama(tmp_path_factory.mktemp("llama") / "model", seed=0)


def test_the_trainers_log_probs_match_the_engines_output_token_logprobs(llama: Path) -> None:
    """Prompts of different lengths, responses sampled by the engine at T=0.7 in one batch: the learner,
    through the batch's wire layout, padding and micro-batches, gives the engine's log-probs back."""
    torch.set_num_threads(1)
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 259) for _ in range(n)] for n in (3, 11, 6, 20, 1)]
    with EngineProcess(llama, startup_timeout_s=120) as engine:
        status, replies = engine.post("/generate", {
            "input_ids": prompts, "return_logprob": True,
            "sampling_params": [{"temperature": TEMPERATURE, "max_new_tokens": 4 + 3 * i, "n": 2, "sampling_seed": i}
                                for i in range(len(prompts))]}, timeout_s=120)
    assert status == 200, replies
    samples = []
    for k, reply in enumerate(replies):
        entries = reply["meta_info"]["output_token_logprobs"]
        assert [e[1] for e in entries] == reply["output_ids"]
        samples.append(Sample(group_index=k // 2, index=k, prompt="", prompt_ids=prompts[k // 2],
                              response_ids=reply["output_ids"], loss_mask=[1] * len(entries),
                              rollout_log_probs=[e[0] for e in entries], status=Status.COMPLETED, reward=float(k % 2)))
    assert len({len(s.response_ids) for s in samples}) == len(prompts)  # ragged prompts and responses
    data = to_train_data(samples, rollout_id=0)
    learner = HFLearner(hf.load_model(llama), OptimConfig(), LossSettings(),
                        HFSettings(micro_batch_size=3, temperature=TEMPERATURE, device="cpu"))
    recomputed = learner.logprobs(data)
    diffs = torch.cat([(r - torch.tensor(s.rollout_log_probs)).abs() for r, s in zip(recomputed, samples, strict=True)])
    print(f"engine vs trainer log-probs: max abs diff {float(diffs.max()):.2e}, mean {float(diffs.mean()):.2e} "
          f"over {len(diffs)} tokens")
    assert float(diffs.max()) < 1e-4
    # at another temperature they would not match: the comparison can fail
    other = torch.cat([(r - torch.tensor(s.rollout_log_probs)).abs()
                       for r, s in zip(learner.logprobs(data, temperature=1.0), samples, strict=True)])
    assert float(other.max()) > 1e-2


def _events(client: redis.Redis, stream: str) -> list[Any]:
    return [decode(fields) for _, fields in page(client, stream)]


def test_a_base_policy_and_a_lora_policy_train_side_by_side(
        tmp_path: Path, llama: Path, redis_server: RedisServer, redis_client: redis.Redis, keys: Keys) -> None:
    """One engine pool: p0 is its base and trains all its weights, p1 trains a LoRA adapter served on it."""
    task = {**MODEL_TASK, "tokenizer": str(llama), "seed": 0}
    procs = ProcessSet(tmp_path / "logs", env={"ROLLOUT_BUS_NAMESPACE": keys.namespace, "REDIS_URL": redis_server.url})
    common = ["--redis-url", redis_server.url, "--namespace", keys.namespace]
    weights = tmp_path / "weights"
    try:
        procs.start("controller", ["-m", "rollout_bus", "controller", *common, "--num-engines", "1", "--model-path",
                                   str(llama), "--weights-root", str(weights), "--base-policy", "p0", "--enable-lora",
                                   "--max-lora-rank", "4", "--log-dir", str(tmp_path / "logs")])
        procs.start("executor", ["-m", "rollout_bus", "executor", *common, "--index", "0",
                                 "--data-source", "rollout_bus.tasks.math_words.MathWordsSource",
                                 "--data-source-args", json.dumps(task), "--reward", "rollout_bus.tasks.math_reward.reward",
                                 "--tokenizer", "rollout_bus.lm.hf_tokenizer.ChatTokenizer",
                                 "--tokenizer-args", json.dumps({"path": str(llama)})])
        finish = RestartPolicy(budget=0, may_finish=True)
        trainers = [procs.start(f"trainer-{p}", [
            "-m", "rollout_bus", "trainer", "train", *common, "--policy", p, "--trainer-id", f"trainer-{p}",
            "--mode", "sync", "--steps", "2", "--model-path", str(llama), "--weights-root", str(weights),
            "--n-groups", "2", "--n-samples", "2", "--max-new-tokens", "6", "--temperature", str(TEMPERATURE),
            "--data", json.dumps(task), "--lr", "1e-3", "--log-dir", str(tmp_path / "metrics"),
            "--checkpoint-dir", str(tmp_path / "checkpoints" / p),
            "--entropy-coef", "0.001",  # a random model earns no reward: the bonus gives each step a version
            *extra],
            restart=finish) for p, extra in (("p0", []), ("p1", ["--lora", "4,8"]))]
        wait_until("both trainers finish", lambda: all(not t.alive() for t in trainers), timeout_s=240, every_s=0.2)
        assert [t.proc.returncode for t in trainers] == [0, 0], "\n".join(t.tail() for t in trainers)
    finally:
        for record in Registry(redis_client, keys).engines().values():
            if record.pid is not None:
                procs.adopt(record.pid, record.engine_id)
        procs.stop_all()
    assert sorted(p.name for p in (weights / "p0" / "v000002").iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "manifest.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in (weights / "p1" / "v000002").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    served = {(e.policy, e.version) for e in weight_events(redis_client, keys)
              if isinstance(e, WeightVersionServing)}
    assert {("p0", 2), ("p1", 2)} <= served
    steps = [e for e in _events(redis_client, keys.trainer_stream) if isinstance(e, TrainStepDone)]
    assert sorted((e.policy, e.step) for e in steps) == [("p0", 1), ("p0", 2), ("p1", 1), ("p1", 2)]
    assert all("correct_frac" in e.metrics and "formatted_frac" in e.metrics for e in steps)
    # the LoRA trainer's checkpoint holds the adapter alone, the full one every weight
    full, adapter = (torch.load(tmp_path / "checkpoints" / p / "trainer.pt", weights_only=True)["model"]
                     for p in ("p0", "p1"))
    assert adapter and all("lora_" in name for name in adapter)
    assert len(full) == len(hf.load_model(llama).state_dict()) and not any("lora_" in name for name in full)


@pytest.mark.slow
def test_the_main_job_trains_a_hf_model_with_held_out_evals(
        tmp_path: Path, llama: Path, redis_server: RedisServer, keys: Keys) -> None:
    out = tmp_path / "out"
    # a random model answers nothing right: every group's rewards are equal, so the dynamic filter would leave
    # none (it is off here) and no step would have signal; the entropy bonus gives each step a gradient, and
    # so a version to publish
    config = RunConfig(model=str(llama), steps=3, n_groups=2, n_samples=4, max_new_tokens=8, lr=5e-4,
                       dynamic_sampling=False, trainer_args=["--entropy-coef=0.001"],
                       temperature=TEMPERATURE, engine_max_batch=32, eval_groups=4, eval_samples=2, out=str(out),
                       redis_url=redis_server.url, namespace=keys.namespace, progress=False, timeout_s=240,
                       log_events=str(tmp_path / "run.rblog"))
    result = run_job(config)
    summary = json.loads((out / "summary.json").read_text())
    p0 = summary["policies"]["p0"]
    assert p0["steps"] == 3 and len(p0["correct"]) == 3 and len(p0["formatted"]) == 3
    assert p0["eval"]["before"]["samples"] == 8 and p0["eval"]["after"]["samples"] == 8
    assert p0["eval"]["before"]["max_weight_version"] == 0  # the base pool at its initial weights
    assert p0["eval"]["after"]["min_weight_version"] == 3  # the adapter of the last step
    assert "eval before" in result.text and "eval after" in result.text and "answers" in result.text
    assert (out / "reward.png").stat().st_size > 0
    assert (out / "weights" / "p0" / "v000003" / "adapter_config.json").is_file()

    # the recorded log retrains the model offline, deterministically, as the live trainer was set up
    offline = OfflineConfig(log=str(tmp_path / "run.rblog"), model_path=str(llama), policy="p0", optim=OptimConfig(lr=5e-4),
                            loss=LossSettings(entropy_coef=0.001),
                            temperature=TEMPERATURE, hf=HFSettings(device="cpu", lora=LoraSettings(r=8, alpha=16)))
    first, model = run_offline(offline)
    again, _ = run_offline(offline)
    assert len(first.batch_ids) >= 3 and first.batch_ids == again.batch_ids
    assert first.weights_sha256 == again.weights_sha256
    assert first.steps[0].metrics["rollout_kl"] == pytest.approx(0.0, abs=1e-4)  # same weights, same temperature
    written = write_outputs(first, model, tmp_path / "offline")
    assert (written / "model" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_two_trainers_train_two_lora_policies_on_one_engine_pool(
        tmp_path: Path, llama: Path, redis_server: RedisServer, keys: Keys) -> None:
    out = tmp_path / "out"
    config = RunConfig(model=str(llama), trainers=2, steps=2, n_groups=2, n_samples=2, max_new_tokens=6, lr=5e-4,
                       dynamic_sampling=False, trainer_args=["--entropy-coef=0.001"],  # as above: a random model
                       temperature=TEMPERATURE, engine_max_batch=32, eval_groups=2, eval_samples=1, out=str(out),
                       redis_url=redis_server.url, namespace=keys.namespace, progress=False, timeout_s=240)
    result = run_job(config)
    assert set(result.summaries) == {"p0", "p1"} and all(s["steps"] == 2 for s in result.summaries.values())
    for policy in ("p0", "p1"):
        assert (out / "weights" / policy / "v000002" / "adapter_config.json").is_file()
        assert result.summaries[policy]["eval"]["after"]["min_weight_version"] == 2
    client = connect(redis_server.url)
    try:
        launched = {e.engine_id for e in _events(client, keys.engine_stream) if hasattr(e, "engine_id")}
    finally:
        client.close()
    assert launched == {"engine-0"}  # one pool of one engine serves both adapters
