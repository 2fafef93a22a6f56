"""Where the redis store's time goes on a 64 MiB batch, with a tried writer and the earlier read beside it.

One process plays both sides against a private redis-server (the bench_handoff shape without the
process hop), interleaved round by round:

* put, with one of two writer variants: the store's (the checksum hashed by helper threads while
  every chunk but the header goes out in one scatter-gather send, the header chunk last), and
  each chunk's tensor bytes hashed in this thread right after the chunk is sent (tried, and
  measured slower between processes; kept here as the comparison);
* fetch, as now: ``get`` (each reply's length line read 64 bytes at a time, so the chunk's bytes
  go from the socket straight into the batch's buffer), then ``decode`` (with its verify pass);
* fetch, as before: ``get`` with the reply's length line read 64 KiB at a time (taking part of
  every chunk through the connection's buffer), then ``decode`` with a full verify pass.

Per phase: median wall ms, and CPU ms of this process and of redis-server (``/proc``), which
load from other processes inflates less than wall time.

    python bench/profile_redis.py [--reps 15] [--window 2] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import xxhash  # noqa: E402
from bench_handoff import make_tensors  # noqa: E402
from verdict import OutsideLoad, parse_stat  # noqa: E402

import rollout_bus.events.payload.resp as resp  # noqa: E402
from rollout_bus.events.batch import HASH_CHUNK, EncodedBatch, _combine, decode, encode  # noqa: E402
from rollout_bus.events.connection import connect  # noqa: E402
from rollout_bus.events.embedded import RedisServer  # noqa: E402
from rollout_bus.events.names import Keys  # noqa: E402
from rollout_bus.events.payload.redis import RedisStore, split_chunks  # noqa: E402

TTL_S = 60


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        parsed = parse_stat(f.read())
    return parsed[2] if parsed else 0


def put_inline(store: RedisStore, ref: str, batch: EncodedBatch) -> None:
    """The writer variant that was tried: each chunk's tensor bytes hashed in this thread after it is sent."""
    chunks = split_chunks(batch.buffers, store.chunk_bytes)
    names = [store.keys.payload_chunk(ref, i) for i in range(len(chunks))]
    views = [memoryview(b).cast("B") for b in batch.buffers]
    fields = [i for i, b in enumerate(batch.buffers) if id(b) in batch._fields]  # noqa: SLF001
    starts = [sum(v.nbytes for v in views[:i]) for i in range(len(views))]
    hashers = [xxhash.xxh3_64() for _ in batch._hasher.pieces]  # noqa: SLF001
    pieces = [(starts[i] + j, starts[i] + min(j + HASH_CHUNK, views[i].nbytes), views[i][j:j + HASH_CHUNK])
              for i in fields for j in range(0, views[i].nbytes, HASH_CHUNK)]

    def hash_through(n: int, done: list[int]) -> None:
        while done[0] < len(pieces) and pieces[done[0]][1] <= n:
            hashers[done[0]].update(pieces[done[0]][2])
            done[0] += 1

    def frames(i: int) -> list[bytes | memoryview]:
        size = sum(p.nbytes for p in chunks[i])
        name = names[i].encode()
        return [b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, size), *chunks[i],
                b"\r\n$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(TTL_S)), TTL_S)]

    def send(conn: Any) -> None:
        done = [0]
        hash_through(store.chunk_bytes, done)
        for i in range(1, len(chunks)):
            conn.send(frames(i))
            hash_through((i + 1) * store.chunk_bytes, done)
        hash_through(batch.nbytes, done)
        batch._set_checksum(_combine([h.intdigest() for h in hashers]))  # noqa: SLF001
        conn.send(frames(0))
        store._check_replies(conn, len(chunks))  # noqa: SLF001
    store._raw(send)  # noqa: SLF001


def fetch_before(store: RedisStore, reference: dict[str, Any]) -> Any:
    saved, resp._LINE_READ = resp._LINE_READ, resp._READ_SIZE
    try:
        view = store.get(reference)
    finally:
        resp._LINE_READ = saved
    return decode(view)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="then cProfile 5 rounds of the current paths")
    args = ap.parse_args(argv)
    tensors = make_tensors(64)
    hz = os.sysconf("SC_CLK_TCK")
    with RedisServer() as server, OutsideLoad() as outside:
        assert server.proc is not None
        spid = server.proc.pid
        client = connect(server.url)
        store = RedisStore(client, Keys(f"prof{uuid.uuid4().hex[:6]}"), window=args.window)
        refs: dict[str, Any] = {}

        def put_now(i: int) -> None:
            refs["now"] = store.put(f"p:now{i}", encode(tensors, {"i": i}, defer_checksum=True), TTL_S)

        def put_old(i: int) -> None:
            batch = encode(tensors, {"i": i}, defer_checksum=True)
            ref = f"p:old{i}"
            put_inline(store, ref, batch)
            refs["old"] = {"store": "redis", "ref": ref, "nbytes": batch.nbytes,
                           "chunks": len(split_chunks(batch.buffers, store.chunk_bytes)),
                           "chunk_bytes": store.chunk_bytes}

        phases: dict[str, Callable[[int], object]] = {
            "put (helpers hash while the chunks go out)": put_now,
            "put, tried: hash each chunk after sending it": put_old,
            "fetch (replies received in place), decode": lambda i: decode(store.get(refs["now"])),
            "fetch, before (64 KiB line reads), decode": lambda i: fetch_before(store, refs["old"]),
        }
        wall: dict[str, list[float]] = {k: [] for k in phases}
        cpu: dict[str, list[float]] = {k: [] for k in phases}
        rcpu: dict[str, list[float]] = {k: [] for k in phases}
        for i in range(args.warmup + args.reps):
            for name, fn in phases.items():
                w0, c0, r0 = time.perf_counter(), time.process_time(), cpu_ticks(spid)
                fn(i)
                w1, c1, r1 = time.perf_counter(), time.process_time(), cpu_ticks(spid)
                if i >= args.warmup:
                    wall[name].append(w1 - w0)
                    cpu[name].append(c1 - c0)
                    rcpu[name].append((r1 - r0) / hz)
            store.delete(refs["now"])
            store.delete(refs["old"])
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for i in range(5):
                put_now(i)
                decode(store.get(refs["now"]))
                store.delete(refs["now"])
            prof.disable()
        store.close()
        client.close()
    print(f"64 MiB, redis store window {args.window}; medians of {args.reps} rounds (min); {outside.load.describe()}")
    print(f"{'phase':46} {'wall ms':>14} {'this CPU ms':>14} {'redis CPU ms':>13}")
    for name in phases:
        print(f"{name:46} {statistics.median(wall[name]) * 1e3:7.1f} ({min(wall[name]) * 1e3:5.1f}) "
              f"{statistics.median(cpu[name]) * 1e3:7.1f} ({min(cpu[name]) * 1e3:5.1f}) "
              f"{statistics.median(rcpu[name]) * 1e3:13.0f}")
    if args.profile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
