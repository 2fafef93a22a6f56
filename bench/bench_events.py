"""Event bus throughput and latency against a bare redis-py loop, on one private redis-server.

A publisher process and a consumer process move ``--n`` events of ``--size`` bytes
through one stream and one consumer group. Two paths, alternated within one run:

- bare:    ``XADD`` per event; ``XREADGROUP COUNT c`` then one ``XACK`` per batch read;
- project: ``events.publish.Publisher.publish`` per event (typed event, msgpack, idempotent
           Lua publish) and ``events.consume.Consumer.run`` (read, decode, handle, ack);
- many:    as project, but ``Publisher.publish_many`` sends ``--batch`` events (each still
           deduplicated) per round trip. The bare loop stays one serial XADD per event, so
           many / bare is not like for like: it shows what batching producers gain.

``--wait-replica`` starts a replica of the server and compares instead, in the same run:

- project: ``Publisher.publish`` per event, acknowledged by the primary alone;
- durable: ``Publisher.publish(durable=True)``: a ``WAIT 1`` behind every event on the same
           connection, acknowledged once the replica has it (what WeightsPublished, BatchReady
           and WeightVersionServing pay with Sentinel).

Each event carries its send time (``time.time_ns``); the consumer takes the one-way latency
when it has the decoded event in hand. Throughput is events / (last receive - first send).

    python bench/bench_events.py [--n 10000] [--reps 5] [--size 1024] [--count 64] [--batch 16] [--wait-replica]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_bus.events.connection import connect  # noqa: E402
from rollout_bus.events.consume import Consumer, ConsumerConfig, Message  # noqa: E402
from rollout_bus.events.embedded import RedisServer  # noqa: E402
from rollout_bus.events.names import Keys  # noqa: E402
from rollout_bus.events.publish import Publisher  # noqa: E402
from rollout_bus.events.schema import Event, Producer, encode  # noqa: E402

GROUP = "bench"
PRODUCER = Producer("bench", "0")
TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class BenchTick(Event):
    """One benchmark event: its send time and an opaque payload."""

    sent_ns: int
    data: bytes


@dataclass(frozen=True)
class Job:
    path: str  # "bare" or "project"
    url: str
    namespace: str
    stream: str
    n: int
    size: int
    count: int
    batch: int = 16
    durable: bool = False


# --- the two paths ------------------------------------------------------------------------

def publish_bare(job: Job, ready: MpEvent, go: MpEvent, out: Any) -> None:
    r = connect(job.url)
    blob = bytes(job.size)
    r.ping()
    ready.set()
    go.wait()
    cpu0 = time.process_time()
    t0 = time.time_ns()
    for _ in range(job.n):
        r.xadd(job.stream, {b"ts": str(time.time_ns()).encode(), b"d": blob})
    out.put(("pub", t0, time.time_ns(), time.process_time() - cpu0))


def publish_project(job: Job, ready: MpEvent, go: MpEvent, out: Any) -> None:
    if job.durable:  # a plain url: the replica to wait for is named here (with Sentinel it is the default)
        os.environ["ROLLOUT_BUS_WAIT_REPLICAS"] = "1"
    client = connect(job.url)
    keys = Keys(job.namespace)
    pub = Publisher(client, keys, PRODUCER)
    durable = job.durable
    blob = bytes(job.size)
    pub.publish(job.stream + ":warmup", BenchTick(producer=PRODUCER, sent_ns=0, data=b""))  # loads the script
    ready.set()
    go.wait()
    cpu0 = time.process_time()
    t0 = time.time_ns()
    for _ in range(job.n):
        pub.publish(job.stream, BenchTick(producer=PRODUCER, sent_ns=time.time_ns(), data=blob), durable=durable)
    out.put(("pub", t0, time.time_ns(), time.process_time() - cpu0))


def publish_project_many(job: Job, ready: MpEvent, go: MpEvent, out: Any) -> None:
    client = connect(job.url)
    pub = Publisher(client, Keys(job.namespace), PRODUCER)
    blob = bytes(job.size)
    pub.publish(job.stream + ":warmup", BenchTick(producer=PRODUCER, sent_ns=0, data=b""))  # loads the script
    ready.set()
    go.wait()
    cpu0 = time.process_time()
    t0 = time.time_ns()
    for start in range(0, job.n, job.batch):
        pub.publish_many(job.stream, [BenchTick(producer=PRODUCER, sent_ns=time.time_ns(), data=blob)
                                      for _ in range(min(job.batch, job.n - start))])
    out.put(("pub", t0, time.time_ns(), time.process_time() - cpu0))


def consume_bare(job: Job, ready: MpEvent, go: MpEvent, out: Any) -> None:
    r = connect(job.url)
    r.ping()
    lat: list[int] = []
    ready.set()
    cpu0 = time.process_time()
    deadline = time.monotonic() + TIMEOUT_S
    while len(lat) < job.n and time.monotonic() < deadline:
        reply: Any = r.xreadgroup(GROUP, "c0", {job.stream: ">"}, count=job.count, block=1000)
        if not reply:
            continue
        entries = reply[0][1]
        for _entry_id, fields in entries:
            lat.append(time.time_ns() - int(fields[b"ts"]))
        r.xack(job.stream, GROUP, *[e[0] for e in entries])
    out.put(("sub", time.time_ns(), lat, time.process_time() - cpu0))


def consume_project(job: Job, ready: MpEvent, go: MpEvent, out: Any) -> None:
    client = connect(job.url)
    consumer = Consumer(client, Keys(job.namespace), job.stream, GROUP, "c0",
                        ConsumerConfig(block_ms=1000, count=job.count))
    consumer.read(block_ms=0)  # group check, own-pending recovery pass
    lat: list[int] = []
    stop = threading.Event()

    def handle(msg: Message) -> None:
        lat.append(time.time_ns() - msg.event.sent_ns)  # type: ignore[attr-defined]
        if len(lat) >= job.n:
            stop.set()

    ready.set()
    cpu0 = time.process_time()
    timer = threading.Timer(TIMEOUT_S, stop.set)
    timer.start()
    consumer.run(handle, stop)
    timer.cancel()
    out.put(("sub", time.time_ns(), lat, time.process_time() - cpu0))


PATHS = {"bare": (publish_bare, consume_bare), "project": (publish_project, consume_project),
         "many": (publish_project_many, consume_project), "durable": (publish_project, consume_project)}


# --- one run ------------------------------------------------------------------------------------

@dataclass
class Result:
    path: str
    rate: float
    p50_ms: float
    p99_ms: float
    pub_cpu_us: float  # CPU time per event of the publisher process, the consumer process, redis-server
    sub_cpu_us: float
    server_cpu_us: float

    @property
    def total_cpu_us(self) -> float:
        return self.pub_cpu_us + self.sub_cpu_us + self.server_cpu_us


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_once(job: Job, server_pid: int) -> Result:
    ctx = mp.get_context("spawn")
    client = connect(job.url)
    client.xgroup_create(job.stream, GROUP, id="$", mkstream=True)
    client.sadd(Keys(job.namespace).registered_groups(job.stream), GROUP)
    out = ctx.Queue()
    ready_pub, ready_sub, go = ctx.Event(), ctx.Event(), ctx.Event()
    pub_fn, sub_fn = PATHS[job.path]
    sub = ctx.Process(target=sub_fn, args=(job, ready_sub, go, out), name=f"{job.path}-consumer")
    pub = ctx.Process(target=pub_fn, args=(job, ready_pub, go, out), name=f"{job.path}-publisher")
    sub.start()
    pub.start()
    try:
        if not (ready_sub.wait(60) and ready_pub.wait(60)):
            raise RuntimeError("bench processes did not start")
        server_cpu0 = process_cpu_s(server_pid)
        go.set()
        got = {kind: rest for kind, *rest in (out.get(timeout=TIMEOUT_S + 10) for _ in range(2))}
    finally:
        for proc in (pub, sub):
            proc.join(10)
            if proc.is_alive():
                proc.kill()  # our own child, by its handle
                proc.join()
    server_cpu = process_cpu_s(server_pid) - server_cpu0
    t0, _pub_end, pub_cpu = got["pub"]
    sub_end, lat, sub_cpu = got["sub"]
    if len(lat) != job.n:
        raise RuntimeError(f"{job.path}: consumer got {len(lat)} of {job.n} events")
    q = statistics.quantiles(lat, n=100)
    client.delete(job.stream, job.stream + ":warmup")
    client.close()
    per_event_us = 1e6 / job.n
    return Result(job.path, job.n / ((sub_end - t0) / 1e9), q[49] / 1e6, q[98] / 1e6,
                  pub_cpu * per_event_us, sub_cpu * per_event_us, server_cpu * per_event_us)


def wire_sizes(size: int) -> tuple[int, int]:
    bare = len(b"ts") + 19 + len(b"d") + size
    project = sum(len(k) + len(v) for k, v in encode(
        BenchTick(producer=PRODUCER, sent_ns=time.time_ns(), data=bytes(size))).items())
    return bare, project


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=10_000, help="events per run")
    p.add_argument("--reps", type=int, default=5, help="runs of each path, alternated")
    p.add_argument("--size", type=int, default=1024, help="payload bytes per event")
    p.add_argument("--count", type=int, default=64, help="XREADGROUP COUNT of both consumers")
    p.add_argument("--batch", type=int, default=16, help="events per publish_many call of the 'many' path")
    p.add_argument("--wait-replica", action="store_true",
                   help="with a replica: publish without WAIT (project) against WAIT 1 per event (durable)")
    args = p.parse_args(argv)

    bare_bytes, project_bytes = wire_sizes(args.size)
    load = os.getloadavg()
    print(f"{args.n} events x {args.reps} reps per path; payload {args.size} B "
          f"(on the wire: bare {bare_bytes} B, project {project_bytes} B); XREADGROUP COUNT {args.count}; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    paths = ["project", "durable"] if args.wait_replica else ["bare", "project", "many"]
    results: dict[str, list[Result]] = {path: [] for path in paths}
    with RedisServer() as server:
        replica = (RedisServer(extra_args=["--replicaof", "127.0.0.1", str(server.port)]).start()
                   if args.wait_replica else None)
        try:
            if replica is not None:
                wait_replica_online(server.url)
            for rep in range(args.reps):
                order = paths if rep % 2 == 0 else paths[::-1]
                for path in order:
                    job = Job(path, server.url, "bench", f"rb:{{bench}}:stream:bench-{rep}-{path}", args.n,
                              args.size, args.count, args.batch, durable=path == "durable")
                    assert server.proc is not None
                    r = run_once(job, server.proc.pid)
                    results[path].append(r)
                    print(f"  rep {rep} {path:8s} {r.rate:9,.0f} msg/s   p50 {r.p50_ms:6.3f} ms   "
                          f"p99 {r.p99_ms:6.3f} ms   cpu/event us: pub {r.pub_cpu_us:5.1f} sub {r.sub_cpu_us:5.1f} "
                          f"redis {r.server_cpu_us:5.1f}", flush=True)
        finally:
            if replica is not None:
                replica.stop()

    def med(path: str, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in results[path])

    print("medians:")
    for path in paths:
        print(f"  {path:8s} {med(path, 'rate'):9,.0f} msg/s   p50 {med(path, 'p50_ms'):6.3f} ms   "
              f"p99 {med(path, 'p99_ms'):6.3f} ms   cpu/event us: pub {med(path, 'pub_cpu_us'):5.1f} "
              f"sub {med(path, 'sub_cpu_us'):5.1f} redis {med(path, 'server_cpu_us'):5.1f} "
              f"sum {med(path, 'total_cpu_us'):5.1f}")
    busy = os.getloadavg()[0] > 1
    if args.wait_replica:
        ratio = med("durable", "rate") / med("project", "rate")
        print(f"durable (WAIT 1 per event) / project (no WAIT) throughput: {ratio:.2f}; p50 "
              f"{med('durable', 'p50_ms') - med('project', 'p50_ms'):+.3f} ms (the cost of a replica's acknowledgement)")
        return 0
    ratio = med("project", "rate") / med("bare", "rate")
    verdict = "no verdict: 1-minute load above 1" if busy else ("OK" if ratio >= 0.9 else "BELOW TARGET")
    print(f"project / bare throughput: {ratio:.2f} (target >= 0.90): {verdict}")
    many = med("many", "rate") / med("bare", "rate")
    print(f"many (publish_many x{args.batch}) / bare (serial XADD) throughput: {many:.2f} "
          "(batched vs serial publishing: not like for like)")
    return 0


def wait_replica_online(url: str, timeout_s: float = 20) -> None:
    client = connect(url)
    deadline = time.monotonic() + timeout_s
    while client.info("replication").get("connected_slaves", 0) < 1 or client.execute_command("WAIT", 1, 100) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the replica did not come online")
        time.sleep(0.05)
    client.close()


if __name__ == "__main__":
    sys.exit(main())
