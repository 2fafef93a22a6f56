"""The trainer's LoRA update against the machine's matmul limit, measured in the same run.

The learner is the main job's: ``trainer.hf_learner.HFLearner`` on SmolLM2-135M-Instruct with the
default adapter (``launch.config.DEFAULT_LORA``, every linear layer), the default micro-batch size,
fused AdamW, one GRPO step per batch. The batch is the shape of a default real-model step: the
task's own prompts (``MathWordsSource``, chat template included), ``--groups`` x ``--samples``
rows with ``--response`` response tokens each (random token ids; the cost of a step does not
depend on which tokens they are), rewards alternating within a group so every row has an advantage.

Every repetition measures, in turn, at ``--threads`` torch threads:

- a matmul probe: a 2048 x 2048 float32 matmul, GFLOP/s;
- ``learner.train_step`` on the batch: tokens (prompt + response, padding left out) per second;
- a bare baseline: what a competent user would write with the same tools, ``model(...)`` on the
  same micro-batches with ``logits_to_keep``, a log-softmax gather, ``backward`` and the same
  AdamW step; no GRPO, no checks.

The **limit** is the issue's convention: a forward and backward pass costs about 6 FLOPs per
parameter per token (all parameters, all tokens), so ``limit = GFLOP/s / (6 * parameters)``
tokens/s. A LoRA step does less than that: the frozen weights need no weight gradient (4 FLOPs per
frozen parameter per token), and the tied 28M-parameter ``lm_head`` runs only on the response
columns (``logits_to_keep``). The FLOPs it really does are counted too (``work``), and the share
of the matmul rate they reach is printed beside the issue's ratio.

    python bench/bench_train_limits.py [--model smollm2|DIR] [--threads 1] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_decode_limits import matmul_gflops, model_dir, weight_bytes  # noqa: E402
from verdict import OutsideLoad, Row, Target, reasons, table  # noqa: E402

from rollout_bus.events.train_data import TrainData  # noqa: E402
from rollout_bus.executor.convert import to_train_data  # noqa: E402
from rollout_bus.executor.sample import Sample, Status  # noqa: E402
from rollout_bus.launch.config import DEFAULT_LORA, MODEL_DEFAULTS, MODEL_TASK, RunConfig  # noqa: E402
from rollout_bus.lm import hf  # noqa: E402
from rollout_bus.tasks.math_words import MathWordsSource  # noqa: E402
from rollout_bus.trainer.config import LossSettings, OptimConfig  # noqa: E402
from rollout_bus.trainer.hf_config import HFSettings, LoraSettings  # noqa: E402
from rollout_bus.trainer.hf_learner import HFLearner, layout, with_lora  # noqa: E402

TARGET = Target(">=", 0.5)


def step_batch(path: Path, groups: int, samples: int, response: int, vocab: int, seed: int = 0) -> TrainData:
    """``groups`` task prompts, ``samples`` rows each with ``response`` random response tokens."""
    rng = random.Random(seed)
    prompts = MathWordsSource(str(path), **{**MODEL_TASK, "split": "train", "seed": seed}).get_samples(groups)
    rows = []
    for g, item in enumerate(prompts):
        for j in range(samples):
            s = Sample(group_index=g, index=g * samples + j, prompt="", prompt_ids=list(item["prompt_ids"]),
                       response_ids=[rng.randrange(vocab) for _ in range(response)], loss_mask=[1] * response,
                       rollout_log_probs=[-2.0] * response, status=Status.COMPLETED)
            s.reward = float(j % 2)
            rows.append(s)
    return to_train_data(rows, rollout_id=0)


def base_params(model: Any) -> int:
    """The model's own parameters (a tied embedding once), the adapter's left out."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return weight_bytes(base)[1] - sum(p.numel() for p in model.parameters() if p.requires_grad)


def flops_of(learner: HFLearner, data: TrainData) -> tuple[float, float]:
    """(the issue's 6 x parameters x tokens, the FLOPs a LoRA step really does) for one step on ``data``.

    Real work per micro-batch (the learner's own, ``HFLearner._chunks``): every token through the body
    (2 forward + 2 backward FLOPs per frozen body parameter; the adapter's own weights 6), the head on the
    kept columns only (logits_to_keep: from the shortest prompt's last token to the row's end), same 2 + 2.
    Attention's score matmuls are left out (sequences of ~120 tokens: under 2% here)."""
    model = learner.model
    head = model.get_base_model().get_output_embeddings().weight.numel()
    adapter = sum(q.numel() for q in learner.trainable)
    params = base_params(model)
    body = params - head  # the tied embedding is a lookup at the input: no FLOPs there
    lay = layout(data)
    tokens = float(lay.padded.attention_mask.sum())
    work = 0.0
    for chunk in learner._chunks(lay, torch.arange(len(data))):
        rows = len(chunk.rows)
        work += rows * chunk.width * (4 * body + 6 * adapter) + rows * (chunk.width - chunk.start) * 4 * head
    return 6 * params * tokens, work


