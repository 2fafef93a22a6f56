"""Decode throughput of the CPU engine on a Hugging Face model against ``model.generate`` of the same model.

A random Llama is written (the tests' small one by default: hidden 64, 2 layers, byte tokenizer).
The engine runs in this process (its scheduler thread, no HTTP): ``B`` sequences are submitted at
once and timed until every one has ``N`` new tokens. ``generate`` gets the same prompts left-padded
in one batch, ``max_new_tokens = min_new_tokens = N``. Both are greedy (``--sampled``: temperature 1
from the full distribution, ``top_k=0, top_p=1`` for ``generate``, whose default would be top-k 50),
float32, one torch thread, prefill included. Runs alternate (engine, generate, generate, engine, ...) and medians are reported,
with the ratio engine / generate (target: >= 0.8 at batch >= 8). No verdict is printed when the
1-minute load average is above 1.

    python bench/bench_hf_decode.py [--batches 1 8 32] [--tokens 64] [--reps 5] [--hidden 64 --layers 2] [--sampled]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rollout_bus.engine.args import parse_args  # noqa: E402
from rollout_bus.engine.protocol import SamplingParams, SequenceSpec  # noqa: E402
from rollout_bus.engine.runtime import Engine  # noqa: E402
from rollout_bus.engine.sequence import Seq  # noqa: E402
from rollout_bus.lm import hf  # noqa: E402


def prompts(batch: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [[1, *torch.randint(3, 259, (int(torch.randint(8, 24, (1,), generator=generator)),),
                               generator=generator).tolist()] for _ in range(batch)]


def engine_run(engine: Engine, batch: list[list[int]], tokens: int, tag: str, sampled: bool = False) -> float:
    done = threading.Event()
    left = [len(batch)]
    lock = threading.Lock()

    def sink(progress: object) -> None:
        if getattr(progress, "finish", None) is not None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    params = SamplingParams(temperature=1.0 if sampled else 0.0, max_new_tokens=tokens, ignore_eos=True)
    seqs = [Seq(SequenceSpec(rid=f"{tag}-{i}", input_ids=tuple(p), params=params, lora=None, seed=0,
                             return_logprob=True, return_text_in_logprobs=False), sink) for i, p in enumerate(batch)]
    started = time.perf_counter()
    engine.scheduler.submit(seqs).result()
    done.wait()
    return time.perf_counter() - started


def generate_run(model: object, batch: list[list[int]], tokens: int, sampled: bool = False) -> float:
    longest = max(len(p) for p in batch)
    ids = torch.full((len(batch), longest), 2, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, prompt in enumerate(batch):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    started = time.perf_counter()
    with torch.no_grad():
        mode = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sampled else {"do_sample": False}
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens,  # type: ignore[attr-defined]
                             min_new_tokens=tokens, pad_token_id=2, **mode)
    elapsed = time.perf_counter() - started
    assert out.shape[1] == longest + tokens
    return elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--sampled", action="store_true", help="sample at temperature 1 instead of greedy")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-hf-decode-") as tmp:
        path = hf.write_random_llama(Path(tmp) / "m", seed=0, hidden_size=args.hidden, layers=args.layers,
                                     intermediate_size=2 * args.hidden, heads=max(1, args.hidden // 16),
                                     kv_heads=max(1, args.hidden // 32))
        engine = Engine(parse_args(["--model-path", str(path), "--max-batch-size", str(max(args.batches))]))
        engine.start()
        model = hf.load_model(path)
        params = sum(t.numel() for t in model.parameters())
        print(f"random Llama: hidden {args.hidden}, {args.layers} layers, {params / 1e6:.2f}M parameters; "
              f"{args.tokens} new tokens, {'sampled' if args.sampled else 'greedy'}, 1 torch thread; {args.reps} reps per side; "
              f"{os.cpu_count()} CPUs, load average {load_start:.2f} at start")
        engine_run(engine, prompts(2), 4, "warm")
        generate_run(model, prompts(2), 4)
        print(f"{'batch':>5} {'engine tok/s':>13} {'generate tok/s':>15} {'engine/generate':>16}")
        ratios: dict[int, float] = {}
        for batch_size in args.batches:
            batch = prompts(batch_size, seed=batch_size)
            times: dict[str, list[float]] = {"engine": [], "generate": []}
            for rep in range(args.reps):
                order = ("engine", "generate") if rep % 2 == 0 else ("generate", "engine")
                for side in order:
                    times[side].append(
                        engine_run(engine, batch, args.tokens, f"b{batch_size}-{rep}", args.sampled) if side == "engine"
                        else generate_run(model, batch, args.tokens, args.sampled))
            rate = {side: batch_size * args.tokens / statistics.median(t) for side, t in times.items()}
            ratios[batch_size] = rate["engine"] / rate["generate"]
            print(f"{batch_size:>5} {rate['engine']:>13.1f} {rate['generate']:>15.1f} {ratios[batch_size]:>16.2f}")
        engine.stop()
    load_end = os.getloadavg()[0]
    print(f"load average {load_end:.2f} at end")
    if max(load_start, load_end) > 1.0:
        print("no verdict: the 1-minute load average was above 1")
    else:
        missed = [b for b, r in ratios.items() if b >= 8 and r < 0.8]
        print("target (>= 0.8 of generate at batch >= 8): " + ("missed at " + str(missed) if missed else "met"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
