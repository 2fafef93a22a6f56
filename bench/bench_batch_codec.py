"""Encode + decode (with the xxh3 checksum) of a 64 MiB batch against a plain memcpy of its bytes.

``encode`` is zero-copy (header + views of the tensors) and hashes the tensor bytes;
``decode`` builds tensors over a buffer with ``torch.frombuffer`` and verifies the hash.
The baseline copies the same bytes (from the tensors' memory, which encode reads too)
into a preallocated numpy buffer. Figures are medians
of ``--reps`` after warm-up, all variants interleaved in one run; "speed vs memcpy" is memcpy time / codec time
(the target is >= 0.75). Variants show the hash with one thread and with the default
thread count (xxhash releases the GIL, so pieces hash in parallel).

Usage: python bench/bench_batch_codec.py [--reps 30] [--mib 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import rollout_bus.events.batch as batch_mod  # noqa: E402
from rollout_bus.events.batch import decode, encode  # noqa: E402


def make_tensors(total_mib: int) -> dict[str, torch.Tensor]:
    n = (total_mib << 20) // 4
    g = torch.Generator().manual_seed(0)
    return {
        "tokens": torch.randint(0, 150_000, (n // 4,), dtype=torch.int32, generator=g),
        "positions": torch.randint(0, 1 << 40, (n // 8,), dtype=torch.int64, generator=g),
        "log_probs": torch.randn(n // 4, generator=g, dtype=torch.float32),
        "advantages": torch.randn(n // 2, generator=g).to(torch.bfloat16),
    }


def interleaved_ms(variants: dict[str, Callable[[], object]], reps: int,
                   warmup: int = 5) -> dict[str, tuple[float, float]]:
    """Median and min ms of each variant, run round-robin so that load from other processes hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(warmup + reps):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(v) * 1e3, min(v) * 1e3) for name, v in times.items()}


def with_threads(n: int, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        saved, batch_mod.MAX_HASH_THREADS = batch_mod.MAX_HASH_THREADS, n
        try:
            return fn()
        finally:
            batch_mod.MAX_HASH_THREADS = saved
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()

    tensors = make_tensors(args.mib)
    enc = encode(tensors, {"policy": "bench", "rollout_id": 1})
    wire = np.empty(enc.nbytes, dtype=np.uint8)
    enc.write_into(wire.data)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    srcs = [t.reshape(-1).view(torch.uint8).numpy() for t in tensors.values()]  # the tensors' own memory
    dst = np.empty(nbytes, dtype=np.uint8)
    dst[:] = 0

    def memcpy() -> None:
        pos = 0
        for src in srcs:
            np.copyto(dst[pos:pos + src.nbytes], src)
            pos += src.nbytes

    def codec() -> None:
        encode(tensors, {"policy": "bench", "rollout_id": 1})
        decode(wire.data)

    def codec_copy() -> None:
        e = encode(tensors, {"policy": "bench", "rollout_id": 1})
        e.write_into(wire.data)
        decode(wire.data)

    def codec_copy_overlapped() -> None:
        e = encode(tensors, {"policy": "bench", "rollout_id": 1}, defer_checksum=True)
        e.write_into(wire.data)  # hashes in the background while numpy copies, as the stores do
        decode(wire.data)

    print(f"{nbytes / 2**20:.0f} MiB in {len(tensors)} tensors (int32, int64, float32, bfloat16); median of "
          f"{args.reps}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    threads = batch_mod.MAX_HASH_THREADS
    variants: dict[str, Callable[[], object]] = {"memcpy (np.copyto into a preallocated buffer)": memcpy}
    for label, n in ((f"{threads} hash threads", threads), ("1 hash thread", 1)):
        variants[f"encode + decode, checksum, {label}"] = with_threads(n, codec)
        variants[f"  encode only, {label}"] = with_threads(n, lambda: encode(tensors, {}))
        variants[f"  decode only, {label}"] = with_threads(n, lambda: decode(wire.data))
    variants["decode without verifying the checksum"] = lambda: decode(wire.data, verify=False)
    variants["encode + copy into one buffer + decode"] = codec_copy
    variants["  the same, hash overlapped with the copy"] = codec_copy_overlapped
    rows = list(interleaved_ms(variants, args.reps).items())
    base, base_min = rows[0][1]
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    print()
    print(f"{'':48} {'median ms':>9} {'GB/s':>6} {'vs memcpy':>9} {'min ms':>7} {'vs memcpy':>9}")
    for label, (ms, best) in rows:
        print(f"{label:48} {ms:9.2f} {nbytes / ms / 1e6:6.2f} {base / ms:9.2f} {best:7.2f} {base_min / best:9.2f}")
    ratio = base / rows[1][1][0]
    print()
    print(f"target: encode+decode >= 0.75 of memcpy speed (medians): {ratio:.2f} -> "
          f"{'met' if ratio >= 0.75 else 'MISSED'}")


if __name__ == "__main__":
    main()