def bare_step(learner: HFLearner, model: Any, optimizer: torch.optim.Optimizer, data: TrainData) -> None:
    """The baseline on the learner's micro-batches: forward with logits_to_keep, gathered log-probs times
    the advantage, backward, AdamW."""
    lay = layout(data)
    batch = lay.padded
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for chunk in learner._chunks(lay, torch.arange(len(data))):
        part, width, start = chunk.rows, chunk.width, chunk.start
        ids = batch.input_ids[part, :width]
        logits = model(input_ids=ids, attention_mask=batch.attention_mask[part, :width],
                       logits_to_keep=width - start, use_cache=False).logits[:, :-1]
        logp = F.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, start + 1:, None]).squeeze(-1)
        mask = batch.loss_mask[part, start:width - 1]
        (-(logp * mask * batch.advantages[part, None]).sum() / batch.loss_mask.sum()).backward()
    optimizer.step()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = RunConfig(**MODEL_DEFAULTS)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (prepared once) or a Hugging Face model directory")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the main job's trainer runs 1)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--groups", type=int, default=cfg.n_groups)
    p.add_argument("--samples", type=int, default=cfg.n_samples)
    p.add_argument("--response", type=int, default=cfg.max_new_tokens, help="response tokens per row")
    p.add_argument("--micro", type=int, default=cfg.micro_batch_size, help="micro-batch size")
    p.add_argument("--lora", default=DEFAULT_LORA, help="R,ALPHA")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = model_dir(args.model)
    hf.quiet()
    r, alpha = (int(x) for x in args.lora.split(","))

    learner = HFLearner(hf.load_model(path), OptimConfig(lr=cfg.lr), LossSettings(),
                        HFSettings(micro_batch_size=args.micro, temperature=cfg.temperature, device="cpu",
                                   lora=LoraSettings(r=r, alpha=alpha)))
    bare = with_lora(hf.load_model(path), LoraSettings(r=r, alpha=alpha))
    bare_opt = torch.optim.AdamW([q for q in bare.parameters() if q.requires_grad], lr=cfg.lr,
                                 fused=bool(learner.optimizer.defaults.get("fused")))
    vocab = int(learner.model.get_base_model().config.vocab_size)
    data = step_batch(path, args.groups, args.samples, args.response, vocab)
    params = base_params(learner.model)
    tokens = float(data.prompt_lengths.sum() + data.response_lengths.sum())
    convention, work = flops_of(learner, data)
    print(f"model {path.name}: {params / 1e6:.1f}M parameters, LoRA r={r} alpha={alpha} on every linear "
          f"({sum(q.numel() for q in learner.trainable) / 1e6:.2f}M trainable); batch {len(data)} rows "
          f"({args.groups} prompts x {args.samples}), prompts {int(data.prompt_lengths.min())}-"
          f"{int(data.prompt_lengths.max())} tokens, {args.response} response tokens, {tokens:.0f} tokens; "
          f"micro-batch {args.micro}; torch threads {torch.get_num_threads()}; {args.reps} reps; "
          f"{os.cpu_count()} CPUs; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at start")
    print(f"FLOPs per step: the convention (6 x parameters x tokens) {convention / 1e9:.1f} G; "
          f"the work a LoRA step does {work / 1e9:.1f} G ({work / convention:.2f} of it)")
    learner.train_step(data)  # warm: allocator, oneDNN kernels
    bare_step(learner, bare, bare_opt, data)
    rates: dict[str, list[float]] = {"learner": [], "bare": [], "limit": [], "gflops": []}
    with OutsideLoad() as outside:
        for rep in range(args.reps):
            flops = matmul_gflops()
            rates["gflops"].append(flops)
            rates["limit"].append(flops * 1e9 / (6 * params))
            for side in (("learner", "bare") if rep % 2 == 0 else ("bare", "learner")):
                t0 = time.perf_counter()
                if side == "learner":
                    metrics = learner.train_step(data)
                    assert metrics["optimizer_steps"] == 1.0, metrics
                else:
                    bare_step(learner, bare, bare_opt, data)
                rates[side].append(tokens / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"matmul probe {med['gflops']:.1f} GFLOP/s -> limit {med['limit']:.0f} tokens/s (6 FLOPs/param/token)")
    for side in ("learner", "bare"):
        step_s = tokens / med[side]
        print(f"{side:>8}: {med[side]:.0f} tokens/s ({step_s:.2f} s/step), {med[side] / med['limit']:.2f} of the limit; "
              f"real work {work / step_s / 1e9:.1f} GFLOP/s, {work / step_s / 1e9 / med['gflops']:.2f} of the matmul rate")
    rows = [
        Row("train_limits", "learner tok/s / limit (6N)",
            [x / lim for x, lim in zip(rates["learner"], rates["limit"], strict=True)], TARGET, outside.load),
        Row("train_limits", "learner real FLOP/s / matmul FLOP/s",
            [x * work / tokens / (g * 1e9) for x, g in zip(rates["learner"], rates["gflops"], strict=True)],
            None, outside.load),
        Row("train_limits", "learner tok/s / bare tok/s",
            [a / b for a, b in zip(rates["learner"], rates["bare"], strict=True)], None, outside.load),
    ]
    print()
    print(table(rows))
    for line in reasons(rows):
        print(line)
    print(f"{outside.load.describe()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at end")
    return {"rows": rows, "rates": rates, "work": work, "convention": convention}


if __name__ == "__main__":
    main()
