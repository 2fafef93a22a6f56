"""Encode + decode (with the xxh3 checksum) of a 64 MiB batch against a plain memcpy of its bytes.

``encode`` is zero-copy (header + views of the tensors) and hashes the tensor bytes;
``decode`` builds tensors over a buffer with ``torch.frombuffer`` and verifies the hash.
The baseline copies the same bytes (from the tensors' memory, which encode reads too)
into a preallocated numpy buffer. Figures are medians
of ``--reps`` after warm-up, all variants interleaved in one run; "speed vs memcpy" is memcpy time / codec time
(the target is >= 0.75). The headline is encode + copy into one buffer + decode: every real
store copies the encoded batch once (into shared memory, a file, a socket), so a codec that
is only compared without that copy flatters itself; it runs as the shm store runs it (the
checksum deferred, each piece hashed right after it is copied). Variants show the hash on a labelled
number of threads (the caller plus helpers; xxhash releases the GIL, so pieces hash in
parallel), and how many threads did hash pieces in a probe run is printed, not assumed.

Usage: python bench/bench_batch_codec.py [--reps 30] [--mib 64]
"""

from __future__ import annotations

import _thread
import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import rollout_bus.events.batch as batch_mod  # noqa: E402
from rollout_bus.events.batch import decode, encode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from verdict import OutsideLoad, Row, Target, paired_ratios, reasons, table  # noqa: E402


