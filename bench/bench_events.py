"""Event bus throughput and latency against two hand-written twins, on one private redis-server.

A publisher process and a consumer process move ``--n`` events of ``--size`` bytes
through one stream and one consumer group. The paths, alternated within one run:

- transport: the best loop a competent user writes with the project's own shortcuts and no
             guarantees: a msgpack map (id, send time, payload) per event, ``XADD`` packed with
             hiredis and sent on a kept connection; the consumer sends ``XACK`` of the previous
             batch and ``XREADGROUP COUNT c BLOCK`` in one packed send on a kept connection and
             unpacks each entry. project / transport is the price of the project's guarantees.
- twin:      the same, but every publish is deduplicated like the project's: one Lua script
             (``SET dedupe-key 1 NX EX ttl``, then ``XADD``) sent as a packed ``EVALSHA``.
             The target is set against this one;
- project:   ``events.publish.Publisher.publish`` per event (typed event, msgpack, idempotent
             Lua publish) and ``events.consume.Consumer.run`` (read, decode and validate, handle,
             ack with the next read);
- many:      (``--many``) as project, but ``Publisher.publish_many`` sends ``--batch`` events per
             round trip: not like for like with the serial paths, it shows what batching gains;
- twin-many: (``--many``) the batching twin, many's baseline: the transport twin's events, ``--batch``
             plain ``XADD``s hiredis-packed into one send (a pipeline) on the kept connection, the
             replies read after it; no dedupe, no sequence number, no guarantee. many / twin-many is
             the price of publish_many's guarantees, with the target set against it.

The batched paths send a batch once its last event's slot is due (each event keeps its own slot
as its send time, so the wait for a batch to fill counts in its latency); with ``--many`` they run
at the fixed loads too, at the same rate as the serial paths.

Two kinds of run: saturation (the publisher sends as fast as it can; events / (last receive -
first send) is the throughput) and fixed offered load (``--loads 0.5,0.9``: the publisher
sends on a schedule at that fraction of the twin's saturation rate, the same schedule for
every path). Latency is one-way, from the event's scheduled send time to the consumer having
it decoded; at saturation it measures how far the consumer falls behind, so the latency
figures to read are the fixed-load ones (p50 / p99 / p999).

``--wait-replica`` starts a replica of the server and compares instead, at saturation in the
same run, ``project`` (``Publisher.publish``, acknowledged by the primary alone) against
``durable`` (``Publisher.publish(durable=True)``: a ``WAIT 1`` behind every event on the same
connection, acknowledged once the replica has it: what WeightsPublished, BatchReady and
WeightVersionServing pay with Sentinel).

    python bench/bench_events.py [--n 10000] [--reps 5] [--size 1024] [--count 64] [--loads 0.5,0.9]
    python bench/bench_events.py --many [--batch 16] [--settle 180]
    python bench/bench_events.py --wait-replica [--n 3000] [--reps 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import msgpack  # noqa: E402
from hiredis import pack_command  # noqa: E402
from verdict import Load, OutsideLoad, Row, Target, paired_ratios, reasons, table, wait_for_quiet  # noqa: E402

from rollout_bus.events.connection import connect  # noqa: E402
from rollout_bus.events.consume import Consumer, ConsumerConfig, Message  # noqa: E402
from rollout_bus.events.embedded import RedisServer  # noqa: E402
from rollout_bus.events.names import Keys  # noqa: E402
from rollout_bus.events.publish import Publisher  # noqa: E402
from rollout_bus.events.schema import Event, Producer, encode  # noqa: E402

GROUP = "bench"
PRODUCER = Producer("bench", "0")
TIMEOUT_S = 120.0
TWIN_TTL_S = 600  # the project's dedupe keys of event ids live as long (events.publish.RETRY_DEDUPE_TTL_S)

# the idempotent twin's publish: a dedupe key set only if new, then the entry; nil on a repeat
TWIN_SCRIPT = """
if redis.call('SET', KEYS[2], 1, 'NX', 'EX', ARGV[1]) then
  return redis.call('XADD', KEYS[1], '*', 'e', ARGV[2])
