"""Where the events' latency tail at a fixed offered load comes from: publisher, Redis or consumer.

One private redis-server; a publisher process and a consumer process as in ``bench_events.py`` at
``--rate`` events/s (default 6,900: half the idempotent twin's saturation rate on the quiet machine),
for the project (``Publisher.publish``, ``Consumer.run``) and the idempotent twin, alternated. The
publisher times every call and how late each call finished against its slot; the consumer records
each event's latency (receive time minus the scheduled send time, as the bench does). Redis' SLOWLOG
(threshold 1 ms) is read after every run. Variants of the project's consumer and publisher (``--variants``):

- ``plain``: as the bench runs them;
- ``nogc``: Python's garbage collector off in both processes;
- ``noclaim``: the consumer's idle-entry claim (XAUTOCLAIM every second) off.

Printed per run: the publish call's p50 / p90 / p99 / max, how many publishes finished more than 2 ms
after their slot, the events that arrived more than 2 ms late, in how many stalls (a gap of 20 ms
starts a new one) and how many of those were published late themselves (matched by their slot), the
consumer's p50 / p99 and the slow commands Redis logged.

    python bench/profile_event_tail.py [--rate 6900] [--n 10000] [--reps 2] [--variants plain,nogc,noclaim,twin]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_events as be  # noqa: E402

from rollout_bus.events.connection import connect  # noqa: E402
from rollout_bus.events.consume import Consumer, ConsumerConfig  # noqa: E402
from rollout_bus.events.embedded import RedisServer  # noqa: E402
from rollout_bus.events.names import Keys  # noqa: E402

LATE_NS = 2_000_000
STALL_GAP_S = 0.02


def publisher(job: be.Job, variant: str, ready: Any, go: Any, out: Any) -> None:
    if variant == "nogc":
        gc.disable()
    twin = variant == "twin"
    publish = be.twin_publisher(replace(job, path="twin")) if twin else be.project_publisher(job)
    ready.set()
    go.wait()
    calls: list[tuple[int, int, int]] = []  # (slot, lateness at return, call duration) in ns
    for sent in be.schedule(job):
        t0 = time.perf_counter_ns()
        publish(sent)
        calls.append((sent, time.time_ns() - sent, time.perf_counter_ns() - t0))
    out.put(("pub", calls))


def consumer(job: be.Job, variant: str, ready: Any, go: Any, out: Any) -> None:
    if variant == "nogc":
        gc.disable()
    lat: list[tuple[int, int]] = []  # (receive time, latency) in ns; the event's slot is their difference
    if variant == "twin":
        events = be.twin_events(job)
        ready.set()
        for data in events:
            now = time.time_ns()
            lat.append((now, now - data["sent_ns"]))
            if len(lat) >= job.n:
                break
        events.close()
        out.put(("sub", lat))
        return
    config = ConsumerConfig(block_ms=1000, count=job.count)
    if variant == "noclaim":
        config.claim_every_ms = 10**9
    cons = Consumer(connect(job.url), Keys(job.namespace), job.stream, be.GROUP, "c0", config)
    cons.read(block_ms=0)
    stop = threading.Event()

    def handle(msg: Any) -> None:
        now = time.time_ns()
        lat.append((now, now - msg.event.sent_ns))
        if len(lat) >= job.n:
            stop.set()
    ready.set()
    timer = threading.Timer(be.TIMEOUT_S, stop.set)  # a lost event ends the run instead of hanging it
    timer.start()
    cons.run(handle, stop)
    timer.cancel()
    out.put(("sub", lat))


def stalls(times_s: list[float]) -> list[list[float]]:
    groups: list[list[float]] = []
    for t in times_s:
        if groups and t - groups[-1][-1] <= STALL_GAP_S:
            groups[-1].append(t)
        else:
            groups.append([t])
    return groups


def run(server: RedisServer, variant: str, rate: float, n: int, tag: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    job = be.Job("project", server.url, "bench", f"rb:{{bench}}:stream:tail-{tag}", n, 1024, 64, 16, rate)
    client = connect(server.url)
    client.xgroup_create(job.stream, be.GROUP, id="$", mkstream=True)
    client.sadd(Keys(job.namespace).registered_groups(job.stream), be.GROUP)
    client.slowlog_reset()
    out = ctx.Queue()
    ready_pub, ready_sub, go = ctx.Event(), ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=consumer, args=(job, variant, ready_sub, go, out)),
             ctx.Process(target=publisher, args=(job, variant, ready_pub, go, out))]
    for proc in procs:
        proc.start()
    try:
        if not (ready_sub.wait(60) and ready_pub.wait(60)):
            raise RuntimeError("bench processes did not start")
        go.set()
        got = dict(out.get(timeout=be.TIMEOUT_S + 10) for _ in range(2))
        slow = [(int(e["duration"]), bytes(e["command"])[:24]) for e in client.slowlog_get(128)]
        client.flushdb()
    finally:
        client.close()
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()  # our own child, by its handle
                proc.join()
    calls, lat = got["pub"], got["sub"]
    if len(lat) != n:
        raise RuntimeError(f"{variant}: the consumer got {len(lat)} of {n} events")
    t0 = calls[0][0]
    durations = sorted(d for _, _, d in calls)
    q = statistics.quantiles([x for _, x in lat], n=100)
    published_late = {slot for slot, late, _ in calls if late > LATE_NS}
    late = [(at - x, at) for at, x in lat if x > LATE_NS]  # (slot, receive time) of every event > 2 ms late
    return {"call": [durations[len(durations) * k // 100] / 1e3 for k in (50, 90, 99)] + [durations[-1] / 1e3],
            "late_pubs": len(published_late),
            "late_events": stalls([(at - t0) / 1e9 for _, at in late]),
            "late_at_publish": sum(1 for slot, _ in late if slot in published_late),
            "p50_ms": q[49] / 1e6, "p99_ms": q[98] / 1e6, "slowlog": slow}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=6900.0, help="offered events/s")
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--variants", default="plain,nogc,noclaim,twin")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    print(f"{args.n} events at {args.rate:,.0f}/s (one every {1e6 / args.rate:.0f} us), {args.reps} reps of "
          f"{', '.join(variants)}; load average {os.getloadavg()[0]:.2f} before")
    with RedisServer() as server:
        connect(server.url).config_set("slowlog-log-slower-than", 1000)
        for rep in range(args.reps):
            for variant in variants:
                r = run(server, variant, args.rate, args.n, f"{rep}-{variant}")
                p50, p90, p99, top = r["call"]
                late = r["late_events"]
                print(f"{variant:>8}: publish call p50 {p50:4.0f} us p90 {p90:4.0f} p99 {p99:5.0f} max {top / 1e3:5.1f} ms; "
                      f"{r['late_pubs']:5d} publishes > 2 ms after their slot; {sum(map(len, late)):5d} events "
                      f"> 2 ms late in {len(late)} stalls, {r['late_at_publish']} of them published late; "
                      f"latency p50 {r['p50_ms']:.3f} p99 {r['p99_ms']:7.3f} ms; "
                      f"slowlog > 1 ms: {r['slowlog'] or 'none'}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