def make_tensors(total_mib: int) -> dict[str, torch.Tensor]:
    n = (total_mib << 20) // 4
    g = torch.Generator().manual_seed(0)
    return {
        "tokens": torch.randint(0, 150_000, (n // 4,), dtype=torch.int32, generator=g),
        "positions": torch.randint(0, 1 << 40, (n // 8,), dtype=torch.int64, generator=g),
        "log_probs": torch.randn(n // 4, generator=g, dtype=torch.float32),
        "advantages": torch.randn(n // 2, generator=g).to(torch.bfloat16),
    }


def interleaved_times(variants: dict[str, Callable[[], object]], reps: int, warmup: int = 5) -> dict[str, list[float]]:
    """Seconds of each run of each variant, run round-robin so that load from other processes hits all alike
    (round ``i`` of every variant ran back to back: per-round ratios are paired)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(warmup + reps):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def interleaved_ms(variants: dict[str, Callable[[], object]], reps: int,
                   warmup: int = 5) -> dict[str, tuple[float, float]]:
    """Median and min ms of each variant (``interleaved_times``)."""
    return {name: (statistics.median(v) * 1e3, min(v) * 1e3) for name, v in interleaved_times(variants, reps,
                                                                                              warmup).items()}


def with_threads(n: int, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        saved, batch_mod.MAX_HASH_THREADS = batch_mod.MAX_HASH_THREADS, n
        try:
            return fn()
        finally:
            batch_mod.MAX_HASH_THREADS = saved
    return run


def with_copy_step(step: int, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        saved, batch_mod.COPY_STEP = batch_mod.COPY_STEP, step
        try:
            return fn()
        finally:
            batch_mod.COPY_STEP = saved
    return run


def hashing_threads(tensors: dict[str, torch.Tensor], n: int) -> int:
    """How many distinct threads hash pieces of one encode with ``n`` threads allowed (a probe run)."""
    seen: set[int] = set()
    real = batch_mod.xxhash

    class Probe:
        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        @staticmethod
        def xxh3_64_intdigest(data: object) -> int:
            seen.add(threading.get_ident())
            return real.xxh3_64_intdigest(data)  # type: ignore[arg-type]

    batch_mod.xxhash = Probe()  # type: ignore[assignment]
    try:
        with_threads(n, lambda: encode(tensors, {}))()
    finally:
        batch_mod.xxhash = real
    return len(seen)


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Runs the bench and prints its table; returns the headline ratio and the load average."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args(argv)

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

    groups = _split(srcs, dst, batch_mod.MAX_HASH_THREADS)

    def memcpy_threads() -> None:  # the same copy cut into as many parts as the codec may use threads
        done = [threading.Event() for _ in groups[1:]]

        def copy(group: list[tuple[np.ndarray, np.ndarray]], ev: threading.Event | None) -> None:
            for d, src in group:
                np.copyto(d, src)
            if ev is not None:
                ev.set()
        for group, ev in zip(groups[1:], done, strict=True):
            _thread.start_new_thread(copy, (group, ev))
        copy(groups[0], None)
        for ev in done:
            ev.wait()

    def codec() -> None:
        encode(tensors, {"policy": "bench", "rollout_id": 1})
        decode(wire.data)

    def codec_copy() -> None:
        e = encode(tensors, {"policy": "bench", "rollout_id": 1})
        e.write_into(wire.data)
        decode(wire.data)

    def codec_copy_overlapped() -> None:
        e = encode(tensors, {"policy": "bench", "rollout_id": 1}, defer_checksum=True)
        e.write_into(wire.data)  # hashes each piece right after copying it, as the shm store does
        decode(wire.data)

    print(f"{nbytes / 2**20:.0f} MiB in {len(tensors)} tensors (int32, int64, float32, bfloat16); median of "
          f"{args.reps}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    threads = batch_mod.MAX_HASH_THREADS
    outside = OutsideLoad().__enter__()
    used = {n: hashing_threads(tensors, n) for n in sorted({threads, 1})}
    variants: dict[str, Callable[[], object]] = {"memcpy (np.copyto into a preallocated buffer)": memcpy}
    variants["encode + copy into one buffer + decode (headline)"] = codec_copy_overlapped
    if threads > 1:
        variants[f"  memcpy cut in {threads}, one part per thread"] = memcpy_threads
        variants["  the headline with 1 thread allowed"] = with_threads(1, codec_copy_overlapped)
    variants["  the headline as before: 2 MiB copied, then hashed, 1 thread"] = with_threads(
        1, with_copy_step(batch_mod.HASH_CHUNK, codec_copy_overlapped))
    variants["  the same, hashed at encode, before the copy"] = codec_copy
    for n in sorted({threads, 1}, reverse=True):
        label = f"{n} hash thread{'s' if n > 1 else ''} allowed"
        variants[f"encode + decode, no copy, {label}"] = with_threads(n, codec)
        variants[f"  encode only, {label}"] = with_threads(n, lambda: encode(tensors, {}))
        variants[f"  decode only, {label}"] = with_threads(n, lambda: decode(wire.data))
    variants["decode without verifying the checksum"] = lambda: decode(wire.data, verify=False)
    times = interleaved_times(variants, args.reps)
    outside.__exit__(None, None, None)
    load = outside.load
    rows = [(name, (statistics.median(v) * 1e3, min(v) * 1e3)) for name, v in times.items()]
    base, base_min = rows[0][1]
    print(f"{load.describe()}; threads that hashed pieces in a probe encode: "
          + ", ".join(f"{u} of {n} allowed" for n, u in used.items()))
    print()
    print(f"{'':56} {'median ms':>9} {'GB/s':>6} {'vs memcpy':>9} {'min ms':>7} {'vs memcpy':>9}")
    for label, (ms, best) in rows:
        print(f"{label:56} {ms:9.2f} {nbytes / ms / 1e6:6.2f} {base / ms:9.2f} {best:7.2f} {base_min / best:9.2f}")
    names = list(times)
    head = paired_ratios(times[names[0]], times[names[1]])  # memcpy time / codec time, round by round
    no_copy_name = next(k for k in names if k.startswith("encode + decode, no copy"))
    no_copy = paired_ratios(times[names[0]], times[no_copy_name])
    out_rows = [Row("codec 64 MiB", "encode + copy + decode / memcpy, speed", head, Target(">=", 0.75), load),
                Row("codec 64 MiB", "encode + decode without the copy / memcpy, speed", no_copy, None, load)]
    if threads > 1:
        out_rows.append(Row("codec 64 MiB", f"the same / memcpy on {threads} threads, speed",
                            paired_ratios(times[names[2]], times[names[1]]), None, load))
        out_rows.append(Row("codec 64 MiB", "the same on 1 thread / memcpy, speed",
                            paired_ratios(times[names[0]], times[names[3]]), None, load))
    before = next(k for k in names if "as before" in k)
    out_rows.append(Row("codec 64 MiB", "the same as before (2 MiB steps, 1 thread) / memcpy",
                        paired_ratios(times[names[0]], times[before]), None, load))
    print()
    print(table(out_rows))
    for line in reasons(out_rows):
        print(line)
    return {"rows": out_rows, "load": load}


def _split(srcs: list[np.ndarray], dst: np.ndarray, parts: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """The copy of the concatenated ``srcs`` into ``dst`` cut into ``parts`` runs of about equal bytes,
    as (destination, source) views per part."""
    share = -(-sum(s.nbytes for s in srcs) // max(1, parts))
    groups: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(max(1, parts))]
    pos = 0
    for src in srcs:
        i = 0
        while i < src.nbytes:
            n = min(share - pos % share, src.nbytes - i)
            groups[pos // share].append((dst[pos:pos + n], src[i:i + n]))
            pos, i = pos + n, i + n
    return [g for g in groups if g]


if __name__ == "__main__":
    main()
