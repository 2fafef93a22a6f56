"""Hand-off of one 64 MiB batch (four 16 MiB tensors) from a producer process to a consumer process.

Each figure runs from the moment the producer starts publishing until the consumer has the
batch decoded and has touched every 4 KiB page; medians over ``--reps`` after warm-up.

* ``tcp floor``: the same bytes over one loopback TCP connection (length prefix, then
  scatter-gather send; the consumer ``recv_into``s them into one buffer it reuses).
* each payload store through ``events.batches.BatchChannel``: publish (encode + checksum,
  store put, Lua XADD) -> the consumer's XREADGROUP -> fetch (get + decode + checksum
  verify) -> touch; the consumer then acks and releases, so pooled shm segments recycle.
  The redis store runs over TCP and, as an extra row, over a unix socket.
* ``shm store, unverified``: the default shm store whose consumer skips the checksum
  check, beside the verified one: what that guarantee costs on this path.
* ``memfd`` (``memfd-put``): the memfd store, the producer building the batch in place (publishing
  its tensors), each twice: in fresh segments, their pages faulted in while the batch waits (pool
  off), and in segments its pool prepared ahead of need (``memfd-pool``, ``memfd-put-pool``; each
  round waits for the pool to refill after its hand-off, outside the timing, and the pool's own
  time is printed).
* ``ray``: ``ray.put`` of the four numpy arrays in the producer, ``ray.get`` in an actor
  (skipped if ray cannot be imported or started).

The paths run interleaved (one hand-off of each per round), so load from other processes
on the machine hits them alike; the load average is printed with the table.

Usage: python bench/bench_handoff.py [--reps 15] [--mib 64] [--only tcp,redis,shm,...]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from verdict import OutsideLoad, Row, Target, paired_ratios, reasons, table  # noqa: E402

PAGE = 4096
POLICY = "bench"
GROUP = "bench-consumer"


def make_tensors(total_mib: int) -> dict[str, Any]:
    import torch

    n = (total_mib << 20) // 4
    g = torch.Generator().manual_seed(0)
    return {
        "tokens": torch.randint(0, 150_000, (n // 4,), dtype=torch.int32, generator=g),
        "positions": torch.randint(0, 1 << 40, (n // 8,), dtype=torch.int64, generator=g),
        "log_probs": torch.randn(n // 4, generator=g, dtype=torch.float32),
        "advantages": torch.randn(n // 2, generator=g).to(torch.bfloat16),
    }


def touch(buf: Any) -> int:
    """Read one byte of every 4 KiB page."""
    import numpy as np

    return int(np.frombuffer(buf, dtype=np.uint8)[::PAGE].sum())


def touch_tensors(tensors: Any) -> int:
    total = 0
    for t in tensors:
        total += touch(t.reshape(-1).view(__import__("torch").uint8).numpy())
    return total


# --- tcp floor -----------------------------------------------------------------------------

def tcp_consumer(port: int, out: Any) -> None:
    import numpy as np

    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out.put("ready")
    buf = np.empty(0, dtype=np.uint8)
    while True:
        head = b""
        while len(head) < 8:
            head += s.recv(8 - len(head))
        n = int.from_bytes(head, "little")
        if n == 0:
            break
        if buf.nbytes < n:  # one receive buffer, reused (and so already faulted in) for every message
            buf = np.empty(n, dtype=np.uint8)
        view = memoryview(buf)
        got = 0
        while got < n:
            got += s.recv_into(view[got:], n - got)
        touch(buf)
        out.put(time.perf_counter())
    s.close()


class TcpPath:
    """The floor: the tensor bytes over one loopback TCP connection, scatter-gather, into a receive buffer
    the consumer keeps across messages (what a competent hand-written transport does)."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        from rollout_bus.events.batch import encode

        self.views = [memoryview(b).cast("B") for b in encode(tensors, {}).buffers[1:] if len(b)]
        self.nbytes = sum(v.nbytes for v in self.views)

    def start(self) -> None:
        self.ls = socket.socket()
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(1)
        self.q: Any = mp.get_context("spawn").Queue()
        self.proc = mp.get_context("spawn").Process(target=tcp_consumer, args=(self.ls.getsockname()[1], self.q))
        self.proc.start()
        self.conn, _ = self.ls.accept()
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.q.get(timeout=120)

    def _send(self, frames: list[Any]) -> None:
        from rollout_bus.events.payload.base import write_vectored

        write_vectored(lambda views, _done: self.conn.sendmsg(views), frames)

    def once(self, i: int) -> tuple[float, float | None]:
        t0 = time.perf_counter()
        self._send([memoryview(self.nbytes.to_bytes(8, "little")), *self.views])
        return self.q.get(timeout=60) - t0, None

    def stop(self) -> None:
        self._send([memoryview(bytes(8))])
        self.proc.join(30)
        self.conn.close()
        self.ls.close()


