"""Decode throughput of the CPU engine on a real model against what the machine allows, measured in the same run.

The model is SmolLM2-135M-Instruct by default (``rollout-bus prepare-model smollm2``: float32, 135M
parameters, 538 MB of weights with the tied embedding counted once). Every repetition measures, in turn:

- a copy-bandwidth probe: ``copy_`` of a 512 MB float32 tensor into another, 512 MB over the time it
  took (the issue's convention; STREAM counts the bytes read and written, twice this, also printed).
  A decode step reads every weight once, so the **bandwidth limit** is ``batch * bandwidth / weight
  bytes`` tokens/s. (With STREAM's figure the limit is twice as high; the compute limit, below, is
  then the lower of the two on this machine in float32.)
- a matmul probe: a 2048 x 2048 float32 matmul, GFLOP/s. A token costs ``2 * parameters`` FLOPs,
  so the **compute limit** is ``GFLOP/s / (2 * parameters)`` tokens/s at any batch;
- the engine: its scheduler in this process (no HTTP), ``B`` sequences submitted at once and timed
  until each has ``--tokens`` new tokens (greedy, prefill included; bench/bench_hf_decode.py);
- with ``--no-packed``, a second engine started with ``--no-packed`` (every linear layer on plain
  ``F.linear``, the decode step module by module): the engine's own fallback, on the same prompts;
- ``model.generate`` on the same prompts (left-padded, ``min_new_tokens = max_new_tokens``);
- the outside anchor, when ``llama-cpp-python`` is installed (the ``bench`` extra): llama.cpp decoding
  the same model from a GGUF file (``--gguf``; default: the prepared model's own GGUF, which is Q4_1,
  so it reads ~6x fewer weight bytes per step than float32), ``B`` sequences in one ``llama_batch``,
  greedy. When it is not installed or cannot load the file, the reason is printed instead.

Every side runs with ``--threads`` torch (or llama.cpp) threads, set here and printed. Medians over
``--reps`` are printed, and a verdict on the engine's tokens/s over the bandwidth limit at the largest
batch (target >= 0.6; per repetition, each against its own probe), judged on outside load by
bench/verdict.py.

    python bench/bench_decode_limits.py [--model smollm2|DIR] [--batches 1 16] [--tokens 32] [--reps 5] [--threads 2]
        [--no-packed] [--no-generate] [--profile ROWS]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_hf_decode import engine_run, generate_run, prompts  # noqa: E402
from verdict import OutsideLoad, Row, Target, reasons, table  # noqa: E402

from rollout_bus.engine.args import parse_args  # noqa: E402
from rollout_bus.engine.runtime import Engine  # noqa: E402
from rollout_bus.lm import hf  # noqa: E402

TARGET = Target(">=", 0.6)
PLAIN = "engine --no-packed"


def median_time(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_gbps(megabytes: int = 512) -> float:
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.zeros_like(src)
    return src.numel() * 4 / median_time(lambda: dst.copy_(src), 5) / 1e9


def matmul_gflops(n: int = 2048) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / median_time(lambda: a @ b, 5) / 1e9


def profile_engine(engine: Engine, batch: list[list[int]], tokens: int, rows: int) -> None:
    """One engine run of ``batch`` under ``torch.profiler`` (CPU, every thread): its wall time and the top
    ``rows`` operators by self CPU time, with their input shapes."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    every_thread = _ExperimentalConfig(profile_all_threads=True)  # the engine steps on its scheduler's thread
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, experimental_config=every_thread) as prof:
        took = engine_run(engine, batch, tokens, "profile")
    steps = tokens  # the prefill and tokens - 1 decode steps
    print(f"profile: batch {len(batch)}, {tokens} tokens a row in {took * 1000:.0f} ms under the profiler "
          f"({took * 1000 / steps:.1f} ms a step, the prefill averaged in)")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=rows,
                                                             max_name_column_width=40, max_shapes_column_width=60))


def weight_bytes(model: Any) -> tuple[int, int]:
    """Bytes and count of the distinct parameters (a tied embedding once)."""
    seen = {p.data_ptr(): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in seen.values()), sum(p.numel() for p in seen.values())


def model_dir(spec: str) -> Path:
    if spec == "smollm2":
        from rollout_bus.lm.prepare import prepare

        return prepare("smollm2")
    return Path(spec)


