"""Shards past one primary: the same load over K = 1, 2, 3 independent Redis primaries, and the loss of one.

    python bench/bench_shards.py [--shards 1,2,3] [--repeats 3] [--executors 6] [--submitters 3]
                                 [--engines-per-policy 6] [--window-s 10] [--kill | --no-kill] [--quick]

MEASURING INSTRUMENT, not an engine: the engines are ``bench_scale.py``'s stub engines with ``--token-ms 0``
(every ``/generate`` answered at once with a fixed reply), as in ``bench_redis_ceiling.py``, whose pieces
this bench imports (the fleet's CPU by role, the window's counts from the streams, ``INFO commandstats``).

**Same total load at every K.** The same ``--executors`` ``rollout-bus executor`` processes, the same
``--submitters`` submitters (trainers without training, one policy each, ``--in-flight`` requests
outstanding), the same stub engine processes (started once, ``--engines-per-policy`` engines per policy).
At K shards, K of the bench's private redis-servers are each a whole bus with the run's namespace: its
registry, its rq queue, ``executors / K`` executors, and ``engines-per-policy / K`` engines of every policy.
Each submitter is a ``ShardedClient`` over all K (``trainer.redis_shards.sharded``, its default
``ShardSettings``): its requests go to the live shard with the fewest of its requests in flight, its
batches are polled from every shard and acked where they came from. The K configurations are interleaved
over ``--repeats`` (repeat r runs them rotated by r), each with a fresh fleet of executors and submitters on
freshly flushed servers. Per configuration, after ``--warmup-s``, a window of ``--window-s``:

- requests/s and samples/s summed over the shards (each shard's streams counted between its two ``TIME``
  readings);
- each primary's main thread (``/proc/<pid>/task/<pid>/stat``) as a share of one core, and Redis CPU per
  sample: the main threads' CPU summed over the K primaries / the samples; ``INFO commandstats``' command
  time per sample beside it (execution only);
- the cores used by executors, submitters and stub engines, and each role's CPU per sample (the
  submitters' at K=1 against K=3 is what sharding costs the trainer side);
- the projection of what K saturated primaries carry: K x one core / Redis CPU per sample.

With no cross-shard traffic, Redis CPU per sample stays flat with K and that projection grows as K; the
rows of the verdict table (``shard_ratios``: per repeat, the value at the largest K over K=1) judge it
with ``verdict.judge``.

**Losing a shard** (``--kill``): K=3 of the largest measured fleet, on three fresh servers. After
``--kill-before-s`` of steady load, the last shard's redis-server is SIGKILLed by pid and its exit status
read (the kill landed) before anything else. The submitters log each batch they take and, when their
``ShardSet`` marks the shard lost, the requests their pending map held there (a hook at the head of
``ShardSet.on_lost``, before the resubmission). Reported: the time from the kill until each submitter
marked the shard lost; until every request in flight there was served elsewhere (taken by its submitter,
and its ``BatchReady`` on a live shard's stream); the batches and samples the submitters took in 1 s bins
from ``--kill-before-s`` before the kill to ``--kill-after-s`` after recovery.

The load is judged as ``bench/verdict.py`` does: the 1-minute load average before, and the share of the
cores other processes used during each window and during the whole bench.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_redis_ceiling import (
    BENCH_COMMANDS,
    INSTRUMENT,
    Fleet,
    _joined,
    core_share,
    count_window,
    parse_commandstats,
    parse_proc_cpu,
    redis_time_ms,
    ticks_of,
)
from bench_scale import spawn, start_stubs, stop
from verdict import Load, OutsideLoad, Row, Target, paired_ratios, reasons, table, wait_for_quiet

FLAT = 1.15
"""Redis CPU per sample at K primaries over K=1 that still counts as flat."""


# --- pure parts ------------------------------------------------------------------------------------

def parse_shards(text: str) -> list[int]:
    """``"1,2,3"`` -> [1, 2, 3]: shard counts, each at least 1, none twice, K=1 among them (the reference)."""
    ks = [int(part) for part in text.split(",") if part.strip()]
    if not ks or min(ks) < 1 or len(set(ks)) != len(ks):
        raise ValueError(f"--shards {text!r}: distinct shard counts >= 1")
    if 1 not in ks:
        raise ValueError(f"--shards {text!r}: K=1 is the reference, include it")
    return ks


def schedule(ks: Sequence[int], repeats: int) -> list[tuple[int, int]]:
    """(repeat, K) in run order: every K once per repeat, repeat r rotated by r, so no K always runs first."""
    order = list(ks)
    return [(r, order[(r + i) % len(order)]) for r in range(repeats) for i in range(len(order))]


def split_evenly(items: Sequence[Any], k: int, what: str = "items") -> list[list[Any]]:
    """``items`` in ``k`` contiguous parts of equal size; ``ValueError`` when they do not divide."""
    if k < 1 or len(items) % k:
        raise ValueError(f"{len(items)} {what} do not split evenly over {k} shards")
    n = len(items) // k
    return [list(items[i * n:(i + 1) * n]) for i in range(k)]


def capacity(k: int, redis_us_per_sample: float) -> float:
    """Samples/s that ``k`` saturated primaries carry at ``redis_us_per_sample`` of Redis CPU per sample."""
    return k * 1e6 / redis_us_per_sample if redis_us_per_sample > 0 else float("inf")


def bins(times: Sequence[float], start: float, end: float, width_s: float = 1.0,
         weights: Sequence[float] | None = None) -> list[float]:
    """Per whole bin of ``width_s`` from ``start`` up to ``end``, the sum of ``weights`` (1 each by default) of the
    ``times`` that fall in it; times outside, and a last partial bin, are left out."""
    n = max(0, int((end - start) // width_s))
    out = [0.0] * n
    for i, t in enumerate(times):
        b = int((t - start) // width_s)
        if start <= t < end and 0 <= b < n:
            out[b] += 1.0 if weights is None else weights[i]
    return out


@dataclass(frozen=True)
class Recovery:
    """What the submitters saw of one lost shard, as seconds after the kill."""

    lost_after_s: list[float]
    """Per submitter that marked it lost, when."""
    moved: dict[str, float | None]
    """Request id -> when it was served elsewhere (None: never), for each request in flight there and resubmitted."""
    held: list[str]
    """Requests in flight there whose batch the submitter had already read (served from its buffer)."""

    @property
    def all_served_s(self) -> float | None:
        """When the last moved request was served (the moment the lost shard's work was all redone); None before
        the shard is marked lost or while a moved request waits."""
        if not self.lost_after_s or any(t is None for t in self.moved.values()):
            return None
        return max((t for t in self.moved.values() if t is not None), default=max(self.lost_after_s, default=0.0))


def recovery(events: Sequence[Mapping[str, Any]], shard: int, kill_t: float) -> Recovery:
    """The submitters' ``lost`` and ``batch`` events (``t``: wall time) read against the kill of ``shard``: a
    request in flight there is served by the first batch of it taken after the loss from another shard."""
    lost = [e for e in events if e.get("what") == "lost" and e.get("shard") == shard]
    moved: dict[str, float | None] = {}
    held: list[str] = []
    for e in lost:
        kept = set(e.get("held", []))
        held += sorted(kept)
        for request_id in e.get("in_flight", []):
            if request_id in kept:
                continue
            served = [b["t"] for b in events if b.get("what") == "batch" and b.get("request") == request_id
                      and b.get("shard") != shard and b["t"] >= e["t"]]
            moved[request_id] = min(served) - kill_t if served else None
    return Recovery(sorted(e["t"] - kill_t for e in lost), moved, held)


def phase(t: float, recovered_s: float | None) -> str:
    """Which part of the loss timeline ``t`` seconds after the kill is in."""
    if t < 0:
        return "before"
    return "during" if recovered_s is None or t < recovered_s else "after"


@dataclass
class Window:
    """One configuration's measured window."""

    k: int
    repeat: int
    wall_s: float
    requests_per_s: float
    samples_per_s: float
    redis_main: list[float]
    """Each primary's main thread, share of one core."""
    command_us_per_s: float
    """``INFO commandstats`` usec over every primary per second of the window (the bench's own commands left out)."""
    roles: dict[str, float]
    machine_busy: float
    outside: float | None
    per_shard_samples: list[int] = field(default_factory=list)
    round_trips: int = 0
    """``total_reads_processed`` over every primary in the window."""
    commands: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per command, (calls, usec) summed over every primary (``INFO commandstats``; the bench's own left out)."""

    @property
    def samples(self) -> int:
        return sum(self.per_shard_samples)

    def per_sample_us(self, cores: float) -> float:
        """``cores`` of CPU over the window, in microseconds per sample."""
        return cores / self.samples_per_s * 1e6 if self.samples_per_s > 0 else 0.0

    @property
    def command_us(self) -> float:
        """Command execution time per sample, over every primary."""
        return self.command_us_per_s / self.samples_per_s if self.samples_per_s > 0 else 0.0

    @property
    def redis_us(self) -> float:
        return self.per_sample_us(sum(self.redis_main))

    @property
    def capacity(self) -> float:
        return capacity(self.k, self.redis_us)


def shard_ratios(windows: Sequence[Window], k: int, reference: int = 1) -> dict[str, list[float]]:
    """Per repeat, the figures at ``k`` shards over those at ``reference`` (the same repeat's): Redis CPU per
    sample, the projected capacity, samples/s measured, and the submitters' CPU per sample."""
    by = {(w.repeat, w.k): w for w in windows}
    reps = sorted({w.repeat for w in windows if (w.repeat, k) in by and (w.repeat, reference) in by})
    hi, lo = [by[(r, k)] for r in reps], [by[(r, reference)] for r in reps]
    figures: dict[str, Callable[[Window], float]] = {
        "redis_us_per_sample": lambda w: w.redis_us, "capacity": lambda w: w.capacity,
        "samples_per_s": lambda w: w.samples_per_s,
        "submitter_us_per_sample": lambda w: w.per_sample_us(w.roles["submitters"])}
    return {name: paired_ratios([f(w) for w in hi], [f(w) for w in lo]) for name, f in figures.items()}


@dataclass(frozen=True)
class Shift:
    """One command's calls and usec per sample at the reference K and at K, pooled over the repeats."""

    command: str
    calls_lo: float
    calls_hi: float
    usec_lo: float
    usec_hi: float


def command_shift(windows: Sequence[Window], k: int, reference: int = 1) -> list[Shift]:
    """Per command, calls and usec per sample at ``reference`` and at ``k`` shards (summed over the primaries and
    the repeats, over the samples of those windows), the largest change in usec per sample first."""
    def pooled(kk: int) -> dict[str, tuple[float, float]]:
        ws = [w for w in windows if w.k == kk]
        samples = sum(w.samples for w in ws)
        out: dict[str, tuple[float, float]] = {}
        for w in ws:
            for name, (calls, usec) in w.commands.items():
                c, u = out.get(name, (0.0, 0.0))
                out[name] = (c + calls, u + usec)
        return {name: (c / samples, u / samples) for name, (c, u) in out.items()} if samples else {}
    lo, hi = pooled(reference), pooled(k)
    shifts = []
    for name in set(lo) | set(hi):
        (calls_lo, usec_lo), (calls_hi, usec_hi) = lo.get(name, (0.0, 0.0)), hi.get(name, (0.0, 0.0))
        shifts.append(Shift(name, calls_lo, calls_hi, usec_lo, usec_hi))
    return sorted(shifts, key=lambda x: (-abs(x.usec_hi - x.usec_lo), x.command))


def stack_of(dump: str, marker: str) -> list[str]:
    """From a ``faulthandler`` dump of every thread, the frames of the last thread whose stack shows ``marker``
    (most recent call first), as ``function (file:line)``."""
    blocks = [b for b in dump.split("\n\n") if "most recent call first" in b]
    for block in reversed(blocks):
        frames = []
        for line in block.splitlines():
            line = line.strip()
            if line.startswith('File "'):
                path, _, rest = line[6:].partition('", line ')
                number, _, func = rest.partition(" in ")
                frames.append(f"{func} ({'/'.join(Path(path).parts[-2:])}:{number})")
        if any(marker in f for f in frames):
            return frames
    return []


def verdict_rows(windows: Sequence[Window], ks: Sequence[int], load: Load) -> list[Row]:
    """The table's rows: for each K > 1, Redis CPU per sample (flat: <= FLAT) and capacity (>= K / FLAT) against
    K=1, and, without a target, the measured rate and the submitters' CPU per sample."""
    rows = []
    for k in sorted(ks):
        if k == 1:
            continue
        r = shard_ratios(windows, k)
        rows += [Row("shards", f"Redis CPU/sample, K={k} / K=1", r["redis_us_per_sample"], Target("<=", FLAT), load),
                 Row("shards", f"projected capacity, K={k} / K=1", r["capacity"], Target(">=", k / FLAT), load),
                 Row("shards", f"samples/s measured, K={k} / K=1", r["samples_per_s"], None, load),
                 Row("shards", f"submitter CPU/sample, K={k} / K=1", r["submitter_us_per_sample"], None, load)]
    return rows


def median_range(values: Sequence[float], fmt: str = "{:,.0f}") -> str:
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


# --- the submitter (run as ``bench_shards.py --serve-submitter ...``) -------------------------------

def serve_submitter(urls: list[str], namespace: str, policy: str, in_flight: int, groups: int, samples: int,
                    max_new_tokens: int, weights_root: str, events_path: str) -> None:
    """A trainer without training over every shard: keeps ``in_flight`` requests out, acks each batch as it
    arrives; with ``events_path``, logs each batch taken and each shard it marks lost (with what it held there)."""
    from rollout_bus.events.names import Keys
    from rollout_bus.events.schema import Producer
    from rollout_bus.trainer.client import ClientConfig
    from rollout_bus.trainer.config import RolloutConfig
    from rollout_bus.trainer.redis_shards import Shard, sharded

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the bench asks where the threads wait
    stopping = [False]

    def on_term(signum: int, frame: Any) -> None:
        stopping[0] = True
    signal.signal(signal.SIGTERM, on_term)
    trainer = f"shards-{policy}"
    client, _ = sharded(urls, Keys(namespace), ClientConfig(
        policy=policy, trainer_id=trainer, group=f"g-{policy}", block_ms=50,
        rollout=RolloutConfig(n_groups=groups, n_samples_per_group=samples, max_new_tokens=max_new_tokens,
                              timeout_s=3600)), Producer("trainer", trainer), weights_root=weights_root,
        keep_versions=0)
    log = open(events_path, "a", buffering=1) if events_path else None  # noqa: SIM115 (closed in finally)

    def note(**fields: Any) -> None:
        if log is not None:
            log.write(json.dumps({"t": time.time(), **fields}) + "\n")

    def on_lost(shard: Shard) -> None:  # before the client's own hook moves the requests
        note(what="lost", shard=shard.index, reason=shard.lost_reason,
             in_flight=sorted(p.request.request_id for p in client.pending.values() if p.shard == shard.index),
             held=sorted(b.request_id for b in shard.rollouts.buffered()))
    client.shards.on_lost.insert(0, on_lost)
    client.start()
    out = nxt = received = 0
    try:
        while not stopping[0]:
            while out < in_flight:
                client.request(nxt, client.request_id("shards", nxt))
                nxt += 1
                out += 1
            client.poll(50)
            while (batch := client.take()) is not None:
                client.ack(batch, staleness=0, accepted=batch.data is not None)
                note(what="batch", shard=batch.shard, request=batch.request_id, samples=batch.event.n_samples)
                received += 1
                out -= 1
            for refused in client.refused():
                print(f"refused: {refused.error}", flush=True)
                out -= 1
    finally:
        stats = client.shards.stats
        print(json.dumps({"policy": policy, "requested": nxt, "received": received, "lost": stats.lost,
                          "resubmitted": stats.resubmitted, "acks_lost": stats.acks_lost,
                          "per_shard_requests": stats.per_shard_requests}), flush=True)
        client.stop()
        if log is not None:
            log.close()


# --- one configuration -----------------------------------------------------------------------------

@dataclass
class Bus:
    """K shards' fleet: the servers used, the bench's client of each, the namespace and the processes."""

    servers: list[Any]
    clients: list[Any]
    keys: Any
    policies: list[str]
    fleet: Fleet
    run_dir: Path


def start_bus(servers: Sequence[Any], stubs: list[Any], stub_urls: list[str], args: argparse.Namespace,
              tmp: Path, events: bool = False) -> Bus:
    """Flush ``servers``, write each one's registry (its share of every policy's engines), start its share of
    the executors and the submitters over all of them, and wait until every one has joined."""
    from rq import Worker

    from rollout_bus.events.connection import connect
    from rollout_bus.events.names import Keys
    from rollout_bus.events.registry import EngineRecord, EngineState, PolicyRecord, Registry
    from rollout_bus.events.submit import rq_queue

    k = len(servers)
    keys = Keys(f"shards-k{k}-{uuid.uuid4().hex[:4]}")
    run_dir = tmp / keys.namespace
    run_dir.mkdir()
    policies = [f"p{i}" for i in range(args.submitters)]
    clients = [connect(s.url) for s in servers]
    fleet_ = Fleet()
    fleet_.roles["stub engines"] = list(stubs)
    bus = Bus(list(servers), clients, keys, policies, fleet_, run_dir)
    try:
        executors = split_evenly(range(args.executors), k, "executors")
        for i, policy in enumerate(policies):
            engines = stub_urls[i * args.engines_per_policy:(i + 1) * args.engines_per_policy]
            for shard, part in enumerate(split_evenly(engines, k, "engines of a policy")):
                registry = Registry(clients[shard], keys)
                registry.put_policy(PolicyRecord(policy=policy, published=0, serving=0))
                for j, url in enumerate(part):
                    registry.put_engine(EngineRecord(engine_id=f"e{i}-{shard}-{j}", url=url,
                                                     state=EngineState.SERVING, versions={policy: 0},
                                                     base_policy=policy))
        for shard, server in enumerate(servers):
            for i in executors[shard]:
                fleet_.roles["executors"].append(spawn(
                    ["-m", "rollout_bus", "executor", "--redis-url", server.url, "--namespace", keys.namespace,
                     "--index", str(i), "--queues", "rollout", "--payload-store", "redis", "--log-level",
                     "WARNING"], run_dir / f"executor-s{shard}-{i}.log"))
        shard_urls = ",".join(s.url for s in servers)
        for i, policy in enumerate(policies):
            fleet_.roles["submitters"].append(spawn(
                [str(Path(__file__).resolve()), "--serve-submitter", "--redis-urls", shard_urls, "--namespace",
                 keys.namespace, "--policy", policy, "--in-flight", str(args.in_flight), "--groups",
                 str(args.groups), "--samples", str(args.samples), "--max-new-tokens", str(args.max_new_tokens),
                 "--weights-root", str(run_dir / "weights"),
                 "--events", str(run_dir / f"events-{i}.jsonl") if events else ""], run_dir / f"submitter-{i}.log"))
        queues = [rq_queue(c, keys.rollout_queue) for c in clients]
        deadline = time.monotonic() + 180
        while any(Worker.count(queue=q) < len(executors[s]) or _joined(clients[s], keys) < len(policies)
                  for s, q in enumerate(queues)):
            fleet_.check_alive(run_dir)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fleet over {k} shards did not start; see {run_dir}")
            time.sleep(0.2)
    except BaseException:
        stop_bus(bus)
        raise
    return bus


def stop_bus(bus: Bus) -> None:
    stop(bus.fleet.roles["submitters"])
    stop(bus.fleet.roles["executors"])
    for client in bus.clients:
        client.close()
    for log_file in sorted(bus.run_dir.glob("submitter-*.log")):
        tail = log_file.read_text().strip().splitlines()[-1:]
        if tail and not tail[0].startswith("{"):
            print(f"  {log_file.name}: {tail[0]}", flush=True)


def measure(bus: Bus, hz: int, window_s: float, k: int, repeat: int) -> Window:
    """One window over every shard of ``bus``: rates from each shard's streams, each primary's main thread,
    command time, and the cores of each role."""
    pids = [s.proc.pid for s in bus.servers]
    for c in bus.clients:
        c.config_resetstat()
    reads0 = [int(c.info("stats").get("total_reads_processed", 0)) for c in bus.clients]
    with open("/proc/stat") as f:
        busy0, total0 = parse_proc_cpu(f.read())
    roles0, main0 = bus.fleet.ticks(), [ticks_of(f"/proc/{p}/task/{p}/stat") for p in pids]
    t0 = [redis_time_ms(c) for c in bus.clients]
    w0 = time.monotonic()
    with OutsideLoad() as outside:
        time.sleep(window_s)
    wall = time.monotonic() - w0
    t1 = [redis_time_ms(c) for c in bus.clients]
    roles1, main1 = bus.fleet.ticks(), [ticks_of(f"/proc/{p}/task/{p}/stat") for p in pids]
    with open("/proc/stat") as f:
        busy1, total1 = parse_proc_cpu(f.read())
    reads1 = [int(c.info("stats").get("total_reads_processed", 0)) for c in bus.clients]
    commands: dict[str, tuple[int, int]] = {}
    for c in bus.clients:
        for name, stat in parse_commandstats(c.info("commandstats")).items():
            if name not in BENCH_COMMANDS:
                calls, usec = commands.get(name, (0, 0))
                commands[name] = (calls + stat.calls, usec + stat.usec)
    command_us = sum(usec for _, usec in commands.values())
    requests_per_s = samples_per_s = 0.0
    per_shard = []
    for c, a, b in zip(bus.clients, t0, t1, strict=True):
        requests, _, _, samples = count_window(c, bus.keys, bus.policies, a, b)
        per_shard.append(samples)
        requests_per_s += requests / ((b - a) / 1000)
        samples_per_s += samples / ((b - a) / 1000)
    return Window(k, repeat, wall, requests_per_s, samples_per_s,
                  [core_share(b - a, hz, wall) for a, b in zip(main0, main1, strict=True)],
                  command_us / wall, {role: core_share(roles1[role] - roles0[role], hz, wall) for role in roles0},
                  (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0, outside.load.outside_share,
                  per_shard, sum(reads1) - sum(reads0) - 3 * len(bus.clients), commands)  # the bench's TIME x2 and INFO


def window_line(w: Window) -> str:
    outside = "-" if w.outside is None else f"{w.outside:.0%}"
    mains = " ".join(f"{m:.0%}" for m in w.redis_main)
    return (f"{w.repeat:>3} {w.k:>2} {w.requests_per_s:>8.1f} {w.samples_per_s:>9.1f} {mains:>14} "
            f"{w.redis_us:>9.1f} {w.command_us:>8.1f} "
            f"{w.capacity:>9,.0f} {w.roles['executors']:>5.2f} {w.roles['submitters']:>5.2f} "
            f"{w.roles['stub engines']:>5.2f} {w.per_sample_us(w.roles['submitters']):>8.1f} "
            f"{w.per_sample_us(w.roles['executors']):>8.1f} {w.round_trips / w.samples if w.samples else 0:>6.2f} "
            f"{w.machine_busy:>6.0%} {outside:>7}")


HEADER = (f"{'rep':>3} {'K':>2} {'req/s':>8} {'samples/s':>9} {'redis main':>14} {'redis_us':>9} {'cmd_us':>8} "
          f"{'capacity':>9} {'exec':>5} {'subs':>5} {'stubs':>5} {'sub_us':>8} {'exec_us':>8} {'rt/smp':>6} {'cores':>6} "
          f"{'outside':>7}\n"
          "# redis main: each primary's main thread, share of one core; redis_us: their CPU summed, us per sample; "
          "cmd_us: INFO commandstats time per sample (execution only); capacity: K saturated primaries at "
          "redis_us (samples/s); exec/subs/stubs: cores used; sub_us/exec_us: their CPU per sample; rt/smp: round trips (reads processed) per sample; cores: the "
          "machine's; outside: others' share of the cores")


# --- losing a shard -----------------------------------------------------------------------------------

def read_events(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(run_dir.glob("events-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                out.append({**json.loads(line), "submitter": path.stem})
    return out


def served_on_streams(bus: Bus, live: Sequence[int], request_ids: set[str], kill_t: float) -> dict[str, list[Any]]:
    """Request id -> [(shard, seconds after the kill), ...]: each ``BatchReady`` of those requests on the live
    shards' batch streams (the entry id's time is Redis' clock: the same machine's)."""
    from rollout_bus.events.schema import BatchReady, decode

    out: dict[str, list[Any]] = {r: [] for r in request_ids}
    for shard in live:
        for policy in bus.policies:
            for entry_id, f in bus.clients[shard].xrange(bus.keys.batch_stream(policy)):
                e = decode(f)
                if isinstance(e, BatchReady) and e.request_id in out:
                    ms = int((entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)).split("-")[0])
                    out[e.request_id].append((shard, round(ms / 1000 - kill_t, 3)))
    return out


def kill_phase(stubs: list[Any], stub_urls: list[str], args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Steady load over three fresh shards; SIGKILL the last one's redis-server; the submitters' view of it."""
    from rollout_bus.events.embedded import RedisServer

    servers = [RedisServer().start() for _ in range(3)]
    bus: Bus | None = None
    try:
        bus = start_bus(servers, stubs, stub_urls, args, tmp, events=True)
        time.sleep(args.warmup_s)
        with OutsideLoad() as outside:
            time.sleep(args.kill_before_s)
            bus.fleet.check_alive(bus.run_dir)
            kill_t, landed = kill(servers[2])
            time.sleep(max(0.0, kill_t + args.stack_at_s - time.time()))
            dumped = bus.fleet.roles["submitters"][0]
            if dumped.poll() is None:
                os.kill(dumped.pid, signal.SIGUSR1)  # its threads' stacks, into its log
            deadline = time.monotonic() + args.kill_timeout_s
            rec = recovery(read_events(bus.run_dir), 2, kill_t)
            while time.monotonic() < deadline and (len(rec.lost_after_s) < args.submitters or rec.all_served_s is None):
                time.sleep(0.2)
                rec = recovery(read_events(bus.run_dir), 2, kill_t)
            time.sleep(args.kill_after_s)
            end_t = time.time()
        stop(bus.fleet.roles["submitters"])  # their event logs are complete from here on
        events = read_events(bus.run_dir)
        rec = recovery(events, 2, kill_t)
        streams = served_on_streams(bus, [0, 1], set(rec.moved), kill_t)
        stack = stack_of((bus.run_dir / "submitter-0.log").read_text(errors="replace"), "serve_submitter")
    finally:
        if bus is not None:
            stop_bus(bus)
        for s in servers:
            s.stop()
    batches = [e for e in events if e["what"] == "batch"]
    start = kill_t - args.kill_before_s
    times = [e["t"] for e in batches]
    return {"landed": landed, "recovery": rec, "bin_start_s": -args.kill_before_s,
            "batches": bins(times, start, end_t),
            "samples": bins(times, start, end_t, weights=[float(e["samples"]) for e in batches]),
            "on_streams": streams, "stack": stack, "stack_at_s": args.stack_at_s,
            "outside": outside.load.outside_share,
            "lost_reasons": sorted({e["reason"] for e in events if e["what"] == "lost"})}


def kill(server: Any) -> tuple[float, str]:
    """SIGKILL ``server``'s process (the bench started it) and show the kill landed: (when, its exit status)."""
    pid = server.proc.pid
    kill_t = time.time()
    os.kill(pid, signal.SIGKILL)
    status = server.proc.wait(10)
    landed = f"redis-server pid {pid} (shard 2) exited with {status}"
    print(f"# kill landed: {landed}", flush=True)
    if status != -signal.SIGKILL:
        raise RuntimeError(f"the kill did not land: {landed}")
    return kill_t, landed


# --- report and command ----------------------------------------------------------------------------

def summary_table(windows: Sequence[Window], ks: Sequence[int], spr: int) -> list[str]:
    """Per K: medians (and ranges) over the repeats."""
    lines = [f"{'K':>2} {'requests/s':>19} {'samples/s':>23} {'each primary (main thread)':>28} "
             f"{'Redis us/sample':>19} {'cmd us':>6} {'K cores carry, samples/s':>28} {'submitter us/sample':>21} "
             f"{'executor us':>11}"]
    for k in sorted(ks):
        ws = [w for w in windows if w.k == k]
        if not ws:
            continue
        mains = " ".join(f"{statistics.median(w.redis_main[i] for w in ws):.1%}" for i in range(k))
        cap = [w.capacity for w in ws]
        lines.append(
            f"{k:>2} {median_range([w.requests_per_s for w in ws], '{:.1f}'):>19} "
            f"{median_range([w.samples_per_s for w in ws]):>23} {mains:>28} "
            f"{median_range([w.redis_us for w in ws], '{:.1f}'):>19} "
            f"{statistics.median(w.command_us for w in ws):>6.1f} "
            f"{median_range(cap):>28} "
            f"{median_range([w.per_sample_us(w.roles['submitters']) for w in ws], '{:.1f}'):>21} "
            f"{statistics.median(w.per_sample_us(w.roles['executors']) for w in ws):>11.1f}")
        lines.append(f"{'':>2}   = {statistics.median(cap) / spr:,.0f} requests/s at K saturated primaries "
                     f"(K x 1e6 / Redis us per sample; {spr} samples per request)")
    return lines


def kill_report(result: Mapping[str, Any]) -> list[str]:
    rec: Recovery = result["recovery"]
    lines = [f"kill: {result['landed']}",
             f"marked lost by {len(rec.lost_after_s)} submitter(s) after "
             + ", ".join(f"{t:.2f}" for t in rec.lost_after_s) + " s (" + "; ".join(result["lost_reasons"]) + ")"]
    served = result["all_served"]
    lines.append(f"in flight there: {len(rec.moved)} request(s) resubmitted, {len(rec.held)} already read (served "
                 f"from the submitters' buffers); every resubmitted one served elsewhere "
                 + (f"{served:.2f} s after the kill" if served is not None else "NOT within the wait"))
    for request_id, t in sorted(rec.moved.items(), key=lambda kv: kv[1] if kv[1] is not None else 1e9):
        on = result["on_streams"].get(request_id, [])
        where = ", ".join(f"shard {s} at {ts:.2f} s" for s, ts in on) or "on no live shard's stream"
        lines.append(f"  {request_id}: taken {'-' if t is None else f'{t:.2f} s'}; BatchReady {where}")
    lines.append(f"where submitter 0's trainer thread was {result['stack_at_s']:g} s after the kill "
                 "(faulthandler, most recent call first):")
    lines += [f"  {frame}" for frame in result["stack"][:12]] or ["  (no dump)"]
    twice = [r for r, on in result["on_streams"].items() if len(on) > 1]
    lines.append(f"served twice on the live shards: {len(twice)}" + (f" {twice}" if twice else ""))
    lines.append("batches and samples the submitters took per 1 s bin (t: seconds after the kill):")
    per_phase: dict[str, list[float]] = {}
    for i, (b, s) in enumerate(zip(result["batches"], result["samples"], strict=True)):
        t = int(result["bin_start_s"]) + i
        ph = phase(t, served)
        per_phase.setdefault(ph, []).append(s)
        lines.append(f"  t={t:+4d} {ph:>6} {b:>5.0f} batches {s:>7.0f} samples " + "#" * int(b // 4))
    share = result["outside"]
    lines.append(f"other processes used {'-' if share is None else f'{share:.0%}'} of the cores over the timeline")
    lines.append("mean samples/s: " + ", ".join(f"{ph} {statistics.mean(v):,.0f} ({len(v)} s)"
                                                  for ph, v in per_phase.items()))
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", default="1,2,3", help="shard counts K to compare (K=1 is the reference)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--executors", type=int, default=6, help="in all, split evenly over the K shards")
    p.add_argument("--submitters", type=int, default=3, help="each a ShardedClient over all K shards")
    p.add_argument("--engines-per-policy", type=int, default=6, help="stub engines, split evenly over the shards")
    p.add_argument("--stubs-per-process", type=int, default=6)
    p.add_argument("--in-flight", type=int, default=4, help="requests each submitter keeps outstanding")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--kill", action=argparse.BooleanOptionalAction, default=True,
                   help="the loss of one shard at K=3 after the comparison")
    p.add_argument("--kill-before-s", type=float, default=10.0)
    p.add_argument("--kill-after-s", type=float, default=10.0)
    p.add_argument("--kill-timeout-s", type=float, default=60.0, help="longest wait for the recovery")
    p.add_argument("--stack-at-s", type=float, default=2.0, help="when to dump submitter 0's stacks after the kill")
    p.add_argument("--wait-quiet-s", type=float, default=0.0,
                   help="first wait up to this long for the 1-minute load average to fall to 1")
    p.add_argument("--quick", action="store_true", help="a smoke run: K=1,3 once, 3 executors, short windows")
    p.add_argument("--json", default="", help="also write the figures here")
    p.add_argument("--serve-submitter", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--redis-urls", default="", help=argparse.SUPPRESS)
    p.add_argument("--namespace", default="", help=argparse.SUPPRESS)
    p.add_argument("--policy", default="", help=argparse.SUPPRESS)
    p.add_argument("--weights-root", default="", help=argparse.SUPPRESS)
    p.add_argument("--events", default="", help=argparse.SUPPRESS)
    return p


def quick(args: argparse.Namespace) -> None:
    args.shards, args.repeats, args.executors, args.engines_per_policy = "1,3", 1, 3, 3
    args.window_s, args.warmup_s, args.kill_before_s, args.kill_after_s = 4.0, 1.0, 4.0, 3.0


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.serve_submitter:
        serve_submitter(args.redis_urls.split(","), args.namespace, args.policy, args.in_flight, args.groups,
                        args.samples, args.max_new_tokens, args.weights_root, args.events)
        return {}
    if args.quick:
        quick(args)
    ks = parse_shards(args.shards)
    for k in sorted(set(ks) | ({3} if args.kill else set())):
        split_evenly(range(args.executors), k, "executors")
        split_evenly(range(args.engines_per_policy), k, "engines per policy")
    from rollout_bus.events.embedded import RedisServer

    hz = os.sysconf("SC_CLK_TCK")
    spr = args.groups * args.samples
    if args.wait_quiet_s > 0:
        wait_for_quiet(args.wait_quiet_s)
    with open("/proc/loadavg") as f:
        loadavg = f.read().strip()
    print(f"# {INSTRUMENT}")
    print(f"# K = {ks} private redis-servers, {args.repeats} repeat(s) interleaved; in all {args.executors} "
          f"executors, {args.submitters} submitters (ShardedClient over the K, {args.in_flight} requests in flight "
          f"each), {args.engines_per_policy} stub engines per policy; requests of {args.groups}x{args.samples} "
          f"samples x {args.max_new_tokens} tokens; window {args.window_s:g}s after {args.warmup_s:g}s; "
          f"{os.cpu_count()} CPUs; load average before (/proc/loadavg): {loadavg}", flush=True)
    windows: list[Window] = []
    killed: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory() as tmp_name, OutsideLoad() as whole:
        tmp = Path(tmp_name)
        stubs, stub_urls = start_stubs(args.submitters * args.engines_per_policy, args.stubs_per_process,
                                       argparse.Namespace(token_ms=0.0, batch_knee=16.0), tmp)
        servers = [RedisServer().start() for _ in range(max(ks))]
        try:
            print(HEADER, flush=True)
            for repeat, k in schedule(ks, args.repeats):
                for s in servers[:k]:
                    with_client(s.url, lambda c: c.flushall())
                bus = start_bus(servers[:k], stubs, stub_urls, args, tmp)
                try:
                    time.sleep(args.warmup_s)
                    bus.fleet.check_alive(bus.run_dir)
                    w = measure(bus, hz, args.window_s, k, repeat)
                finally:
                    stop_bus(bus)
                windows.append(w)
                print(window_line(w), flush=True)
            for s in servers:
                s.stop()
            if args.kill:
                print(f"\n# losing a shard: K=3, SIGKILL of shard 2's redis-server after {args.kill_before_s:g}s "
                      "of steady load", flush=True)
                killed = kill_phase(stubs, stub_urls, args, tmp)
                killed["all_served"] = killed["recovery"].all_served_s
        finally:
            for s in servers:
                s.stop()
            stop(stubs)
    load = Load(float(loadavg.split()[0]), whole.load.outside_share, whole.load.wall_s)
    print(f"\n## shards past one primary (medians over {args.repeats} repeat(s), range in brackets)")
    for line in summary_table(windows, ks, spr):
        print(line)
    top = max(ks)
    if top > 1:
        print(f"\nwhat changed per sample from K=1 to K={top} (INFO commandstats over every primary, pooled over "
              "the repeats; largest change in usec/sample first):")
        print(f"  {'command':24} {'calls/sample':>15} {'usec/call':>15} {'usec/sample':>15}")
        for x in command_shift(windows, top)[:8]:
            per_call = (x.usec_lo / x.calls_lo if x.calls_lo else 0.0, x.usec_hi / x.calls_hi if x.calls_hi else 0.0)
            print(f"  {x.command:24} {x.calls_lo:>6.3f} -> {x.calls_hi:<6.3f} {per_call[0]:>6.2f} -> {per_call[1]:<6.2f} "
                  f"{x.usec_lo:>6.2f} -> {x.usec_hi:<6.2f}")
        rts = {k: sum(w.round_trips for w in windows if w.k == k) / max(1, sum(w.samples for w in windows if w.k == k))
               for k in (1, top)}
        print(f"  round trips per sample: {rts[1]:.2f} -> {rts[top]:.2f}")
    rows = verdict_rows(windows, ks, load)
    print()
    print(table(rows))
    for line in reasons(rows):
        print(f"  {line}")
    if killed is not None:
        print("\n## losing one shard of three")
        for line in kill_report(killed):
            print(line)
    print(f"\n# {INSTRUMENT}")
    print(f"# load (the 1-minute load average before; other processes' CPU while it ran): {load.describe()}" + (f"; figures only, no verdict: {load.problem()}" if load.problem() else ""))
    summary = {"load_before": load.before, "loadavg": loadavg, "outside_share": load.outside_share,
               "windows": [vars(w) | {"redis_us": w.redis_us, "capacity": w.capacity} for w in windows],
               "ratios": {k: shard_ratios(windows, k) for k in ks if k != 1}}
    if killed is not None:
        rec = killed["recovery"]
        summary["kill"] = {key: v for key, v in killed.items() if key != "recovery"} | {
            "lost_after_s": rec.lost_after_s, "moved": rec.moved, "held": rec.held}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    summary["rows"] = rows  # for bench/ratios.py (not in the JSON)
    return summary


def with_client(url: str, fn: Callable[[Any], Any]) -> Any:
    from rollout_bus.events.connection import connect

    c = connect(url)
    try:
        return fn(c)
    finally:
        c.close()


if __name__ == "__main__":
    main()
