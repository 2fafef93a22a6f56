"""Turn latency of a multi-turn agent session on the CPU engine, with and without the prefix cache.

A session starts with a ``--system``-token prompt; each turn sends every earlier token again (prompt,
earlier outputs, the new user/tool message of 30-60 tokens) and generates 16-32 tokens (greedy,
``ignore_eos``), as an agent gateway does. Lengths come from the session's seed, so both engines do
the same work. Two engines serve the same model in this process (their scheduler threads, no HTTP):
one with the cache (the default), one with ``--disable-radix-cache``. Each repeat runs one session
on each, turn by turn side by side (which side goes first alternates), so both see the same load.
Every turn is timed to its first token (the prefill: what the cache shortens) and to its last.
Printed per turn: the median over ``--reps`` sessions and the spread (min-max) on each side, and the
ratio of the medians; the load average is printed before and after.

``--lookup`` times the cache's own bookkeeping instead: ``match`` and ``insert`` against a cache
holding many sessions (tensors of one element per layer, so only the index is measured).

    python bench/bench_prefix_cache.py [--model llama|smollm2|DIR] [--hidden-size 256 --layers 4] [--turns 8] [--reps 5]
    python bench/bench_prefix_cache.py --lookup
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rollout_bus.engine.args import parse_args  # noqa: E402
from rollout_bus.engine.prefix_cache import PrefixCache  # noqa: E402
from rollout_bus.engine.protocol import SamplingParams, SequenceSpec  # noqa: E402
from rollout_bus.engine.runtime import Engine  # noqa: E402
from rollout_bus.engine.sequence import Progress, Seq  # noqa: E402


@dataclass(frozen=True)
class Turn:
    first_s: float  # submit to the first new token: the prefill, which the cache shortens
    total_s: float  # submit to the last token
    prompt: int
    cached: int
    output: tuple[int, ...]


def turn(engine: Engine, ids: list[int], new_tokens: int, rid: str) -> Turn:
    """One turn, streamed so that the first token's time is seen."""
    done = threading.Event()
    first: list[float] = []
    final: list[Progress] = []

    def sink(progress: Progress) -> None:
        if not first:
            first.append(time.perf_counter())
        if progress.finish is not None:
            final.append(progress)
            done.set()

    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    seq = Seq(SequenceSpec(rid=rid, input_ids=tuple(ids), params=params, lora=None, seed=0, return_logprob=True,
                           return_text_in_logprobs=False), sink, stream=True)
    started = time.perf_counter()
    engine.scheduler.submit([seq]).result()
    done.wait()
    ended = time.perf_counter()
    return Turn(first[0] - started, ended - started, len(ids), final[0].cached_tokens, final[0].output_ids)


class Session:
    """One agent session on one engine; ``step`` runs its next turn. Lengths come from ``seed`` alone."""

    def __init__(self, engine: Engine, seed: int, system: int, vocab: int, tag: str) -> None:
        self.engine, self.tag, self.vocab = engine, f"{tag}-{seed}", vocab
        self.rng = random.Random(seed)
        self.ids = [1, *(self.rng.randrange(3, vocab) for _ in range(system))]
        self.turns: list[Turn] = []

    def step(self) -> Turn:
        self.ids += [self.rng.randrange(3, self.vocab) for _ in range(self.rng.randint(30, 60))]
        result = turn(self.engine, self.ids, self.rng.randint(16, 32), f"{self.tag}-{len(self.turns)}")
        self.ids += result.output
        self.turns.append(result)
        return result