end
return false
"""


@dataclass(frozen=True, kw_only=True)
class BenchTick(Event):
    """One benchmark event: its (scheduled) send time and an opaque payload."""

    sent_ns: int
    data: bytes


@dataclass(frozen=True)
class Job:
    path: str  # a key of PATHS
    url: str
    namespace: str
    stream: str
    n: int
    size: int
    count: int
    batch: int = 16
    rate: float = 0.0  # offered events/s; 0: as fast as the publisher can
    profile: str = ""  # a folder: each process writes a cProfile (CPU time) of its loop there
    durable: bool = False  # project path: WAIT for one replica behind every publish


def schedule(job: Job) -> Any:
    """Yields each event's send time (ns): now for saturation runs, else after sleeping until its slot."""
    if job.rate <= 0:
        for _ in range(job.n):
            yield time.time_ns()
        return
    start = time.time_ns() + 1_000_000
    step = 1e9 / job.rate
    for i in range(job.n):
        due = start + int(i * step)
        wait = due - time.time_ns()
        if wait > 0:
            time.sleep(wait / 1e9)
        yield due  # the scheduled time: a late send counts its lateness (no coordinated omission)


def batches(sends: Iterable[int], size: int) -> Iterator[list[int]]:
    """Consecutive batches of ``size`` send times (the last one shorter). A batch is yielded once its last
    send time was drawn, so over ``schedule`` a batch goes when its last event's slot is due."""
    if size < 1:
        raise ValueError(f"batch size {size} < 1")
    batch: list[int] = []
    for sent in sends:
        batch.append(sent)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def kept_connection(url: str) -> Any:
    """One connection of a client's pool, kept for the process: what the twins send packed commands on."""
    client = connect(url)
    conn = client.connection_pool.get_connection()
    return client, conn


# --- the twins -------------------------------------------------------------------------------

def twin_publisher(job: Job) -> Callable[[int], None]:
    """The twins' publish of one event scheduled at ``sent`` ns, on a connection kept from here on: a msgpack
    map, then ``EVALSHA`` of the dedupe script (``twin``) or a plain ``XADD`` (``transport``), hiredis-packed."""
    client, conn = kept_connection(job.url)
    idempotent = job.path == "twin"
    sha = client.script_load(TWIN_SCRIPT)
    dedupe_prefix = f"{Keys(job.namespace).prefix}twin-dedupe:{job.stream}:"
    packer = msgpack.Packer(use_bin_type=True)
    blob = bytes(job.size)

    def publish(sent: int) -> None:
        event_id = os.urandom(16).hex()
        raw = packer.pack({"id": event_id, "sent_ns": sent, "data": blob})
        if idempotent:
            conn.send_packed_command([pack_command(("EVALSHA", sha, 2, job.stream, dedupe_prefix + event_id,  # type: ignore[arg-type]
                                                    TWIN_TTL_S, raw))])
        else:
            conn.send_packed_command([pack_command(("XADD", job.stream, "*", "e", raw))])  # type: ignore[arg-type]
        if conn.read_response() is None:
            raise RuntimeError("twin publish reported a duplicate of a fresh id")
    return publish


def twin_many_publisher(job: Job) -> Callable[[list[int]], None]:
    """The batching twin's publish of events scheduled at ``sents`` ns: the transport twin's msgpack map per
    event, one plain ``XADD`` each, all hiredis-packed into one send on a connection kept from here on (a
    pipeline: one round trip), then every reply read. No dedupe, no sequence number."""
    _client, conn = kept_connection(job.url)
    packer = msgpack.Packer(use_bin_type=True)
    blob = bytes(job.size)
    stream = job.stream

    def publish(sents: list[int]) -> None:
        conn.send_packed_command([pack_command(("XADD", stream, "*", "e",  # type: ignore[arg-type]
                                                packer.pack({"id": os.urandom(16).hex(), "sent_ns": sent,
                                                             "data": blob})))
                                  for sent in sents])
        for _ in sents:
            if conn.read_response() is None:
                raise RuntimeError("twin-many: an XADD appended nothing")
    return publish