def default_gguf(spec: str) -> Path | None:
    if spec != "smollm2":
        return None
    from rollout_bus.lm.prepare import MODELS, PrepareError, locate_gguf

    try:
        return locate_gguf(MODELS["smollm2"])
    except PrepareError:
        return None


class LlamaCpp:
    """Batched greedy decoding with llama.cpp (``llama-cpp-python``'s low-level API): one sequence id per row,
    one unified KV cache."""

    def __init__(self, gguf: Path, threads: int, max_batch: int, context: int, repack: bool = False) -> None:
        import llama_cpp

        self.lib = lib = llama_cpp
        self._quiet = lib.llama_log_callback(lambda level, text, data: None)  # referenced: C keeps the pointer
        lib.llama_log_set(self._quiet, None)
        lib.llama_backend_init()
        model_params = lib.llama_model_default_params()
        # no "extra" buffer types unless asked (--llama-repack): with them llama.cpp repacks the weights for AMX
        # when the CPU flags list it, and on this VM the first llama_decode then dies with SIGSEGV (the tiles
        # are listed, not usable); they also hold llama.cpp's other CPU repacks, which a healthy host may want
        model_params.use_extra_bufts = repack
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama_model_load_from_file failed on {gguf}")
        params = lib.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = max_batch * context
        params.n_seq_max = max_batch
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch = lib.llama_batch_init(max_batch * context, 0, max_batch)
        self.outputs: list[list[int]] = []

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """``items``: (token, position, sequence, wants logits)."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, index: int) -> int:
        import numpy as np

        row = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, index), shape=(self.vocab,))
        return int(row.argmax())

    def run(self, batch: list[list[int]], tokens: int) -> float:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        started = time.perf_counter()
        items, last = [], []
        for seq, prompt in enumerate(batch):
            items += [(t, pos, seq, pos == len(prompt) - 1) for pos, t in enumerate(prompt)]
            last.append(len(items) - 1)
        self._decode(items)
        nxt = [self._argmax(i) for i in last]
        self.outputs = [[t] for t in nxt]
        positions = [len(p) for p in batch]
        for _ in range(tokens - 1):
            self._decode([(nxt[s], positions[s], s, True) for s in range(len(batch))])
            nxt = [self._argmax(s) for s in range(len(batch))]
            for out, t in zip(self.outputs, nxt, strict=True):
                out.append(t)
            positions = [p + 1 for p in positions]
        return time.perf_counter() - started


def llama_cpp_anchor(gguf: Path | None, threads: int, max_batch: int, context: int,
                     repack: bool = False) -> tuple[LlamaCpp | None, str]:
    if gguf is None or not gguf.is_file():
        return None, f"no GGUF file ({gguf})"
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return None, f"llama-cpp-python is not installed ({exc}); pip install -e '.[bench]'"
    try:
        return (LlamaCpp(gguf, threads, max_batch, context, repack),
                f"{gguf.name}{', repacked' if repack else ', without extra buffer types (no repacking)'}")
    except Exception as exc:  # whatever llama.cpp says, the bench goes on without the anchor
        return None, f"llama.cpp could not load {gguf.name}: {exc}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (prepared once) or a Hugging Face model directory")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="torch threads for every side (and llama.cpp's)")
    p.add_argument("--gguf", default=None, help="GGUF file for the llama.cpp anchor (default: the model's own)")
    p.add_argument("--no-generate", action="store_true", help="leave model.generate out")
    p.add_argument("--no-packed", action="store_true",
                   help="also run a second engine with --no-packed (plain F.linear, the decode step module by "
                        "module) as its own side, on the same prompts")
    p.add_argument("--llama-repack", action="store_true",
                   help="let llama.cpp repack the weights for its extra CPU buffer types (AMX and others; off: "
                        "they crash this VM)")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="after the measurements, one engine run at the largest batch under torch.profiler: the "
                        "top ROWS operators by self CPU time (all threads, the scheduler's included)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = model_dir(args.model)
    model = hf.load_model(path)
    nbytes, params = weight_bytes(model)
    batch_max = max(args.batches)
    engine = Engine(parse_args(["--model-path", str(path), "--max-batch-size", str(batch_max),
                                "--torch-threads", str(args.threads)]))
    engine.start()
    plain = None
    if args.no_packed:
        plain = Engine(parse_args(["--model-path", str(path), "--max-batch-size", str(batch_max),
                                   "--torch-threads", str(args.threads), "--no-packed"]))
        plain.start()
    gguf = Path(args.gguf) if args.gguf else default_gguf(args.model)
    anchor, anchor_note = llama_cpp_anchor(gguf, args.threads, batch_max, 32 + args.tokens, args.llama_repack)
    print(f"model {path.name}: {params / 1e6:.1f}M parameters, {nbytes / 1e6:.0f} MB of float32 weights; "
          f"{args.tokens} new tokens per row, greedy, prefill included; torch threads {torch.get_num_threads()} "
          f"(engine --torch-threads {args.threads}); {args.reps} reps; {os.cpu_count()} CPUs; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at start")
    print(f"llama.cpp anchor: {'on ' + anchor_note if anchor is not None else 'skipped: ' + anchor_note}")
    engine_run(engine, prompts(2), 4, "warm")
    if plain is not None:
        engine_run(plain, prompts(2), 4, "warm")
    generate_run(model, prompts(2), 4)
    if anchor is not None:
        anchor.run(prompts(2), 4)
    sides = (["engine"] + ([] if plain is None else [PLAIN]) + ([] if args.no_generate else ["generate"])
             + ([] if anchor is None else ["llama.cpp"]))
    rates: dict[int, dict[str, list[float]]] = {b: {s: [] for s in (*sides, "bw limit", "compute limit")}
                                                for b in args.batches}
    probes: dict[str, list[float]] = {"copy GB/s (512 MB copied / s)": [], "matmul GFLOP/s": []}
    with OutsideLoad() as outside:
        for rep in range(args.reps):
            for batch_size in args.batches:
                batch = prompts(batch_size, seed=batch_size)
                bw, flops = copy_gbps(), matmul_gflops()
                probes["copy GB/s (512 MB copied / s)"].append(bw)
                probes["matmul GFLOP/s"].append(flops)
                rates[batch_size]["bw limit"].append(batch_size * bw * 1e9 / nbytes)
                rates[batch_size]["compute limit"].append(flops * 1e9 / (2 * params))
                order = sides if rep % 2 == 0 else sides[::-1]
                for side in order:
                    if side == "engine":
                        took = engine_run(engine, batch, args.tokens, f"b{batch_size}-{rep}")
                    elif side == PLAIN:
                        assert plain is not None
                        took = engine_run(plain, batch, args.tokens, f"b{batch_size}-{rep}")
                    elif side == "generate":
                        took = generate_run(model, batch, args.tokens)
                    else:
                        assert anchor is not None
                        took = anchor.run(batch, args.tokens)
                    rates[batch_size][side].append(batch_size * args.tokens / took)
    if args.profile:
        profile_engine(engine, prompts(batch_max, seed=batch_max), args.tokens, args.profile)
    engine.stop()
    if plain is not None:
        plain.stop()
    print("probes (median): " + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in probes.items())
          + f"; STREAM copy (read + written) {2 * statistics.median(probes['copy GB/s (512 MB copied / s)']):.1f} GB/s")
    columns = [*sides, "bw limit", "compute limit"]
    print(f"{'batch':>5} " + " ".join(f"{c + ' tok/s':>20}" for c in columns) + f" {'engine/bw limit':>16}")
    rows: list[Row] = []
    for batch_size in args.batches:
        r = rates[batch_size]
        fractions = [e / lim for e, lim in zip(r["engine"], r["bw limit"], strict=True)]
        print(f"{batch_size:>5} " + " ".join(f"{statistics.median(r[c]):>20.1f}" for c in columns)
              + f" {statistics.median(fractions):>16.2f}")
        rows.append(Row("decode_limits", f"engine tok/s / bandwidth limit, batch {batch_size}", fractions,
                        TARGET if batch_size == batch_max else None, outside.load))
        rows.append(Row("decode_limits", f"engine tok/s / compute limit, batch {batch_size}",
                        [e / lim for e, lim in zip(r["engine"], r["compute limit"], strict=True)], None, outside.load))
        if plain is not None:
            rows.append(Row("decode_limits", f"engine tok/s / engine --no-packed tok/s, batch {batch_size}",
                            [e / q for e, q in zip(r["engine"], r[PLAIN], strict=True)], None, outside.load))
    print()
    print(table(rows))
    for line in reasons(rows):
        print(line)
    print(f"{outside.load.describe()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at end")
    return {"rows": rows, "rates": rates, "probes": probes, "anchor": anchor_note if anchor is not None else None}


if __name__ == "__main__":
    main()
