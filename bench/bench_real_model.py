"""The main job on a real model (SmolLM2-135M-Instruct by default): throughput, the time split of a step,
async against sync, and how closely the trainer's log-probs match the engine's.

Each mode runs the main job (``launch.job.run_job``: controller, a CPU engine, an executor and a LoRA
trainer, each a process, on a private redis-server) with the same settings, side by side in one run.
From the events of each run:

- rollout tokens/s: response tokens the executor got over its time per rollout (``RolloutCompleted``);
- trainer tokens/s: tokens (prompt and response) through the learner's forward and backward per second
  of update (``TrainStepDone``'s ``train_tokens_per_s``);
- the split of a sync step: rollout (waiting for the batch just asked for), train (the update), weight
  publish (saving the adapter and announcing it), weight apply (the engine loading it, ``WeightsApplied``)
  and the rest of the serving wait;
- the async speed-up: the sync run's seconds per step over the async run's (steady state: the first
  ``--warmup`` steps and the last one left out).

Then one engine and one learner on the same weights: a batch of the task's prompts sampled by the engine
at the run's temperature, its ``output_token_logprobs`` against the learner's recomputed log-probs (max
and mean absolute difference): a number to watch, not a pass/fail.

    python bench/bench_real_model.py [--model smollm2|DIR] [--steps 6] [--modes sync,async]

The load average is printed before and after; with a 1-minute load above 1 (other work on the machine)
the figures are printed without a verdict.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_bus.events.connection import connect  # noqa: E402
from rollout_bus.events.embedded import private_redis  # noqa: E402
from rollout_bus.events.names import Keys  # noqa: E402
from rollout_bus.events.paging import page, weight_streams  # noqa: E402
from rollout_bus.events.schema import RolloutCompleted, TrainStepDone, WeightsApplied, decode  # noqa: E402
from rollout_bus.launch.config import RunConfig  # noqa: E402
from rollout_bus.launch.job import resolve_model, run_job, task_options  # noqa: E402


@dataclass
class ModeFigures:
    mode: str
    wall_s: float
    step_s: float
    rollout_wait_s: float
    train_s: float
    publish_s: float
    apply_s: float
    serving_wait_s: float
    rollout_tokens_per_s: float
    trainer_tokens_per_s: float
    rollout_s: float
    staleness: dict[int, int] = field(default_factory=dict)


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def figures(url: str, namespace: str, mode: str, warmup: int, wall_s: float) -> ModeFigures:
    client = connect(url)
    keys = Keys(namespace)
    try:
        steps = sorted((e for e in (decode(f) for _, f in page(client, keys.trainer_stream))
                        if isinstance(e, TrainStepDone)), key=lambda e: e.step)
        rollouts = [e for e in (decode(f) for _, f in page(client, keys.rollout_stream))
                    if isinstance(e, RolloutCompleted)]
        applied = [e for stream in weight_streams(client, keys) for e in (decode(f) for _, f in page(client, stream))
                   if isinstance(e, WeightsApplied) and e.version > 0]
    finally:
        client.close()
    steady = steps[warmup:-1] if len(steps) > warmup + 1 else steps[1:]
    previous = {e.step: e for e in steps}
    intervals = [(e.ts_ms - previous[e.step - 1].ts_ms) / 1000 for e in steady if e.step - 1 in previous]
    tokens = [e.metrics.get("response_len_mean", 0.0) * e.n_samples for e in rollouts]
    seconds = [e.duration_ms / 1000 for e in rollouts]
    hist: dict[int, int] = {}
    for e in steady:
        for k, v in e.metrics.items():
            if k.startswith("staleness_n"):
                hist[int(k[len("staleness_n"):])] = hist.get(int(k[len("staleness_n"):]), 0) + int(v)
    return ModeFigures(
        mode=mode, wall_s=wall_s, step_s=_mean(intervals),
        rollout_wait_s=_mean([e.metrics["wait_ms"] / 1000 for e in steady]),
        train_s=_mean([e.metrics["train_ms"] / 1000 for e in steady]),
        publish_s=_mean([(e.metrics.get("weights_save_ms", 0.0) + e.metrics.get("publish_ms", 0.0)) / 1000
                         for e in steady]),
        apply_s=_mean([e.duration_ms / 1000 for e in applied]),
        serving_wait_s=_mean([e.metrics.get("serving_wait_ms", 0.0) / 1000 for e in steady]),
        rollout_tokens_per_s=sum(tokens) / sum(seconds) if seconds and sum(seconds) > 0 else float("nan"),
        trainer_tokens_per_s=_mean([e.metrics.get("train_tokens_per_s", float("nan")) for e in steps]),
        rollout_s=_mean(seconds), staleness=dict(sorted(hist.items())))


def logprob_agreement(model_dir: Path, task: dict[str, Any], temperature: float, max_new_tokens: int,
                      prompts: int, lora: tuple[int, int]) -> tuple[float, float, int]:
    """Max and mean |engine - learner| over the response tokens of ``prompts`` task prompts, and their count."""
    import torch

    from rollout_bus.executor.convert import to_train_data
    from rollout_bus.executor.sample import Sample, Status
    from rollout_bus.lm import hf
    from rollout_bus.tasks.math_words import MathWordsSource
    from rollout_bus.trainer.config import LossSettings, OptimConfig
    from rollout_bus.trainer.hf_config import HFSettings, LoraSettings
    from rollout_bus.trainer.hf_learner import HFLearner
    from tests.engine_proc import EngineProcess

    torch.set_num_threads(1)
    source = MathWordsSource(**{**task, "split": "eval"})
    items = source.get_samples(prompts)
    with EngineProcess(model_dir, startup_timeout_s=300, extra_args=["--max-batch-size", str(prompts)]) as engine:
        status, replies = engine.post("/generate", {
            "input_ids": [it["prompt_ids"] for it in items], "return_logprob": True,
            "sampling_params": {"temperature": temperature, "max_new_tokens": max_new_tokens,
                                "stop_token_ids": list(source.chat.stop_token_ids), "sampling_seed": 0}},
            timeout_s=600)
    if status != 200:
        raise RuntimeError(f"engine replied {status}: {replies}")
    samples = []
    for k, (item, reply) in enumerate(zip(items, replies, strict=True)):
        entries = reply["meta_info"]["output_token_logprobs"]
        samples.append(Sample(group_index=k, index=k, prompt="", prompt_ids=item["prompt_ids"],
                              response_ids=reply["output_ids"], loss_mask=[1] * len(entries),
                              rollout_log_probs=[e[0] for e in entries], status=Status.COMPLETED, reward=0.0))
    data = to_train_data(samples, rollout_id=0)
    # a fresh LoRA adapter leaves the model's outputs as they are: the trainer's setup in the run
    learner = HFLearner(hf.load_model(model_dir), OptimConfig(), LossSettings(),
                        HFSettings(temperature=temperature, device="cpu", lora=LoraSettings(r=lora[0], alpha=lora[1])))
    recomputed = learner.logprobs(data)
    diffs = torch.cat([(r - torch.tensor(s.rollout_log_probs)).abs() for r, s in zip(recomputed, samples, strict=True)])
    return float(diffs.max()), float(diffs.mean()), int(diffs.numel())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 or a HF model directory")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the step timing")
    p.add_argument("--n-groups", type=int, default=2)
    p.add_argument("--n-samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--lora", default="8,16")
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--logprob-prompts", type=int, default=8, help="0: skip the log-prob agreement check")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    modes = ns.modes.split(",")
    if modes[0] != "sync":
        raise SystemExit("--modes must start with sync (the baseline)")
    load_before = os.getloadavg()
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} "
          f"({os.cpu_count()} CPUs)", flush=True)
    model_dir = resolve_model(ns.model)
    server = private_redis()
    results: dict[str, ModeFigures] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-real-model-") as tmp:
            for mode in modes:
                namespace = f"bench-real-{mode}-{int(time.time())}"
                config = RunConfig(mode=mode, model=str(model_dir), lora=ns.lora, steps=ns.steps, seed=ns.seed,
                                   n_groups=ns.n_groups, n_samples=ns.n_samples, max_new_tokens=ns.max_new_tokens,
                                   temperature=ns.temperature, lr=5e-4, engine_max_batch=64, in_flight=2,
                                   max_staleness=2, eval_groups=0, out=str(Path(tmp) / mode), redis_url=server.url,
                                   namespace=namespace, progress=False, plot=False, timeout_s=900)
                result = run_job(config)
                f = results[mode] = figures(server.url, namespace, mode, ns.warmup, result.wall_s)
                print(f"{mode:>6}: {f.step_s:.2f} s/step (rollout wait {f.rollout_wait_s:.2f} s, train {f.train_s:.2f} s, "
                      f"weight publish {f.publish_s:.3f} s, weight apply {f.apply_s:.3f} s, serving wait "
                      f"{f.serving_wait_s:.2f} s); rollout {f.rollout_tokens_per_s:.1f} tokens/s "
                      f"({f.rollout_s:.2f} s per rollout), trainer {f.trainer_tokens_per_s:.0f} tokens/s; "
                      f"staleness {f.staleness}; run {f.wall_s:.0f} s", flush=True)
    finally:
        server.stop()
    if ns.logprob_prompts > 0:
        r, alpha = (int(x) for x in ns.lora.split(","))
        task = task_options(RunConfig(model=str(model_dir), seed=ns.seed), model_dir)
        worst, mean, n = logprob_agreement(model_dir, task, ns.temperature, ns.max_new_tokens, ns.logprob_prompts,
                                           (r, alpha))
        print(f"engine vs trainer log-probs at T={ns.temperature}: max abs diff {worst:.2e}, mean {mean:.2e} "
              f"over {n} response tokens", flush=True)
    base = results["sync"]
    print()
    print(f"sync step {base.step_s:.2f} s: rollout {base.rollout_wait_s:.2f} s, train {base.train_s:.2f} s, "
          f"weight publish {base.publish_s:.3f} s, weight apply {base.apply_s:.3f} s "
          f"(serving wait {base.serving_wait_s:.2f} s)")
    for mode, f in results.items():
        if mode != "sync":
            print(f"{mode}: {f.step_s:.2f} s/step, speed-up over sync {base.step_s / f.step_s:.2f}x")
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    if max(load_before[0], load_after[0]) > 1.0:
        print("the 1-minute load was above 1: figures only, no verdict")
    else:
        for mode, f in results.items():
            if mode != "sync":
                print(f"verdict: {mode} is {'faster' if f.step_s < base.step_s else 'not faster'} than sync per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