# --- payload stores ------------------------------------------------------------------------

def bus_client(url: str) -> Any:
    """``events.connection.connect``, except for unix sockets (whose redis-py connection takes no keepalive)."""
    import redis

    from rollout_bus.events.connection import connect

    return redis.Redis.from_url(url) if url.startswith("unix://") else connect(url)


def store_consumer(url: str, namespace: str, spec: str, out: Any, stop: Any, verify: bool) -> None:
    from rollout_bus.events.batches import BatchChannel
    from rollout_bus.events.consume import Consumer, ConsumerConfig
    from rollout_bus.events.names import Keys
    from rollout_bus.events.payload import make_store
    from rollout_bus.events.schema import BatchReady

    client = bus_client(url)
    keys = Keys(namespace)
    channel = BatchChannel(client, keys, make_store(spec, client, keys))
    consumer = Consumer(client, keys, keys.batch_stream(POLICY), GROUP, "c0",
                        ConsumerConfig(block_ms=200, claim_every_ms=10**9))
    consumer.ensure_group()
    out.put("ready")
    while not stop.is_set():
        for msg in consumer.read():
            event = msg.event
            assert isinstance(event, BatchReady)
            batch = channel.fetch(event, verify=verify)
            touch_tensors(batch.tensors.values())
            out.put(time.perf_counter())
            del batch
            consumer.ack(msg.id)
            channel.release(event, GROUP)
    channel.close()
    client.close()


class StorePath:
    """``BatchChannel.publish`` here, ``Consumer.read`` + ``BatchChannel.fetch`` + touch in another process."""

    def __init__(self, url: str, spec: str, tensors: dict[str, Any], verify: bool, pool: int | None = None) -> None:
        """``pool``: for the memfd store, how many segments its pool prepares (0: none; None: its default)."""
        self.url, self.spec, self.tensors, self.verify, self.pool = url, spec, tensors, verify, pool

    def start(self) -> None:
        import uuid

        from rollout_bus.events.batches import BatchChannel
        from rollout_bus.events.names import Keys
        from rollout_bus.events.payload import make_store
        from rollout_bus.events.publish import Publisher
        from rollout_bus.events.schema import Producer

        self.namespace = f"bench{uuid.uuid4().hex[:6]}"
        self.client = bus_client(self.url)
        keys = Keys(self.namespace)
        if self.pool is None:
            self.store = make_store(self.spec, self.client, keys)
        else:  # the memfd store with a pool of its own size (settings no spec carries)
            from rollout_bus.events.payload.memfd import MemfdStore
            from rollout_bus.events.payload.memfd_segments import MemfdSettings

            self.store = MemfdStore(keys, settings=MemfdSettings(pool_segments=self.pool))
        self.channel = BatchChannel(self.client, keys, self.store, Publisher(self.client, keys, Producer("bench", "p0")))
        ctx = mp.get_context("spawn")
        self.q: Any = ctx.Queue()
        self.stop_flag = ctx.Event()
        self.proc = ctx.Process(target=store_consumer, args=(self.url, self.namespace, self.spec, self.q,
                                                             self.stop_flag, self.verify))
        self.proc.start()
        self.q.get(timeout=120)

    def once(self, i: int) -> tuple[float, float | None]:
        t0 = time.perf_counter()
        self.channel.publish(POLICY, f"b{i}", self.tensors, {"rep": i})
        t1 = time.perf_counter()
        done = self.q.get(timeout=60)
        self.refill()
        return done - t0, t1 - t0

    def refill(self) -> None:
        """Wait, outside the timing, for a memfd store's pool to prepare the next segments."""
        pool = getattr(self.store, "pool", None)
        if pool is not None and self.pool:
            pool.wait_idle(30)

    def pool_line(self) -> str | None:
        """A memfd pool's hits, misses and the time it took to prepare a segment (off the batch's path)."""
        pool = getattr(self.store, "pool", None)
        if pool is None or not self.pool:
            return None
        st = pool.stats
        prep = f"{statistics.median(st.prepare_s) * 1e3:.1f}" if st.prepare_s else "-"
        return (f"{st.hits} batches took a prepared segment, {st.misses} a fresh one; preparing one took "
                f"{prep} ms (median, in the pool's thread)")

    def stop(self) -> None:
        self.stop_flag.set()
        self.proc.join(30)
        self.channel.delete_expired(0)
        clear = getattr(self.store, "clear_pool", None)
        if clear is not None:
            clear()
            shutil.rmtree(self.store.root, ignore_errors=True)  # type: ignore[attr-defined]
        self.channel.close()
        self.client.close()