def twin_events(job: Job) -> Generator[dict[str, Any], None, None]:
    """Each event the twin consumer reads, unpacked, on a connection kept from here on: ``XREADGROUP COUNT c
    BLOCK`` with the previous batch's ``XACK`` in the same send; the last acks go when the iterator is
    closed. Ends after ``TIMEOUT_S``."""
    _client, conn = kept_connection(job.url)
    read = pack_command(("XREADGROUP", "GROUP", GROUP, "c0", "COUNT", job.count, "BLOCK", 1000,  # type: ignore[arg-type]
                         "STREAMS", job.stream, ">"))

    def events() -> Generator[dict[str, Any], None, None]:
        acks: list[bytes] = []
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                if acks:  # the previous batch's acks go first, in the same send as the next read
                    conn.send_packed_command([pack_command(("XACK", job.stream, GROUP, *acks)) + read])  # type: ignore[arg-type]
                    conn.read_response()
                else:
                    conn.send_packed_command([read])
                reply: Any = conn.read_response()
                acks = []
                if not reply:
                    continue
                entries = next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]  # RESP3 or RESP2
                for entry_id, fields in entries:
                    acks.append(entry_id)
                    yield msgpack.unpackb(fields[1], raw=False)
        finally:
            if acks:
                conn.send_packed_command([pack_command(("XACK", job.stream, GROUP, *acks))])  # type: ignore[arg-type]
                conn.read_response()
    return events()


def project_publisher(job: Job) -> Callable[[int], None]:
    """``Publisher.publish`` of one ``BenchTick`` scheduled at ``sent`` ns (``durable`` with ``job.durable``),
    its script loaded here."""
    if job.durable:  # a plain url: the replica to wait for is named here (with Sentinel it is the default)
        os.environ["ROLLOUT_BUS_WAIT_REPLICAS"] = "1"
    pub = Publisher(connect(job.url), Keys(job.namespace), PRODUCER)
    blob = bytes(job.size)
    pub.publish(job.stream + ":warmup", BenchTick(producer=PRODUCER, sent_ns=0, data=b""))  # loads the script
    durable = job.durable

    def publish(sent: int) -> None:
        pub.publish(job.stream, BenchTick(producer=PRODUCER, sent_ns=sent, data=blob), durable=durable)
    return publish


def project_many_publisher(job: Job) -> Callable[[list[int]], None]:
    """``Publisher.publish_many`` of one ``BenchTick`` per send time of ``sents``, its script loaded here."""
    pub = Publisher(connect(job.url), Keys(job.namespace), PRODUCER)
    blob = bytes(job.size)
    pub.publish(job.stream + ":warmup", BenchTick(producer=PRODUCER, sent_ns=0, data=b""))  # loads the script

    def publish(sents: list[int]) -> None:
        pub.publish_many(job.stream, [BenchTick(producer=PRODUCER, sent_ns=sent, data=blob) for sent in sents])
    return publish


def _publish_batches_on_schedule(job: Job, publish: Callable[[list[int]], None], ready: MpEvent, go: MpEvent,
                                 out: Any) -> None:
    ready.set()
    go.wait()
    cpu0 = time.process_time()
    t0 = time.time_ns()
    for sents in batches(schedule(job), job.batch):
        publish(sents)
    out.put(("pub", t0, time.time_ns(), time.process_time() - cpu0))


def publish_twin_many(job: Job, ready: MpEvent, go: MpEvent, out: Any) -> None:
    _publish_batches_on_schedule(job, twin_many_publisher(job), ready, go, out)


def _publish_on_schedule(job: Job, publish: Callable[[int], None], ready: MpEvent, go: MpEvent, out: Any) -> None:
    ready.set()
    go.wait()
    cpu0 = time.process_time()
    t0 = time.time_ns()
    for sent in schedule(job):
        publish(sent)
    out.put(("pub", t0, time.time_ns(), time.process_time() - cpu0))