def model_dir(spec: str, tmp: Path, hidden: int, layers: int) -> Path:
    if spec == "llama":
        from rollout_bus.lm import hf

        return hf.write_random_llama(tmp / "llama", seed=0, hidden_size=hidden, layers=layers,
                                     intermediate_size=4 * hidden, heads=max(1, hidden // 64),
                                     kv_heads=max(1, hidden // 128), max_positions=2048)
    if spec == "smollm2":
        from rollout_bus.lm.prepare import prepare

        return prepare("smollm2")
    return Path(spec)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f} ({min(values) * 1000:.0f}-{max(values) * 1000:.0f})"


def sessions(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        path = model_dir(args.model, Path(tmp), args.hidden_size, args.layers)
        engines = {"cached": Engine(parse_args(["--model-path", str(path)])),
                   "uncached": Engine(parse_args(["--model-path", str(path), "--disable-radix-cache"]))}
        model = engines["cached"].model
        params = sum(p.numel() for p in model.base.parameters())
        vocab = min(model.vocab_size, 30000)
        print(f"model {args.model} ({model.kind}, {params / 1e6:.1f}M parameters), float32, 1 torch thread; "
              f"{args.turns} turns, first prompt {args.system + 1} tokens + 30-60 per turn, 16-32 new tokens "
              f"(greedy); {args.reps} sessions per side, advanced turn by turn side by side (order alternating)")
        for engine in engines.values():
            engine.start()
            warm = Session(engine, 10_000, args.system, vocab, "warm")
            warm.step()
            warm.step()
        runs: dict[str, list[Session]] = {"cached": [], "uncached": []}
        for rep in range(args.reps):
            pair = {side: Session(engine, rep, args.system, vocab, side) for side, engine in engines.items()}
            for k in range(args.turns):
                order = ("cached", "uncached") if (rep + k) % 2 == 0 else ("uncached", "cached")
                for side in order:
                    pair[side].step()
            for side, s in pair.items():
                runs[side].append(s)
        for engine in engines.values():
            engine.stop()
    print("median (min-max) over sessions, ms; ratio: without / with, of the medians")
    print(f"{'turn':>4} {'prompt':>6} {'cached':>6} | {'first token with':>16} {'without':>16} {'ratio':>5} | "
          f"{'whole turn with':>18} {'without':>18} {'ratio':>5}")
    for k in range(args.turns):
        with_, without = ([s.turns[k] for s in runs[side]] for side in ("cached", "uncached"))
        first = [t.first_s for t in with_], [t.first_s for t in without]
        total = [t.total_s for t in with_], [t.total_s for t in without]
        print(f"{k + 1:>4} {statistics.median(t.prompt for t in with_):>6.0f} "
              f"{statistics.median(t.cached for t in with_):>6.0f} | {spread(first[0]):>16} {spread(first[1]):>16} "
              f"{statistics.median(first[1]) / statistics.median(first[0]):>5.2f} | {spread(total[0]):>18} "
              f"{spread(total[1]):>18} {statistics.median(total[1]) / statistics.median(total[0]):>5.2f}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


def lookup(args: argparse.Namespace) -> int:
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    rng = random.Random(0)
    layers = [(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))] * 30
    for entries in (10, 100, 1000):
        cache = PrefixCache(10**9)
        stored = [[rng.randrange(50000) for _ in range(args.entry_tokens)] for _ in range(entries)]
        for tokens in stored:
            cache.insert(("0", None), tokens, layers, generation=0)
        queries = [rng.choice(stored) + [rng.randrange(50000) for _ in range(45)] for _ in range(200)]
        misses = [[rng.randrange(50000) for _ in range(args.entry_tokens)] for _ in range(200)]
        runs: dict[str, list[float]] = {"hit": [], "miss": [], "insert": []}
        for _ in range(args.reps):
            started = time.perf_counter()
            for q in queries:
                cache.match(("0", None), q, len(q) - 1)
            runs["hit"].append((time.perf_counter() - started) / len(queries))
            started = time.perf_counter()
            for q in misses:
                cache.match(("0", None), q, len(q) - 1)
            runs["miss"].append((time.perf_counter() - started) / len(misses))
            fresh = PrefixCache(10**9)
            started = time.perf_counter()
            for q in queries:
                fresh.insert(("0", None), q, layers, generation=0)
            runs["insert"].append((time.perf_counter() - started) / len(queries))
        print(f"{entries:>5} entries of {args.entry_tokens} tokens: " + ", ".join(
            f"{name} {statistics.median(v) * 1e6:.1f} us ({min(v) * 1e6:.1f}-{max(v) * 1e6:.1f})"
            for name, v in runs.items()))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama", help="llama (random, written here), smollm2 (prepared once) or a "
                                                    "HF model directory")
    p.add_argument("--hidden-size", type=int, default=256, help="the random Llama's width")
    p.add_argument("--layers", type=int, default=4, help="the random Llama's depth")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system", type=int, default=100, help="tokens of the first prompt before the first message")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--lookup", action="store_true", help="time match/insert of the cache's index instead")
    p.add_argument("--entry-tokens", type=int, default=600, help="--lookup: tokens per cached session")
    args = p.parse_args(argv)
    return lookup(args) if args.lookup else sessions(args)


if __name__ == "__main__":
    sys.exit(main())
