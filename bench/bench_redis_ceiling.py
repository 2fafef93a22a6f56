"""One Redis primary's ceiling: how many rollout requests, batches and samples per second one
redis-server carries, which command it spends its time on, and what fleet that is.

    python bench/bench_redis_ceiling.py [--stores redis,shm] [--steps 1:1,2:1,3:2,4:2,6:3,8:4]
                                        [--window-s 10] [--groups 4] [--samples 4] [--max-new-tokens 16]

MEASURING INSTRUMENT, not an engine: the engines answer at once. They are ``bench_scale.py``'s stub
engines (aiohttp servers speaking the engine's ``/generate`` contract and the routes executors ask)
run with ``--token-ms 0``: every ``/generate`` returns a fixed reply of ``max_new_tokens`` tokens with
no delay, so the only thing between two requests is the bus. What is measured is the bus's cost, never
an engine's speed.

Everything else is the real path, against ONE private redis-server the bench starts on a free port
(``events.embedded.RedisServer``): ``rollout-bus executor`` processes (rq workers, as
``bench_executors.py`` and ``bench_scale.py`` start them) and submitter processes that are trainers
without the training: each a ``trainer.client.RolloutClient`` of a policy of its own (lease, consumer
group, ``request`` through ``RolloutSubmitter``, ``poll``, ``ack``: ``BatchConsumed``, the payload's
release and the ``XACK``), keeping ``--in-flight`` requests outstanding. The engine registry is written
once by the bench (no controller: its health rounds are per interval, not per sample). Each policy
has ``--engines-per-policy`` stub engines.

Per payload store (``--stores``: redis, shm, memfd, file), executors and submitters are added step by
step (``--steps E:S,...``, each step's fleet includes the earlier one's) until redis-server's core is
saturated (its main thread's CPU over the window >= ``--saturated``), or the rate stops growing (two
steps without ``--min-gain`` over the best so far: then the machine's cores, not Redis, are the limit,
and the per-role CPU says where they went), or the steps run out. Per step, after ``--warmup-s``:

- ``CONFIG RESETSTAT``, then a window of ``--window-s``; requests/s (``RolloutCompleted``), batches/s
  (``BatchReady``), batches consumed/s (``BatchConsumed``) and samples/s (``n_samples`` of the batches),
  all counted afterwards from the streams between the window's two ``TIME`` readings;
- redis-server's CPU from ``/proc/<pid>/task/<pid>/stat`` (the main thread, the one core that
  saturates) and ``/proc/<pid>/stat`` (all its threads), as a share of one core;
- CPU of executors, submitters, stub engines (the instrument) and the bench, and the share of the
  machine's cores others used (``verdict.OutsideLoad``);
- ``INFO commandstats`` of the window: per command, calls per sample, usec per call and usec per
  sample (usec per call x calls / samples). A script's usec includes the commands it calls, which are
  also counted on their own lines (``(in scripts)``); the sum of usec per sample is therefore not
  Redis' CPU per sample, and neither is any of it I/O (reading, parsing, writing replies);
- round trips: ``total_reads_processed`` of ``INFO stats`` per sample.

The ceiling per store is its best step. Where Redis was not saturated, the measured rate is a floor
and the bench also gives the projection ``rate / main-thread utilisation``: what one core at the same
cost per sample carries (conservative: a busier event loop reads more commands per wake-up). After the
best step, ``--attribute-s`` seconds of ``SLOWLOG`` at threshold 0 (a separate window: logging every
command costs Redis time, so only shares are read from it) split the top-level time by command and by
script (each ``EVALSHA`` named by the project's script it runs).

The fleet: the ceiling in samples/s over one engine's samples/s (``--engine-rate LABEL=RATE``, default
SmolLM2-135M on the CPU engine from BENCHMARKS.md and a GPU engine rate that is an assumption).

The load is judged as ``bench/verdict.py`` does: the 1-minute load average before, and the share of
the cores other processes used during each window.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_scale import spawn, stop  # noqa: E402  # the same process handling as the scale bench
from verdict import OutsideLoad, parse_stat  # noqa: E402

INSTRUMENT = ("MEASURING INSTRUMENT: stub engines answer /generate at once with a fixed reply "
              "(bench_scale.py's stubs, --token-ms 0); the figures are the bus's, not an engine's")

BENCH_COMMANDS = frozenset({"config|resetstat", "config|set", "info", "time", "slowlog|get", "slowlog|reset",
                            "slowlog|len"})
"""Commands the bench itself sends inside a window: left out of the per-sample figures."""

SMOLLM2_CPU = ("SmolLM2-135M on the CPU engine (BENCHMARKS.md, quiet re-run of bench_decode_limits.py: "
               "179.4 tokens/s at batch 16, 32-token answers)", 179.4 / 32)
GPU_ASSUMED = ("GPU engine, ASSUMED not measured (e.g. one SGLang engine at 10,000 output tokens/s, "
               "500-token answers)", 10_000 / 500)


# --- pure parts ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CommandStat:
    """One line of ``INFO commandstats``: calls and total microseconds since the last reset."""

    calls: int
    usec: int


def parse_commandstats(info: str | Mapping[str, Any]) -> dict[str, CommandStat]:
    """Per command (``get``, ``xinfo|stream``), its calls and usec, from ``INFO commandstats`` as text
    (``cmdstat_get:calls=1,usec=2,...`` lines) or as redis-py parses it (``{'cmdstat_get': {...}}``)."""
    rows: dict[str, Mapping[str, Any]] = {}
    if isinstance(info, str):
        for line in info.splitlines():
            name, sep, rest = line.strip().partition(":")
            if not sep or not name.startswith("cmdstat_"):
                continue
            rows[name] = dict(kv.split("=", 1) for kv in rest.split(",") if "=" in kv)
    else:
        rows = {str(k): v for k, v in info.items() if str(k).startswith("cmdstat_") and isinstance(v, Mapping)}
    out: dict[str, CommandStat] = {}
    for name, fields in rows.items():
        try:
            out[name.removeprefix("cmdstat_").lower()] = CommandStat(int(fields["calls"]), int(float(fields["usec"])))
        except (KeyError, ValueError):
            continue
    return out


@dataclass(frozen=True)
class CommandCost:
    command: str
    calls_per_sample: float
    usec_per_call: float
    usec_per_sample: float


def per_sample_costs(stats: Mapping[str, CommandStat], samples: int,
                     exclude: Iterable[str] = BENCH_COMMANDS) -> list[CommandCost]:
    """Each command's calls and microseconds per sample (usec per call x calls / samples), the costliest
    first; ``exclude`` (the bench's own commands) left out."""
    if samples <= 0:
        return []
    skip = set(exclude)
    costs = [CommandCost(name, s.calls / samples, s.usec / s.calls if s.calls else 0.0, s.usec / samples)
             for name, s in stats.items() if name not in skip and s.calls > 0]
    return sorted(costs, key=lambda c: (-c.usec_per_sample, c.command))


SCRIPT_COMMANDS = frozenset({"evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro"})


def parse_steps(text: str) -> list[tuple[int, int]]:
    """``"1:1,2:1,4:2"`` -> [(executors, submitters), ...]; each step must not shrink the fleet."""
    steps: list[tuple[int, int]] = []
    for part in text.split(","):
        e, sep, s = part.strip().partition(":")
        if not sep:
            raise ValueError(f"step {part!r}: write EXECUTORS:SUBMITTERS")
        step = (int(e), int(s))
        if step[0] < 1 or step[1] < 1:
            raise ValueError(f"step {part!r}: at least one executor and one submitter")
        if steps and (step[0] < steps[-1][0] or step[1] < steps[-1][1]):
            raise ValueError(f"step {part!r}: steps add processes, they never remove any")
        steps.append(step)
    if not steps:
        raise ValueError("no steps")
    return steps


def core_share(ticks: int, hz: int, wall_s: float) -> float:
    """CPU ticks over a window as a share of one core."""
    return ticks / hz / wall_s if wall_s > 0 and hz > 0 else 0.0


def stop_reason(rates: Sequence[float], redis_share: float, *, saturated: float = 0.9,
                min_gain: float = 0.05, patience: int = 2) -> str | None:
    """Why the ramp stops after the last step, or None to add the next one: Redis' main thread at or
    above ``saturated`` of its core; or ``patience`` steps in a row none of which beat the best rate
    before them by ``min_gain``."""
    if redis_share >= saturated:
        return f"saturated: redis-server's main thread at {redis_share:.0%} of its core"
    if len(rates) > patience:
        best_before = max(rates[:-patience])
        if max(rates[-patience:]) < best_before * (1 + min_gain):
            return (f"plateau: {patience} steps without {min_gain:.0%} over {best_before:.1f} samples/s, "
                    f"with redis-server's main thread at {redis_share:.0%}")
    return None


def projected(rate: float, share: float) -> float:
    """What one whole core would carry at the cost per unit measured at ``share`` of it (``rate / share``)."""
    return rate / share if share > 0 else float("inf")


@dataclass(frozen=True)
class FleetLine:
    label: str
    per_engine: float
    engines: int
    text: str


def fleet(samples_per_s: float, samples_per_request: int, engine_rates: Sequence[tuple[str, float]],
          what: str = "ceiling") -> list[FleetLine]:
    """How many engines of each rate one primary carries at ``samples_per_s``, with the arithmetic."""
    out = []
    for label, per_engine in engine_rates:
        n = int(samples_per_s // per_engine) if per_engine > 0 else 0
        out.append(FleetLine(label, per_engine, n, (
            f"{what} {samples_per_s:,.0f} samples/s ({samples_per_s / samples_per_request:,.1f} requests/s x "
            f"{samples_per_request} samples) / {per_engine:.2f} samples/s per engine = {n:,} engines  [{label}]")))
    return out


def parse_engine_rate(text: str) -> tuple[str, float]:
    """``LABEL=SAMPLES_PER_S`` -> (label, rate)."""
    label, sep, rate = text.rpartition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"{text!r}: write LABEL=SAMPLES_PER_S")
    return label, float(rate)


def attribute(entries: Iterable[Sequence[Any]], names: Mapping[str, str]) -> dict[str, tuple[int, int]]:
    """Top-level time by command from ``SLOWLOG GET`` entries ``(duration_us, args)``: each script call
    named by the script it runs (``names``: sha1 -> name), others by command. -> name: (calls, usec)."""
    out: dict[str, tuple[int, int]] = {}
    for duration, args in entries:
        words = [a.decode(errors="replace") if isinstance(a, bytes) else str(a) for a in args]
        if not words:
            continue
        cmd = words[0].lower()
        if cmd in ("slowlog", "config", "info", "time"):
            continue
        if cmd in ("evalsha", "evalsha_ro") and len(words) > 1:
            name = f"evalsha {names.get(words[1].lower(), words[1][:8])}"
        elif cmd in ("eval", "eval_ro") and len(words) > 1:
            name = f"eval {names.get(hashlib.sha1(words[1].encode()).hexdigest(), '?')}"
        else:
            name = cmd
        calls, usec = out.get(name, (0, 0))
        out[name] = (calls + 1, usec + int(duration))
    return out


def parse_proc_cpu(text: str) -> tuple[int, int]:
    """(busy, total) clock ticks of all cores from ``/proc/stat``'s ``cpu`` line (idle and iowait are idle)."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            ticks = [int(x) for x in parts[1:]]
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
            total = sum(ticks[:8])  # guest time is already in user
            return total - idle, total
    raise ValueError("no cpu line")


def script_names() -> dict[str, str]:
    """sha1 -> ``module.NAME`` of every Lua script the project sends (and its lease-bound form), and rq's."""
    from rollout_bus.events.leased import leased

    names: dict[str, str] = {}
    modules = ["events.publish", "events.batches", "events.consume", "events.groups", "events.registry",
               "events.sessions", "events.janitor", "events.leased", "events.epoch", "executor.worker",
               "trainer.lease", "controller.lease"]
    for module, base in (("rq.scripts", "rq"),):
        try:
            for attr, value in vars(importlib.import_module(module)).items():
                if isinstance(value, str) and "redis.call" in value:
                    names.setdefault(hashlib.sha1(value.encode()).hexdigest(), f"{base}.{attr}")
        except ImportError:
            pass
    for mod_name in modules:
        try:
            mod = importlib.import_module(f"rollout_bus.{mod_name}")
        except ImportError:
            continue
        for attr, value in vars(mod).items():
            if isinstance(value, str) and "redis.call" in value:
                base = f"{mod_name.split('.')[-1]}.{attr}"
                names.setdefault(hashlib.sha1(value.encode()).hexdigest(), base)
                names.setdefault(hashlib.sha1(leased(value).encode()).hexdigest(), f"leased({base})")
    return names


# --- processes -------------------------------------------------------------------------------------

def ticks_of(path: str) -> int:
    try:
        with open(path) as f:
            parsed = parse_stat(f.read())
    except OSError:
        return 0
    return parsed[2] if parsed else 0


@dataclass
class Fleet:
    """The processes of one store's ramp, by role."""

    roles: dict[str, list[subprocess.Popen[bytes]]] = field(default_factory=lambda: {
        "executors": [], "submitters": [], "stub engines": []})

    def all(self) -> list[subprocess.Popen[bytes]]:
        return [p for procs in self.roles.values() for p in procs]

    def ticks(self) -> dict[str, int]:
        return {role: sum(ticks_of(f"/proc/{p.pid}/stat") for p in procs) for role, procs in self.roles.items()}

    def check_alive(self, tmp: Path) -> None:
        for role, procs in self.roles.items():
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a process of the {role} exited with {p.returncode}; see the logs in {tmp}")


# --- the submitter (run as ``bench_redis_ceiling.py --serve-submitter ...``) ---------------------------

def serve_submitter(url: str, namespace: str, policy: str, in_flight: int, groups: int, samples: int,
                    max_new_tokens: int, store: str) -> None:
    """A trainer without training: keeps ``in_flight`` requests out, acks every batch as it arrives. It reads
    payloads as a trainer does (a channel that opens redis, shm and memfd payloads by their kind; a file
    store's directory is given to it, as a trainer of such a run is given it)."""
    from rollout_bus.events.batches import BatchChannel
    from rollout_bus.events.connection import connect
    from rollout_bus.events.names import Keys
    from rollout_bus.events.payload import make_store
    from rollout_bus.events.schema import Producer
    from rollout_bus.trainer.client import ClientConfig, RolloutClient
    from rollout_bus.trainer.config import RolloutConfig
    from rollout_bus.trainer.payloads import ChannelReader

    stopping = [False]

    def on_term(signum: int, frame: Any) -> None:
        stopping[0] = True
    signal.signal(signal.SIGTERM, on_term)
    trainer = f"ceil-{policy}"
    client = connect(url)
    keys = Keys(namespace)
    reader = ChannelReader(client, keys, BatchChannel(client, keys, make_store(store, client, keys))
                           ) if store.startswith("file:") else None
    rc = RolloutClient(client, keys, ClientConfig(
        policy=policy, trainer_id=trainer, group=f"g-{policy}", block_ms=50,
        rollout=RolloutConfig(n_groups=groups, n_samples_per_group=samples, max_new_tokens=max_new_tokens,
                              timeout_s=3600)), Producer("trainer", trainer), payloads=reader)
    rc.start()
    out = nxt = received = missing = 0
    try:
        while not stopping[0]:
            while out < in_flight:
                rc.request(nxt, rc.request_id("ceil", nxt))
                nxt += 1
                out += 1
            rc.poll(50)
            while (batch := rc.take()) is not None:
                if batch.data is None:
                    missing += 1
                rc.ack(batch, staleness=0, accepted=batch.data is not None)
                received += 1
                out -= 1
            for refused in rc.refused():
                print(f"refused: {refused.error}", flush=True)
                out -= 1
    finally:
        print(json.dumps({"policy": policy, "requested": nxt, "received": received, "payload_missing": missing}),
              flush=True)
        rc.stop()


# --- one store's ramp ----------------------------------------------------------------------------

@dataclass
class Step:
    executors: int
    submitters: int
    wall_s: float
    requests: int
    batches: int
    consumed: int
    samples: int
    redis_main: float
    redis_all: float
    roles: dict[str, float]
    machine_busy: float
    outside: float | None
    queue_depth: int
    round_trips: int
    commands: dict[str, CommandStat]

    def rate(self, what: str) -> float:
        return float(getattr(self, what)) / self.wall_s if self.wall_s > 0 else 0.0


def redis_time_ms(client: Any) -> int:
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000


def count_window(client: Any, keys: Any, policies: Sequence[str], t0: int, t1: int) -> tuple[int, int, int, int]:
    """(requests completed, batches published, batches consumed, samples) with entry times in [t0, t1]."""
    from rollout_bus.events.paging import page_since
    from rollout_bus.events.schema import BatchConsumed, BatchReady, RolloutCompleted, decode

    requests = batches = consumed = samples = 0
    for _, f in page_since(client, keys.rollout_stream, t0, t1):
        requests += isinstance(decode(f), RolloutCompleted)
    for _, f in page_since(client, keys.trainer_stream, t0, t1):
        consumed += isinstance(decode(f), BatchConsumed)
    for policy in policies:
        for _, f in page_since(client, keys.batch_stream(policy), t0, t1):
            e = decode(f)
            if isinstance(e, BatchReady):
                batches += 1
                samples += e.n_samples
    return requests, batches, consumed, samples


def ramp(store: str, server: Any, args: argparse.Namespace, tmp: Path, names: Mapping[str, str]) -> dict[str, Any]:
    from bench_scale import start_stubs
    from rq import Worker

    from rollout_bus.events.connection import connect
    from rollout_bus.events.names import Keys
    from rollout_bus.events.registry import EngineRecord, EngineState, PolicyRecord, Registry
    from rollout_bus.events.submit import rq_queue

    client = connect(server.url)
    client.flushall()
    keys = Keys(f"ceil-{store.split(':')[0]}-{uuid.uuid4().hex[:4]}")
    run_dir = tmp / keys.namespace
    run_dir.mkdir()
    spec = store
    if store == "file":
        (run_dir / "payloads").mkdir()
        spec = f"file:{run_dir / 'payloads'}"
    steps = parse_steps(args.steps)
    max_subs = steps[-1][1]
    policies = [f"p{i}" for i in range(max_subs)]
    fleet_ = Fleet()
    registry = Registry(client, keys)
    hz = os.sysconf("SC_CLK_TCK")
    assert server.proc is not None
    rpid = server.proc.pid
    results: list[Step] = []
    reason = "the steps ran out"
    queue = rq_queue(client, keys.rollout_queue)
    try:
        stubs, urls = start_stubs(max_subs * args.engines_per_policy, args.stubs_per_process,
                                  argparse.Namespace(token_ms=0.0, batch_knee=16.0), run_dir)
        fleet_.roles["stub engines"] += stubs
        for i, policy in enumerate(policies):
            registry.put_policy(PolicyRecord(policy=policy, published=0, serving=0))
            for j in range(args.engines_per_policy):
                registry.put_engine(EngineRecord(
                    engine_id=f"e{i}-{j}", url=urls[i * args.engines_per_policy + j], state=EngineState.SERVING,
                    versions={policy: 0}, base_policy=policy))
        for n_exec, n_sub in steps:
            for i in range(len(fleet_.roles["executors"]), n_exec):
                fleet_.roles["executors"].append(spawn(
                    ["-m", "rollout_bus", "executor", "--redis-url", server.url, "--namespace", keys.namespace,
                     "--index", str(i), "--queues", "rollout", "--payload-store", spec, "--log-level", "WARNING"],
                    run_dir / f"executor-{i}.log"))
            for i in range(len(fleet_.roles["submitters"]), n_sub):
                fleet_.roles["submitters"].append(spawn(
                    [str(Path(__file__).resolve()), "--serve-submitter", "--redis-url", server.url, "--namespace",
                     keys.namespace, "--policy", policies[i], "--in-flight", str(args.in_flight), "--groups",
                     str(args.groups), "--samples", str(args.samples), "--max-new-tokens",
                     str(args.max_new_tokens), "--store", spec], run_dir / f"submitter-{i}.log"))
            deadline = time.monotonic() + 180
            while Worker.count(queue=queue) < n_exec or _joined(client, keys) < n_sub:
                fleet_.check_alive(run_dir)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the fleet of step {n_exec}:{n_sub} did not start; see {run_dir}")
                time.sleep(0.2)
            time.sleep(args.warmup_s)
            fleet_.check_alive(run_dir)
            step = measure(client, keys, policies[:n_sub], fleet_, rpid, hz, args.window_s, queue)
            step.executors, step.submitters = n_exec, n_sub
            results.append(step)
            print(step_line(step), flush=True)
            if args.by_command:
                top = per_sample_costs(step.commands, step.samples)[:args.top]
                print("      " + "  ".join(f"{c.command} {c.usec_per_sample:.1f}" for c in top), flush=True)
            why = stop_reason([r.rate("samples") for r in results], step.redis_main, saturated=args.saturated,
                              min_gain=args.min_gain)
            if why is not None:
                reason = why
                break
        best = max(results, key=lambda r: r.rate("samples"))
        slowlog, slow_requests = ({}, 0) if args.attribute_s <= 0 else attribute_window(
            client, keys, policies[:steps[len(results) - 1][1]], args.attribute_s, names)
    finally:
        stop(fleet_.roles["submitters"])
        stop(fleet_.roles["executors"])
        stop(fleet_.roles["stub engines"])
        sweep_payloads(client, keys, spec)
        for log_file in sorted(run_dir.glob("submitter-*.log")):
            tail = log_file.read_text().strip().splitlines()[-1:] if log_file.exists() else []
            if tail and not tail[0].startswith("{"):
                print(f"  {log_file.name}: {tail[0]}", flush=True)
        client.close()
    return {"store": store, "steps": results, "best": best, "reason": reason, "slowlog": slowlog,
            "slowlog_requests": slow_requests}


def sweep_payloads(client: Any, keys: Any, spec: str) -> None:
    """Delete every payload the run left unread (the batches in flight when its roles stopped). A stopped
    executor's memfd segment server keeps what it holds until each payload's TTL (a day) runs out, as it
    must for a real run's unread batches; a bench's are dropped here, so that no server outlives it."""
    from rollout_bus.events.batches import BatchChannel
    from rollout_bus.events.payload import make_store

    try:
        swept = BatchChannel(client, keys, make_store(spec, client, keys)).sweep(0)
    except Exception as exc:  # the figures stand; say what is left behind
        print(f"  payloads of {keys.namespace} not swept: {exc}", flush=True)
        return
    if swept.unreachable:
        print(f"  {swept.unreachable} payloads of {keys.namespace} could not be reached to be swept", flush=True)


def _joined(client: Any, keys: Any) -> int:
    """Submitters that have joined (``TrainerJoined`` on the trainer stream; nothing else writes it before)."""
    return int(client.xlen(keys.trainer_stream)) if client.exists(keys.trainer_stream) else 0


def measure(client: Any, keys: Any, policies: Sequence[str], fleet_: Fleet, rpid: int, hz: int, window_s: float,
            queue: Any) -> Step:
    client.config_resetstat()
    stats0 = client.info("stats")
    with open("/proc/stat") as f:
        busy0, total0 = parse_proc_cpu(f.read())
    roles0, rmain0, rall0, me0 = fleet_.ticks(), ticks_of(f"/proc/{rpid}/task/{rpid}/stat"), \
        ticks_of(f"/proc/{rpid}/stat"), ticks_of(f"/proc/{os.getpid()}/stat")
    t0 = redis_time_ms(client)
    w0 = time.monotonic()
    with OutsideLoad() as outside:
        time.sleep(window_s)
    wall = time.monotonic() - w0
    t1 = redis_time_ms(client)
    roles1, rmain1, rall1, me1 = fleet_.ticks(), ticks_of(f"/proc/{rpid}/task/{rpid}/stat"), \
        ticks_of(f"/proc/{rpid}/stat"), ticks_of(f"/proc/{os.getpid()}/stat")
    with open("/proc/stat") as f:
        busy1, total1 = parse_proc_cpu(f.read())
    commands = parse_commandstats(client.info("commandstats"))
    stats1 = client.info("stats")
    depth = int(queue.count)
    requests, batches, consumed, samples = count_window(client, keys, policies, t0, t1)
    redis_wall = (t1 - t0) / 1000
    roles = {role: core_share(roles1[role] - roles0[role], hz, wall) for role in roles0}
    roles["bench"] = core_share(me1 - me0, hz, wall)
    return Step(0, 0, redis_wall, requests, batches, consumed, samples,
                core_share(rmain1 - rmain0, hz, wall), core_share(rall1 - rall0, hz, wall), roles,
                (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0, outside.load.outside_share, depth,
                int(stats1.get("total_reads_processed", 0)) - int(stats0.get("total_reads_processed", 0)), commands)


def attribute_window(client: Any, keys: Any, policies: Sequence[str], seconds: float,
                     names: Mapping[str, str]) -> tuple[dict[str, tuple[int, int]], int]:
    """Every top-level command of ``seconds`` through SLOWLOG (threshold 0), named (see ``attribute``), and
    the requests completed meanwhile."""
    old_threshold = client.config_get("slowlog-log-slower-than")["slowlog-log-slower-than"]
    old_len = client.config_get("slowlog-max-len")["slowlog-max-len"]
    client.config_set("slowlog-max-len", 1_000_000)
    client.slowlog_reset()
    client.config_set("slowlog-log-slower-than", 0)
    t0 = redis_time_ms(client)
    try:
        time.sleep(seconds)
    finally:
        client.config_set("slowlog-log-slower-than", old_threshold)
    t1 = redis_time_ms(client)
    raw = client.execute_command("SLOWLOG", "GET", "-1")
    client.slowlog_reset()
    client.config_set("slowlog-max-len", old_len)
    requests = count_window(client, keys, policies, t0, t1)[0]
    return attribute((slowlog_entry(e) for e in raw), names), requests


def slowlog_entry(e: Any) -> tuple[int, list[Any]]:
    """(duration us, args) of one ``SLOWLOG GET`` entry, raw (``[id, time, duration, args, ...]``) or as
    redis-py parses it (a dict whose ``command`` is the args joined by spaces)."""
    if isinstance(e, Mapping):
        cmd = e["command"]
        return int(e["duration"]), cmd.split(b" ") if isinstance(cmd, bytes) else str(cmd).split(" ")
    return int(e[2]), list(e[3])


def step_line(s: Step) -> str:
    roles = " ".join(f"{s.roles[r]:5.2f}" for r in ("executors", "submitters", "stub engines", "bench"))
    outside = "-" if s.outside is None else f"{s.outside:.0%}"
    return (f"{s.executors:>4} {s.submitters:>4} {s.rate('requests'):>8.1f} {s.rate('batches'):>8.1f} "
            f"{s.rate('consumed'):>8.1f} {s.rate('samples'):>9.1f} {s.redis_main:>7.0%} {s.redis_all:>6.0%} "
            f"{roles} {s.machine_busy:>6.0%} {outside:>7} {s.queue_depth:>5} "
            f"{s.round_trips / s.samples if s.samples else 0:>7.2f}")


HEADER = (f"{'exec':>4} {'subs':>4} {'req/s':>8} {'batch/s':>8} {'cons/s':>8} {'samples/s':>9} {'redis':>7} "
          f"{'(all)':>6} {'exec':>5} {'subs':>5} {'stubs':>5} {'bench':>5} {'cores':>6} {'outside':>7} {'queue':>5} "
          f"{'rt/smp':>7}\n"
          "# redis = redis-server's main thread, share of one core; exec/subs/stubs/bench: cores used by each role; "
          "cores: the machine's, all processes; outside: others' share of all cores; queue: rq jobs waiting at "
          "the end; rt/smp: round trips (reads processed) per sample")


def report(result: dict[str, Any], args: argparse.Namespace, engine_rates: Sequence[tuple[str, float]]) -> None:
    best: Step = result["best"]
    spr = args.groups * args.samples
    rate = best.rate("samples")
    print(f"\n## {result['store']} store: ceiling at {best.executors} executors, {best.submitters} submitters "
          f"({result['reason']})")
    print(f"measured: {best.rate('requests'):.1f} requests/s, {best.rate('batches'):.1f} batches/s "
          f"({best.rate('consumed'):.1f} consumed/s), {rate:.1f} samples/s; redis-server main thread "
          f"{best.redis_main:.0%} of a core ({best.redis_all:.0%} all threads); "
          f"{best.redis_main / rate * 1e6 if rate else 0:.1f} us of its CPU per sample")
    if best.redis_main < args.saturated:
        print(f"redis not saturated: the measured rate is a floor. Projection to one saturated core "
              f"(rate / main-thread share): {projected(best.rate('requests'), best.redis_main):,.0f} requests/s, "
              f"{projected(best.rate('batches'), best.redis_main):,.0f} batches/s, "
              f"{projected(rate, best.redis_main):,.0f} samples/s")
    costs = per_sample_costs(best.commands, best.samples)
    total = sum(c.usec_per_sample for c in costs)
    print(f"INFO commandstats of the window ({best.samples} samples; usec/sample = usec/call x calls/sample; "
          f"a script's usec includes the commands it calls, listed again on their own lines):")
    print(f"  {'command':24} {'calls/sample':>12} {'usec/call':>9} {'usec/sample':>11} {'share':>6}")
    for c in costs[:args.top]:
        mark = "  (script)" if c.command in SCRIPT_COMMANDS else ""
        print(f"  {c.command:24} {c.calls_per_sample:>12.3f} {c.usec_per_call:>9.2f} {c.usec_per_sample:>11.2f} "
              f"{c.usec_per_sample / total if total else 0:>6.0%}{mark}")
    if costs:
        print(f"  top command: {costs[0].command} ({costs[0].usec_per_sample:.1f} us/sample); commands in all: "
              f"{sum(c.calls_per_sample for c in costs):.2f} calls/sample; redis CPU per sample "
              f"{best.redis_main / rate * 1e6 if rate else 0:.1f} us, of which command execution (commandstats, "
              f"scripts counted once) <= {total:.1f} us; round trips {best.round_trips / best.samples:.2f}/sample")
    if result["slowlog"]:
        sl, n_req = result["slowlog"], max(1, result["slowlog_requests"])
        usec_all = sum(u for _, u in sl.values())
        print(f"SLOWLOG attribution ({args.attribute_s:g} s at threshold 0 after the last step, {n_req} requests; "
              f"top-level commands only; shares of their time): {sum(c for c, _ in sl.values()) / n_req:.1f} "
              f"top-level commands per request")
        for name, (calls, usec) in sorted(sl.items(), key=lambda kv: -kv[1][1])[:args.top]:
            print(f"  {name:48} {calls / n_req:>6.2f}/request {usec / calls:>7.2f} us/call {usec / usec_all:>6.0%}")
    print(f"fleet one primary carries ({args.groups}x{args.samples} = {spr} samples per request):")
    for line in fleet(rate, spr, engine_rates, "measured"):
        print(f"  {line.text}")
    if best.redis_main < args.saturated:
        for line in fleet(projected(rate, best.redis_main), spr, engine_rates, "projected"):
            print(f"  {line.text}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stores", default="redis,shm", help="payload stores, of redis, shm, memfd, file")
    p.add_argument("--steps", default="1:1,2:1,3:2,4:2,6:3,8:4", help="EXECUTORS:SUBMITTERS per step")
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--attribute-s", type=float, default=2.0, help="SLOWLOG attribution after the ramp; 0: none")
    p.add_argument("--in-flight", type=int, default=4, help="requests each submitter keeps outstanding")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--engines-per-policy", type=int, default=2)
    p.add_argument("--stubs-per-process", type=int, default=4)
    p.add_argument("--saturated", type=float, default=0.9, help="redis main-thread share that counts as saturated")
    p.add_argument("--min-gain", type=float, default=0.05)
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--by-command", action="store_true", help="print each step's top commands too")
    p.add_argument("--engine-rate", type=parse_engine_rate, action="append", default=None,
                   help="LABEL=SAMPLES_PER_S of one engine for the fleet arithmetic (repeatable)")
    p.add_argument("--json", default="", help="also write the figures here")
    p.add_argument("--serve-submitter", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--redis-url", default="", help=argparse.SUPPRESS)
    p.add_argument("--namespace", default="", help=argparse.SUPPRESS)
    p.add_argument("--policy", default="", help=argparse.SUPPRESS)
    p.add_argument("--store", default="redis", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_submitter:
        serve_submitter(args.redis_url, args.namespace, args.policy, args.in_flight, args.groups, args.samples,
                        args.max_new_tokens, args.store)
        return {}
    parse_steps(args.steps)
    engine_rates = args.engine_rate or [SMOLLM2_CPU, GPU_ASSUMED]
    from rollout_bus.events.embedded import RedisServer

    names = script_names()
    load = os.getloadavg()
    print(f"# {INSTRUMENT}")
    print(f"# one private redis-server; requests of {args.groups}x{args.samples} samples x {args.max_new_tokens} "
          f"tokens; {args.engines_per_policy} stub engines per policy, one policy per submitter, {args.in_flight} "
          f"requests in flight each; window {args.window_s:g}s after {args.warmup_s:g}s; {os.cpu_count()} CPUs; "
          f"load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as server, OutsideLoad() as whole:
        version = server_version(server.url)
        print(f"# redis-server {version}, pid {server.proc.pid if server.proc else '?'}", flush=True)
        for store in args.stores.split(","):
            print(f"\n# store {store}\n{HEADER}", flush=True)
            results.append(ramp(store.strip(), server, args, Path(tmp), names))
    for r in results:
        report(r, args, engine_rates)
    print(f"\n# {INSTRUMENT}")
    print(f"# load: {whole.load.describe()}"
          + (f"; figures only, no verdict: {whole.load.problem()}" if whole.load.problem() else ""))
    summary = {"load_before": whole.load.before, "outside_share": whole.load.outside_share, "stores": {
        r["store"]: {"reason": r["reason"], "steps": [_step_json(s) for s in r["steps"]],
                     "best": _step_json(r["best"]), "slowlog": r["slowlog"],
                     "slowlog_requests": r["slowlog_requests"]} for r in results}}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


def _step_json(s: Step) -> dict[str, Any]:
    return {"executors": s.executors, "submitters": s.submitters, "wall_s": s.wall_s,
            "requests_per_s": s.rate("requests"), "batches_per_s": s.rate("batches"),
            "consumed_per_s": s.rate("consumed"), "samples_per_s": s.rate("samples"),
            "redis_main": s.redis_main, "redis_all": s.redis_all, "roles": s.roles, "machine_busy": s.machine_busy,
            "outside": s.outside, "queue_depth": s.queue_depth,
            "round_trips_per_sample": s.round_trips / s.samples if s.samples else None,
            "commands": {c.command: [c.calls_per_sample, c.usec_per_call, c.usec_per_sample]
                         for c in per_sample_costs(s.commands, s.samples)}}


def server_version(url: str) -> str:
    from rollout_bus.events.connection import connect

    c = connect(url)
    try:
        return str(c.info("server").get("redis_version", "?"))
    finally:
        c.close()


if __name__ == "__main__":
    main()