def publish_twin(job: Job, ready: MpEvent, go: MpEvent, out: Any) -> None:
    _publish_on_schedule(job, twin_publisher(job), ready, go, out)


def consume_twin(job: Job, ready: MpEvent, go: MpEvent, out: Any) -> None:
    events = twin_events(job)
    lat: list[int] = []
    ready.set()
    cpu0 = time.process_time()
    for data in events:
        lat.append(time.time_ns() - data["sent_ns"])
        if len(lat) >= job.n:
            break
    events.close()  # the last batch's acks
    out.put(("sub", time.time_ns(), lat, time.process_time() - cpu0))


# --- the project -------------------------------------------------------------------------------

def publish_project(job: Job, ready: MpEvent, go: MpEvent, out: Any) -> None:
    _publish_on_schedule(job, project_publisher(job), ready, go, out)


def publish_project_many(job: Job, ready: MpEvent, go: MpEvent, out: Any) -> None:
    _publish_batches_on_schedule(job, project_many_publisher(job), ready, go, out)


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


PATHS = {"transport": (publish_twin, consume_twin), "twin": (publish_twin, consume_twin),
         "project": (publish_project, consume_project), "many": (publish_project_many, consume_project),
         "durable": (publish_project, consume_project), "twin-many": (publish_twin_many, consume_twin)}


# --- one run ------------------------------------------------------------------------------------

@dataclass
class Result:
    path: str
    rate: float
    p50_ms: float
    p99_ms: float
    p999_ms: float
    pub_cpu_us: float  # CPU time per event of the publisher process, the consumer process, redis-server
    sub_cpu_us: float
    server_cpu_us: float
    commands_us: dict[str, float] = field(default_factory=dict)  # INFO commandstats: usec per event per command

    @property
    def total_cpu_us(self) -> float:
        return self.pub_cpu_us + self.sub_cpu_us + self.server_cpu_us


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def profiled(job: Job, side: int, ready: MpEvent, go: MpEvent, out: Any) -> None:
    """Run one side (0 publisher, 1 consumer) of ``job.path``, under cProfile (CPU time) if asked."""
    fn = PATHS[job.path][side]
    if not job.profile:
        fn(job, ready, go, out)
        return
    import cProfile

    prof = cProfile.Profile(time.process_time)
    prof.enable()
    try:
        fn(job, ready, go, out)
    finally:
        prof.disable()
        prof.dump_stats(os.path.join(job.profile, f"{job.path}-{('pub', 'sub')[side]}.prof"))


def run_once(job: Job, server_pid: int) -> Result:
    ctx = mp.get_context("spawn")
    client = connect(job.url)
    client.xgroup_create(job.stream, GROUP, id="$", mkstream=True)
    client.sadd(Keys(job.namespace).registered_groups(job.stream), GROUP)
    out = ctx.Queue()
    ready_pub, ready_sub, go = ctx.Event(), ctx.Event(), ctx.Event()
    sub = ctx.Process(target=profiled, args=(job, 1, ready_sub, go, out), name=f"{job.path}-consumer")
    pub = ctx.Process(target=profiled, args=(job, 0, ready_pub, go, out), name=f"{job.path}-publisher")
    sub.start()
    pub.start()
    try:
        if not (ready_sub.wait(60) and ready_pub.wait(60)):
            raise RuntimeError("bench processes did not start")
        client.config_resetstat()  # commandstats of this run alone (the scripts are loaded, the group made)
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
    q = statistics.quantiles(lat, n=1000)
    commands = command_usec(client.info("commandstats"), job.n)
    client.flushdb()  # the stream, its dedupe keys: each run starts from an empty server
    client.close()
    per_event_us = 1e6 / job.n
    return Result(job.path, job.n / ((sub_end - t0) / 1e9), q[499] / 1e6, q[989] / 1e6, q[998] / 1e6,
                  pub_cpu * per_event_us, sub_cpu * per_event_us, server_cpu * per_event_us, commands)


