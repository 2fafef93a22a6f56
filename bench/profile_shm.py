"""cProfile of the shm or memfd store's hot path: ``BatchChannel.publish`` then ``fetch`` + touch of a 64 MiB batch.

One process plays both sides (the bench_handoff shape without the process hop), so the profile
shows where the time of a hand-off goes: encode and checksum, the copy into the segment, the
mapping, the checksum verify, the touch. ``--store memfd`` profiles the memfd store as a producer
uses it: ``allocate`` a draft, copy the tensors into it, ``publish`` (seal), then fetch + touch
and the last release (the segment server drops it). ``--pool N``: the memfd store's pool prepares
N segments ahead of need (0: none, every draft in a fresh segment); after each round the profile
pauses until the pool has refilled, so that the figures are the batch's path alone, and the time
the pool's thread took per segment is printed beside them.

    python bench/profile_shm.py [--reps 20] [--store shm|memfd] [--pool 2] [--reads private|shared] [--top 15]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_handoff import make_tensors, touch_tensors  # noqa: E402

from rollout_bus.events.batches import BatchChannel  # noqa: E402
from rollout_bus.events.connection import connect  # noqa: E402
from rollout_bus.events.embedded import RedisServer  # noqa: E402
from rollout_bus.events.names import Keys  # noqa: E402
from rollout_bus.events.payload.memfd import MemfdStore  # noqa: E402
from rollout_bus.events.payload.memfd_segments import MemfdSettings  # noqa: E402
from rollout_bus.events.payload.shm import ShmStore  # noqa: E402
from rollout_bus.events.publish import Publisher  # noqa: E402
from rollout_bus.events.schema import BatchReady, Producer, decode_as  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--store", default="shm", choices=["shm", "memfd"])
    ap.add_argument("--reads", default="private", choices=["private", "shared"])
    ap.add_argument("--pool", type=int, default=MemfdSettings().pool_segments,
                    help="memfd: segments its pool prepares ahead of need (0: none)")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    tensors = make_tensors(64)
    root = tempfile.mkdtemp(prefix="profile-shm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    with RedisServer() as server:
        client = connect(server.url)
        keys = Keys(f"prof{uuid.uuid4().hex[:6]}")
        store: ShmStore | MemfdStore = (MemfdStore(keys, settings=MemfdSettings(pool_segments=args.pool))
                                        if args.store == "memfd" else
                                        ShmStore(keys, root, reads=args.reads))  # type: ignore[arg-type]
        channel = BatchChannel(client, keys, store, Publisher(client, keys, Producer("bench", "p0")))
        stream = keys.batch_stream("bench")
        prof = cProfile.Profile()
        took = 0.0
        for i in range(args.reps + 2):
            if i >= 2:
                prof.enable()
            t0 = time.perf_counter()
            if args.store == "memfd":
                draft = channel.allocate("bench", {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()},
                                         {"rep": i})
                for k, t in tensors.items():
                    draft[k].copy_(t)
                channel.publish("bench", f"b{i}", draft)
            else:
                channel.publish("bench", f"b{i}", tensors, {"rep": i})
            event = decode_as(BatchReady, client.xrevrange(stream, count=1)[0][1])
            batch = channel.fetch(event)
            touch_tensors(batch.tensors.values())
            del batch
            store.delete(event.payload)
            if i >= 2:
                prof.disable()
                took += time.perf_counter() - t0
            if isinstance(store, MemfdStore):
                store.pool.wait_idle(30)  # outside the profile: the pool refills between batches
        per = took / args.reps * 1e3
        pool = ""
        if isinstance(store, MemfdStore) and args.pool:
            st = store.pool.stats
            prep = sorted(st.prepare_s)[len(st.prepare_s) // 2] * 1e3 if st.prepare_s else 0.0
            pool = (f"; pool of {args.pool}: {st.hits} batches took a prepared segment, {st.misses} a fresh one, "
                    f"{prep:.1f} ms to prepare one (median, in its thread)")
        print(f"{args.store} store reads={args.reads}: {per:.1f} ms per publish + fetch + touch under the profiler "
              f"(64 MiB, {args.reps} reps){pool}; load average {os.getloadavg()[0]:.2f}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
        if isinstance(store, ShmStore):
            store.clear_pool()
        channel.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