class DraftPath(StorePath):
    """The memfd store as a producer uses it: ``BatchChannel.allocate`` a draft in a fresh segment, fill its
    tensors (a copy from the source tensors: the one copy Ray's ``put`` makes too), ``publish`` (which
    seals the segment in place: no copy, no checksum); the consumer reads the sealed segment unverified
    by checksum (the kernel vouches for it), as ``fetch`` does by itself."""

    def once(self, i: int) -> tuple[float, float | None]:
        import torch

        t0 = time.perf_counter()
        draft = self.channel.allocate(POLICY, {k: (tuple(t.shape), t.dtype) for k, t in self.tensors.items()},
                                      {"rep": i})
        for k, t in self.tensors.items():
            torch.Tensor.copy_(draft[k], t)
        self.channel.publish(POLICY, f"b{i}", draft)
        t1 = time.perf_counter()
        done = self.q.get(timeout=60)
        self.refill()
        return done - t0, t1 - t0


# --- ray -----------------------------------------------------------------------------------

class RayPath:
    """``ray.put`` of the four numpy arrays here, ``ray.get`` + touch in an actor process."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        import torch

        self.arrays = [t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
                       for t in tensors.values()]

    def start(self) -> None:
        import numpy as np
        import ray

        ray.init(num_cpus=2, object_store_memory=1 << 30, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR")

        @ray.remote
        class RayConsumer:
            def get(self, refs: list[Any]) -> float:
                for a in ray.get(refs[0]):
                    int(np.frombuffer(a, dtype=np.uint8)[::PAGE].sum())
                return time.perf_counter()

        self.ray = ray
        self.actor = RayConsumer.remote()  # type: ignore[attr-defined]
        ray.get(self.actor.get.remote([ray.put([np.zeros(8, np.uint8)])]))

    def once(self, i: int) -> tuple[float, float | None]:
        t0 = time.perf_counter()
        ref = self.ray.put(self.arrays)
        t1 = self.ray.get(self.actor.get.remote([ref]))
        del ref
        return t1 - t0, None

    def stop(self) -> None:
        self.ray.shutdown()


# --- main ----------------------------------------------------------------------------------

LABELS = {"tcp": "tcp floor (loopback)", "redis": "redis store (tcp)", "redis-unix": "redis store (unix socket)",
          "shm": "shm store (/dev/shm)", "shm-shared": "shm store, reads=shared",
          "shm-unverified": "shm store, unverified", "memfd": "memfd store, built in place",
          "memfd-pool": "memfd store, pooled, built in place", "memfd-put": "memfd store, publish copies",
          "memfd-put-pool": "memfd store, pooled, publish copies", "file": "file store (tmp dir)",
          "ray": "ray object store"}
TWINS = {"memfd": "memfd-pool", "memfd-put": "memfd-put-pool"}
"""``--only memfd`` runs the pooled row beside the unpooled one (and so for ``memfd-put``)."""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the bench and prints its table; returns the medians (ms) by path and the load averages."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--only", default=",".join(LABELS))
    ap.add_argument("--no-verify", action="store_true", help="consumers skip the checksum check on fetch")
    ap.add_argument("--redis-spec", default="redis", help="store spec of the redis rows, e.g. redis?window=8")
    args = ap.parse_args(argv)
    verify = not args.no_verify
    asked = set(args.only.split(","))
    asked |= {TWINS[name] for name in asked if name in TWINS}
    wanted = [name for name in LABELS if name in asked]

    from rollout_bus.events.embedded import RedisServer

    tensors = make_tensors(args.mib)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"hand-off of {nbytes / 2**20:.0f} MiB in {len(tensors)} tensors, producer -> consumer process; "
          f"paths interleaved, median (min) of {args.reps} rounds after {args.warmup} warm-up; "
          f"checksum {'verified' if verify else 'NOT verified'} on fetch; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start")
    outside = OutsideLoad().__enter__()
    sock_dir = tempfile.mkdtemp(prefix="bench-redis-")
    file_root = tempfile.mkdtemp(prefix="bench-file-store-")
    server = RedisServer(extra_args=["--unixsocket", f"{sock_dir}/redis.sock", "--unixsocketperm", "700"]).start()
    makers: dict[str, Callable[[], Any]] = {
        "tcp": lambda: TcpPath(tensors),
        "redis": lambda: StorePath(server.url, args.redis_spec, tensors, verify),
        "redis-unix": lambda: StorePath(f"unix://{sock_dir}/redis.sock?db=0", args.redis_spec, tensors, verify),
        "shm": lambda: StorePath(server.url, "shm", tensors, verify),
        "shm-shared": lambda: StorePath(server.url, "shm?reads=shared", tensors, verify),
        "shm-unverified": lambda: StorePath(server.url, "shm", tensors, False),
        "memfd": lambda: DraftPath(server.url, "memfd", tensors, verify, pool=0),
        "memfd-pool": lambda: DraftPath(server.url, "memfd", tensors, verify, pool=2),
        "memfd-put": lambda: StorePath(server.url, "memfd", tensors, verify, pool=0),
        "memfd-put-pool": lambda: StorePath(server.url, "memfd", tensors, verify, pool=2),
        "file": lambda: StorePath(server.url, f"file:{file_root}", tensors, verify),
        "ray": lambda: RayPath(tensors),
    }
    paths: dict[str, Any] = {}
    skipped: list[str] = []
    totals: dict[str, list[float]] = {}
    publishes: dict[str, list[float]] = {}
    try:
        for name in wanted:
            path = makers[name]()
            try:
                path.start()
            except Exception as exc:  # ray missing or unable to start: skip its row, keep the rest
                if name != "ray":
                    raise
                skipped.append(f"ray: {type(exc).__name__}: {exc}")
                continue
            paths[name] = path
            totals[name], publishes[name] = [], []
        for i in range(args.warmup + args.reps):
            for name, path in paths.items():
                time.sleep(0.03)
                total, publish = path.once(i)
                if i >= args.warmup:
                    totals[name].append(total)
                    if publish is not None:
                        publishes[name].append(publish)
        pool_lines = {name: line for name, path in paths.items()
                      if (line := getattr(path, "pool_line", lambda: None)()) is not None}
    finally:
        for path in paths.values():
            path.stop()
        server.stop()
        shutil.rmtree(file_root, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)

    outside.__exit__(None, None, None)
    load = outside.load
    med = {name: statistics.median(v) * 1e3 for name, v in totals.items()}
    floor, ray_ms = med.get("tcp"), med.get("ray")
    print(f"{load.describe()} while it ran")
    print()
    print(f"{'path':36} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'GB/s':>6} {'publish ms':>11} {'x tcp':>6} "
          f"{'x ray':>6}")
    for name in totals:
        m = med[name]
        pub = f"{statistics.median(publishes[name]) * 1e3:.1f}" if publishes[name] else "-"
        xt = f"{m / floor:.2f}" if floor else "-"
        xr = f"{m / ray_ms:.2f}" if ray_ms else "-"
        print(f"{LABELS[name]:36} {m:10.1f} {min(totals[name]) * 1e3:8.1f} {max(totals[name]) * 1e3:8.1f} "
              f"{nbytes / m / 1e6:6.2f} {pub:>11} {xt:>6} {xr:>6}")
    for name, line in pool_lines.items():
        print(f"{LABELS[name]}: {line}")
    for line in skipped:
        print(f"skipped {line}")
    print()
    rows = []
    if "tcp" in totals:
        for name in ("redis", "redis-unix", "file"):
            if name in totals:
                rows.append(Row("handoff 64 MiB", f"{LABELS[name]} / tcp floor, time",
                                paired_ratios(totals[name], totals["tcp"]),
                                Target("<=", 2.0) if name == "redis" else None, load))
    for name in ("memfd", "memfd-pool", "memfd-put", "memfd-put-pool", "shm", "shm-shared", "shm-unverified"):
        if name not in totals:
            continue
        target = Target("<", 1.0) if name in ("shm", "memfd", "memfd-pool") else None
        if "ray" in totals:
            rows.append(Row("handoff 64 MiB", f"{LABELS[name]} / ray, time", paired_ratios(totals[name], totals["ray"]),
                            target, load))
        elif target is not None:
            rows.append(Row("handoff 64 MiB", f"{LABELS[name]} / ray", [], target, load,
                            note="ray skipped: " + "; ".join(skipped or ["not asked for"])))
    print(table(rows))
    for line in reasons(rows):
        print(line)
    return {"median_ms": med, "load": load, "skipped": skipped, "rows": rows}


if __name__ == "__main__":
    main()