def command_usec(stats: dict[str, Any], n: int) -> dict[str, float]:
    """``INFO commandstats`` as usec per event of each command (a script's own commands counted apart from
    it, inside its time); the bench's own bookkeeping left out."""
    out = {}
    for name, st in stats.items():
        cmd = name.removeprefix("cmdstat_")
        if cmd.split("|")[0] not in ("config", "info", "flushdb", "script", "client", "hello", "ping"):
            out[cmd] = st["usec"] / n
    return out


def commands_line(results: list[Result], top: int = 6) -> str:
    """The median usec per event of the commands the runs of one path spent most in."""
    names = {c for r in results for c in r.commands_us}
    meds = {c: statistics.median(r.commands_us.get(c, 0.0) for r in results) for c in names}
    return " ".join(f"{c} {v:.2f}" for c, v in sorted(meds.items(), key=lambda kv: -kv[1])[:top])


def wire_sizes(size: int) -> tuple[int, int]:
    twin = 1 + len(msgpack.packb({"id": "0" * 32, "sent_ns": time.time_ns(), "data": bytes(size)}))
    project = sum(len(k) + len(v) for k, v in encode(
        BenchTick(producer=PRODUCER, sent_ns=time.time_ns(), data=bytes(size))).items())
    return twin, project


def load1() -> float:
    return os.getloadavg()[0]


def run_series(server: RedisServer, args: argparse.Namespace, paths: list[str], rate: float, tag: str
               ) -> dict[str, list[Result]]:
    results: dict[str, list[Result]] = {p: [] for p in paths}
    for rep in range(args.reps):
        order = paths if rep % 2 == 0 else paths[::-1]
        for path in order:
            job = Job(path, server.url, "bench", f"rb:{{bench}}:stream:bench-{tag}-{rep}-{path}", args.n,
                      args.size, args.count, args.batch, rate, durable=path == "durable")
            assert server.proc is not None
            r = run_once(job, server.proc.pid)
            results[path].append(r)
            if args.verbose:
                print(f"  {tag} rep {rep} {path:9s} {r.rate:9,.0f} msg/s   p50 {r.p50_ms:6.3f} ms   "
                      f"p99 {r.p99_ms:6.3f} ms   load {load1():.2f}", flush=True)
    return results


def med(results: dict[str, list[Result]], path: str, attr: str) -> float:
    return statistics.median(getattr(r, attr) for r in results[path])


def spread(results: dict[str, list[Result]], path: str, attr: str) -> str:
    vals = [getattr(r, attr) for r in results[path]]
    return f"{min(vals):,.0f}-{max(vals):,.0f}"


def per_rep(res: dict[str, list[Result]], num: str, den: str, attr: str) -> list[float]:
    """Per-repetition ratios of path ``num`` to path ``den`` in ``attr`` (runs of one round paired)."""
    return paired_ratios([getattr(r, attr) for r in res[num]], [getattr(r, attr) for r in res[den]])


def many_rows(sat: dict[str, list[Result]], half: dict[str, list[Result]] | None, batch: int, sat_load: Load,
              half_load: Load) -> list[Row]:
    """The verdict rows of publish_many against the batching twin: throughput at saturation (target >= 0.95)
    and, given the runs at half load (``half``), p50 and p99 there (target <= 1, as the serial paths')."""
    bench = "events 1 KB"
    rows = [Row(bench, f"many / batching twin (x{batch}), msg/s at saturation",
                per_rep(sat, "many", "twin-many", "rate"), Target(">=", 0.95), sat_load)]
    if half is not None:
        for q in ("p50_ms", "p99_ms"):
            rows.append(Row(bench, f"many / batching twin (x{batch}), {q[:-3]} at 0.5 load",
                            per_rep(half, "many", "twin-many", q), Target("<=", 1.0), half_load))
    return rows


def profile_paths(args: argparse.Namespace, paths: list[str]) -> int:
    import pstats

    os.makedirs(args.profile, exist_ok=True)
    with RedisServer() as server:
        for path in paths:
            job = Job(path, server.url, "bench", f"rb:{{bench}}:stream:prof-{path}", args.n, args.size, args.count,
                      args.batch, 0.0, os.path.abspath(args.profile))
            assert server.proc is not None
            r = run_once(job, server.proc.pid)
            print(f"\n=== {path}: {r.rate:,.0f} msg/s under the profiler; cpu/event us: pub {r.pub_cpu_us:.1f} "
                  f"sub {r.sub_cpu_us:.1f} redis {r.server_cpu_us:.1f}; load average {load1():.2f}")
            for side in ("pub", "sub"):
                print(f"--- {path} {side}: top functions by own CPU time")
                stats = pstats.Stats(os.path.join(args.profile, f"{path}-{side}.prof"))
                stats.sort_stats("tottime").print_stats(12)
    return 0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the bench and prints its tables; returns the ratios against the twins and the load averages."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=10_000, help="events per run")
    p.add_argument("--reps", type=int, default=5, help="runs of each path, alternated")
    p.add_argument("--size", type=int, default=1024, help="payload bytes per event")
    p.add_argument("--count", type=int, default=64, help="XREADGROUP COUNT of every consumer")
    p.add_argument("--loads", default="0.5,0.9", help="offered loads, as fractions of the twin's saturation rate")
    p.add_argument("--many", action="store_true", help="add the publish_many path and its batching twin")
    p.add_argument("--batch", type=int, default=16, help="events per publish_many call ('many') and per pipeline ('twin-many')")
    p.add_argument("--settle", type=float, default=0.0, metavar="S",
                   help="before the saturation runs and before the fixed loads, wait up to S s for the 1-minute "
                   "load average to fall to 1 (the saturation runs lift it above the verdict's limit)")
    p.add_argument("--verbose", action="store_true", help="print every run")
    p.add_argument("--profile", metavar="DIR", help="one saturation run per path under cProfile (CPU time), "
                   "stats written to DIR and summarised; no other runs")
    p.add_argument("--wait-replica", action="store_true",
                   help="with a replica: publish without WAIT (project) against WAIT 1 per event (durable)")
    args = p.parse_args(argv)
    if args.wait_replica:
        return wait_cost(args)

    twin_bytes, project_bytes = wire_sizes(args.size)
    print(f"{args.n} events x {args.reps} reps per path; payload {args.size} B "
          f"(event on the wire: twins {twin_bytes} B, project {project_bytes} B); XREADGROUP COUNT {args.count}; "
          f"{os.cpu_count()} CPUs, load average {load1():.2f} at start")
    batched = ["many", "twin-many"] if args.many else []
    paths = ["transport", "twin", "project"] + batched
    loads = [float(x) for x in args.loads.split(",") if x]
    if args.profile:
        profile_paths(args, paths)
        return {}
    with RedisServer() as server:
        if args.settle:
            wait_for_quiet(args.settle)
        with OutsideLoad() as sat_outside:
            sat = run_series(server, args, paths, 0.0, "sat")
        sat_load = sat_outside.load
        twin_rate = med(sat, "twin", "rate")
        fixed: dict[float, dict[str, list[Result]]] = {}
        if args.settle and loads:
            wait_for_quiet(args.settle)
        with OutsideLoad() as fixed_outside:
            for f in loads:
                fixed[f] = run_series(server, args, ["twin", "project"] + batched, f * twin_rate, f"load{f:g}")
        fixed_load = fixed_outside.load

    print(f"\nsaturation (medians of {args.reps}; {sat_load.describe()}):")
    for path in paths:
        print(f"  {path:9s} {med(sat, path, 'rate'):9,.0f} msg/s (spread {spread(sat, path, 'rate')})   "
              f"cpu/event us: pub {med(sat, path, 'pub_cpu_us'):5.1f} sub {med(sat, path, 'sub_cpu_us'):5.1f} "
              f"redis {med(sat, path, 'server_cpu_us'):5.1f} sum {med(sat, path, 'total_cpu_us'):5.1f}")
        print(f"  {'':9s} redis commandstats us/event: {commands_line(sat[path])}")
    for f, res in fixed.items():
        print(f"fixed offered load {f:g} x twin saturation = {f * twin_rate:,.0f} msg/s "
              f"(medians of {args.reps}; {fixed_load.describe()}):")
        for path in res:
            print(f"  {path:9s} {med(res, path, 'rate'):9,.0f} msg/s   p50 {med(res, path, 'p50_ms'):6.3f} ms   "
                  f"p99 {med(res, path, 'p99_ms'):6.3f} ms   p999 {med(res, path, 'p999_ms'):6.3f} ms")
    rows = [Row("events 1 KB", "project / idempotent twin, msg/s at saturation", per_rep(sat, "project", "twin", "rate"),
                Target(">=", 0.95), sat_load),
            Row("events 1 KB", "project / transport twin, msg/s (price of guarantees)",
                per_rep(sat, "project", "transport", "rate"), None, sat_load)]
    if 0.5 in fixed:
        for q in ("p50_ms", "p99_ms"):
            rows.append(Row("events 1 KB", f"project / idempotent twin, {q[:-3]} at 0.5 load",
                            per_rep(fixed[0.5], "project", "twin", q), Target("<=", 1.0), fixed_load))
    if args.many:
        rows += many_rows(sat, fixed.get(0.5), args.batch, sat_load, fixed_load)
    out: dict[str, Any] = {"rows": rows, "sat_load": sat_load, "fixed_load": fixed_load}
    print()
    print(table(rows))
    for line in reasons(rows):
        print(line)
    if args.many:
        many = med(sat, "many", "rate") / med(sat, "twin", "rate")
        print(f"many (publish_many x{args.batch}) / idempotent twin (serial): {many:.2f} "
              "(batched vs serial publishing: not like for like)")
    return out


def wait_cost(args: argparse.Namespace) -> dict[str, Any]:
    """``project`` against ``durable`` (WAIT 1 per event) at saturation, with one replica online."""
    print(f"{args.n} events x {args.reps} reps per path; payload {args.size} B; one replica; "
          f"{os.cpu_count()} CPUs, load average {load1():.2f} at start")
    paths = ["project", "durable"]
    with RedisServer() as server:
        replica = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(server.port)]).start()
        try:
            wait_replica_online(server.url)
            res = run_series(server, args, paths, 0.0, "wait")
        finally:
            replica.stop()
    load = load1()
    print(f"medians of {args.reps} (load average {load:.2f}):")
    for path in paths:
        print(f"  {path:8s} {med(res, path, 'rate'):9,.0f} msg/s   p50 {med(res, path, 'p50_ms'):6.3f} ms   "
              f"cpu/event us: pub {med(res, path, 'pub_cpu_us'):5.1f} sub {med(res, path, 'sub_cpu_us'):5.1f} "
              f"redis {med(res, path, 'server_cpu_us'):5.1f}")
    ratio = med(res, "durable", "rate") / med(res, "project", "rate")
    print(f"durable (WAIT 1 per event) / project (no WAIT) throughput: {ratio:.2f}; p50 "
          f"{med(res, 'durable', 'p50_ms') - med(res, 'project', 'p50_ms'):+.3f} ms "
          "(the cost of a replica's acknowledgement)")
    return {"wait_ratio": ratio, "load": load}


def wait_replica_online(url: str, timeout_s: float = 20) -> None:
    client = connect(url)
    deadline = time.monotonic() + timeout_s
    while client.info("replication").get("connected_slaves", 0) < 1 or client.execute_command("WAIT", 1, 100) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the replica did not come online")
        time.sleep(0.05)
    client.close()


if __name__ == "__main__":
    main()
