"""The bus tax: what the bus costs per sample, a full ``rollout-bus run`` against a plain loop on the same engines.

    python bench/bench_bus_tax.py [--model smollm2|DIR] [--placement shared|disaggregated] [--repeats 5]
                                  [--steps N] [--quick] [--json FILE] [-- RUN FLAGS...]

Each repeat runs the same rollout requests two ways, interleaved ABAB (bus, direct, bus, direct, ...) so
that drift on the machine hits both:

- **bus**: ``launch.job.run_job``, what ``rollout-bus run --mode async`` runs: the run's own redis-server,
  the controller and the CPU engines it launches, the executors (rq workers) and one trainer consuming the
  batches. Counted: what the bus *delivered*, the ``BatchReady`` events on the policy's batch stream (read
  live from the run's Redis while it runs: their ``ts_ms``, the moment the executor published the batch, and
  ``n_samples``; the generated tokens of each batch from its executor's ``RolloutCompleted``,
  ``response_len_mean`` x ``n_samples``), the first K batches by time, K = the run's steps: the samples and
  tokens of batches 2..K over the time from the first batch's delivery to the K-th's. This side *includes*
  the executors' work beyond generating (tokenising, rewards, conversion to train data, the payload and its
  event), rq's queue, the controller, Redis, the engines' weight update each trainer step (the trainer
  publishes every version), and the trainer reading every batch. The trainer's own step rate is printed
  beside it for information (``summary.json``'s steady state: its steps 2..N); the trainer does not set the
  figure: every request of the run is in flight from its start (``--in-flight`` = the steps, with a rollout
  timeout of ``SUPPLY_TIMEOUT_S`` so that the last one queued does not expire), so the executors never wait
  for the trainer to ask for more (each run prints the tokens delivered beside the tokens trained: with every
  batch trained they agree, and the trainer's busy share: update + weight publish over its own window).
- **direct**: no Redis, no bus, no trainer. The same number of engines, each started with the command the
  controller builds (``controller.lifecycle.launch_spec`` from the controller arguments ``run_job`` gives,
  launched by ``controller.backends.launch``; checked against the bus run's own ``launching`` log line,
  torch threads included), driven over HTTP (``/generate``, the project's pooled aiohttp ``EngineClient``) by
  an asyncio loop: as many jobs at a time as the bus runs (``min(executors, in_flight)``: an executor takes
  one job at a time), each job the same ``n_groups`` prompts of the task's data source (the same items, same
  order) with ``n_samples`` samples each, every sample of a job in flight at once (as an executor sends them),
  the same sampling parameters (temperature, max new tokens, stop ids), log-probs asked for, and each group
  scored by the task's reward as it finishes. A HF model's engines have LoRA on and serve a fresh adapter of
  the trainer's rank under the policy's adapter name, as the bus's engines serve the policy's adapter (rows
  with an adapter take the slower path). Counted the same way: the samples and generated tokens of jobs
  2..K over the time from the first job's end to the last one's.

**Placement** (``--placement``; default ``disaggregated`` where this process may run on 2 CPUs or more, as a
real deployment keeps the trainer on its own pool): the bus run gets ``placement="disaggregated"``
(``launch.placement``: the controller, its engines, the executors and Redis on the engines' CPU set, the
trainer on the other), and the direct loop's engines *and its own client process* (this one, every thread,
for the direct run; ``placement.pin_process``) run on the same engine CPU set, with the engines' torch
threads and ``OMP_NUM_THREADS`` those the bus run's engines get (``plan``'s ``engine_threads``). Both sides
then generate on the same cores; the bus side carries its controller, executors and Redis there besides, the
direct side its client. Each side's CPUs, read back from the running processes, are printed and written to
the JSON. ``shared`` leaves every process on every CPU, the trainer included (the earlier figures).

**Profile**: while each run goes, every process of this bench's tree is sampled from ``/proc/<pid>/stat``
(utime + stime, every ``CPU_SAMPLE_S``) and put in a role by its command line (engines, controller,
executors, redis, trainer, the launcher; the direct side's client); each role's CPU over the steady window,
per sample delivered, is printed per run and as medians: the CPU the bus adds on the engine cores.

Per repeat: samples/s and tokens/s (generated tokens) of each side and their ratios bus / direct; then the
median and interquartile range over the repeats.

The policy is frozen by default: the run's learning rate is 1e-12 (the trainer must have one above 0), so the
trainer still computes every update, publishes every version and the engines still load each one, but the
weights stay the initial ones to float32 precision, and both sides sample the same distribution (a learning
policy changes its response lengths: the tiny LM's answers got shorter within a few steps, which moves
tokens/s and samples/s apart for reasons that are not the bus). With it, no batch is too stale to train
(``--max-staleness`` = the steps): with nothing learned no sample is off-policy, and a dropped batch is the
trainer's choice, not a cost of the bus (a SmolLM2 smoke run with the defaults dropped a batch in 3 steps).
``--learn`` keeps the run's own learning rate, staleness bound and requests in flight (the stale groups are
printed; the trainer may then hold the supply back); each run's tokens per sample are printed either way.

Target: the bus keeps >= 0.97 of the direct loop's throughput (both ratios are judged). A verdict needs a
quiet machine judged from outside (``bench/verdict.py``: the 1-minute load average before the bench, at
most 1, waited for up to ``--settle`` seconds; other processes' CPU while it runs, at most 25% of the cores)
and at least 3 repeats; an interquartile range crossing the target says so instead.

The run is ``rollout-bus run``'s own defaults in async mode (the tiny LM: 16 groups x 8 samples, 6 new
tokens; ``--model smollm2``: the HF-model defaults, 4 x 4, 48 tokens, T=0.6, LoRA 8,16) with what keeps
the two sides the same work: the frozen policy above, no held-out evals (``--eval-groups 0``: they would
share the engines) and no dynamic sampling (``--no-dynamic-sampling``: it draws more groups than it keeps). Flags after ``--`` go to
the run (``rollout-bus run --help``); ``--quick`` is a smoke configuration, not figures to quote.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import inspect
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from verdict import (  # noqa: E402
    Load,
    OutsideLoad,
    ProcKey,
    Row,
    Target,
    read_procs,
    reasons,
    spread,
    table,
    tree_of,
    wait_for_quiet,
)

TARGET = Target(">=", 0.97)
"""The bus keeps at least this share of the direct loop's throughput."""
SIDES = ("bus", "direct")
FROZEN_LR = "1e-12"
"""The run's learning rate by default: every update computed and published, the weights unchanged in float32."""
MASKED_FLAGS = ("--port", "--weights-root")
"""Engine flags whose values differ between the bus's engines and the direct loop's by construction."""
SUPPLY_TIMEOUT_S = 1800.0
"""The run's rollout timeout with every request in flight from the start: the last one queued waits for all the
others, and must not expire (be asked again, or given up by its executor) meanwhile."""
JOB_TIMES = ("wall_s", "prepare_s", "rollout_s", "publish_s")
"""An executor's timings of one job (``executor.service``'s ``RolloutCompleted`` metrics): all of it, the request
and data before generating, generating and scoring, converting and publishing the batch."""
CPU_SAMPLE_S = 0.5
"""How often the profile reads ``/proc`` (about 2 ms of CPU a read on the development machine)."""
ROLE_ORDER = ("engines", "controller", "executors", "redis", "launcher", "trainer", "bus-metrics", "client", "other")
ROLE_WORDS = {"controller": "controller", "executor": "executors", "trainer": "trainer", "status": "bus-metrics"}
"""``python -m rollout_bus <word> ...``: the role of a run's child (``launch.job.ROLE``)."""


# --- pure parts (tests/unit/test_bench_bus_tax.py) ----------------------------------------------------------

@dataclass(frozen=True)
class Point:
    """One finished unit of work: a trainer step (bus) or a job (direct), when it ended and what it held."""

    t: float
    samples: float
    tokens: float


@dataclass(frozen=True)
class Steady:
    """The steady state of a run: what came after the first point, over the time from the first to the last."""

    samples: float
    tokens: float
    window_s: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.window_s if self.window_s > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.window_s if self.window_s > 0 else float("nan")

    @property
    def tokens_per_sample(self) -> float:
        return self.tokens / self.samples if self.samples else float("nan")


def steady(points: Sequence[Point]) -> Steady:
    """``summary.json``'s steady state (``launch.report.PolicySummary.samples_per_s``) for any series of points:
    the first point (warm-up, the first batch) is left out, the rest is counted over the time from it to the
    last. ``ValueError`` with fewer than two points."""
    ordered = sorted(points, key=lambda p: p.t)
    if len(ordered) < 2:
        raise ValueError(f"a steady state needs at least 2 points, got {len(ordered)}")
    rest = ordered[1:]
    return Steady(sum(p.samples for p in rest), sum(p.tokens for p in rest), ordered[-1].t - ordered[0].t)


def schedule(repeats: int) -> list[tuple[int, str]]:
    """The runs in order, ABAB: (repeat, side) with the bus first in every repeat."""
    return [(rep, side) for rep in range(repeats) for side in SIDES]


def per_repeat_ratios(bus: Sequence[float], direct: Sequence[float]) -> list[float]:
    """bus / direct of each repeat (paired by repeat); a repeat whose direct figure is 0 or NaN is left out."""
    return [b / d for b, d in zip(bus, direct, strict=True) if d and d == d and b == b]


def ratio_rows(figures: dict[str, dict[str, list[float]]], load: Load) -> list[Row]:
    """The verdict rows: samples/s and tokens/s of the bus over the direct loop's, per repeat.
    ``figures[side][measure]`` lists each repeat's value (measures ``samples_per_s``, ``tokens_per_s``)."""
    rows = []
    for measure, label in (("samples_per_s", "samples/s: bus / direct loop"),
                           ("tokens_per_s", "generated tokens/s: bus / direct loop")):
        values = per_repeat_ratios(figures["bus"][measure], figures["direct"][measure])
        rows.append(Row("bus_tax", label, values, TARGET, load,
                        note="" if values else "no repeat finished on both sides"))
    return rows


def same_command(a: Sequence[str], b: Sequence[str], masked: Sequence[str] = MASKED_FLAGS) -> list[str]:
    """Where two engine command lines differ, apart from the values of ``masked`` flags (and the interpreter);
    empty when they are the same."""
    def norm(cmd: Sequence[str]) -> list[str]:
        out, skip = [], False
        for arg in list(cmd)[1:]:
            if skip:
                out.append("<masked>")
                skip = False
                continue
            out.append(arg)
            skip = arg in masked
        return out

    na, nb = norm(a), norm(b)
    if na == nb:
        return []
    diffs = [f"{x!r} != {y!r}" for x, y in zip(na, nb, strict=False) if x != y]
    if len(na) != len(nb):
        diffs.append(f"{len(na)} != {len(nb)} arguments")
    return diffs


def launched_commands(log_text: str) -> list[list[str]]:
    """The engine command lines of a controller log (its ``launching <id>: <command>`` lines)."""
    out = []
    for line in log_text.splitlines():
        head, sep, cmd = line.partition(" launching ")
        if sep and ": " in cmd:
            out.append(shlex.split(cmd.split(": ", 1)[1]))
    return out


def default_placement(cpus: int) -> str:
    """``disaggregated`` where there are CPUs to split between the engines and the trainer, else ``shared``."""
    return "disaggregated" if cpus >= 2 else "shared"


def bus_flags(*, steps: int, executors: int, engines: int, model: str | None, learn: bool,
              placement: str) -> list[str]:
    """The ``rollout-bus run`` flags of the bus side, before the user's (theirs win). Unless ``learn``: the frozen
    policy, no batch too stale, and every request in flight from the start (the trainer never holds the
    executors back), with a rollout timeout the last one queued outlives."""
    flags = ["--mode", "async", "--steps", str(steps), "--executors", str(executors), "--engines", str(engines),
             "--placement", placement, "--no-progress", "--no-plot"]
    if model is not None:
        flags += ["--model", model, "--eval-groups", "0", "--no-dynamic-sampling"]
    if not learn:
        flags += ["--lr", FROZEN_LR, "--max-staleness", str(steps), "--in-flight", str(steps),
                  "--rollout-timeout-s", f"{SUPPLY_TIMEOUT_S:g}"]
    return flags


def delivered_points(batches: Sequence[tuple[str, int, int]], tokens: Mapping[str, float], k: int) -> list[Point]:
    """The first ``k`` batches the bus delivered, by time: ``batches`` lists ``(batch_id, ts_ms, n_samples)`` of
    each ``BatchReady`` (a batch id seen again is the same batch), ``tokens`` the generated tokens of each batch
    id (NaN where unknown)."""
    first: dict[str, tuple[int, int]] = {}
    for batch_id, ts_ms, n in batches:
        if batch_id not in first or ts_ms < first[batch_id][0]:
            first[batch_id] = (ts_ms, n)
    ordered = sorted(first.items(), key=lambda item: (item[1][0], item[0]))[:k]
    return [Point(ts / 1000.0, float(n), float(tokens.get(batch_id, float("nan")))) for batch_id, (ts, n) in ordered]


def role_of(argv: Sequence[str], comm: str = "") -> str:
    """The role of a process of the bench's tree, by its command line (``launch.job.ROLE``: ``python -m
    rollout_bus <role>``; the engines ``python -m rollout_bus.engine.server``) or its name (redis-server)."""
    if comm.startswith("redis-server") or (argv and Path(argv[0]).name.startswith("redis-server")):
        return "redis"
    args = list(argv)
    for i, arg in enumerate(args[:-1]):
        if arg == "-m":
            module = args[i + 1]
            if module.startswith("rollout_bus.engine"):
                return "engines"
            if module == "rollout_bus" and i + 2 < len(args):
                return ROLE_WORDS.get(args[i + 2], "other")
    return "other"


Ticks = Mapping[ProcKey, int]


def cpu_between(samples: Sequence[tuple[float, Ticks]], roles: Mapping[ProcKey, str], t0: float, t1: float
                ) -> tuple[dict[str, int], float]:
    """Clock ticks of CPU each role used between the first sample at or after ``t0`` and the last at or before
    ``t1``, and the seconds between those two samples. A process already there at the first counts from its
    ticks then, one that appeared later from 0 (it started in between), each up to the last sample it was seen
    in up to the second; a process without a role counts as ``other``. No two such samples: ``({}, 0.0)``."""
    inside = [(t, ticks) for t, ticks in sorted(samples, key=lambda s: s[0]) if t0 <= t <= t1]
    if len(inside) < 2:
        return {}, 0.0
    start = inside[0][1]
    last: dict[ProcKey, int] = {}
    for _, ticks in inside:
        last.update(ticks)
    out: dict[str, int] = {}
    for key, used in last.items():
        role = roles.get(key, "other")
        out[role] = out.get(role, 0) + max(0, used - start.get(key, 0))
    return out, inside[-1][0] - inside[0][0]


def ms_per_sample(ticks: float, hz: int, span_s: float, samples_per_s: float) -> float:
    """CPU milliseconds per sample delivered: ``ticks`` over ``span_s`` seconds, at ``samples_per_s``."""
    if span_s <= 0 or hz <= 0 or not samples_per_s or samples_per_s != samples_per_s:
        return float("nan")
    return ticks / hz / span_s / samples_per_s * 1000.0


# --- watching a run: its processes' CPU, its batch stream ------------------------------------------------------

class CpuWatch:
    """Samples the CPU ticks of every process of this bench's tree every ``interval_s``, from ``/proc``, and puts
    each in a role when first seen (``role_of``; this process is ``root_role``), with its CPUs and
    ``OMP_NUM_THREADS`` as the kernel has them then. ``with CpuWatch("launcher") as w: ...``."""

    def __init__(self, root_role: str, interval_s: float = CPU_SAMPLE_S, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self.root_role = root_role
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, dict[ProcKey, int]]] = []
        """(monotonic, wall clock, ticks per process)."""
        self.roles: dict[ProcKey, str] = {}
        self.seen: dict[ProcKey, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> CpuWatch:
        self._sample()
        self._thread = threading.Thread(target=self._run, name="cpu-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        procs = read_procs()
        mine = tree_of(self.root, procs)
        now, wall = time.monotonic(), time.time()
        for key in mine:
            if key not in self.roles:
                self._classify(key)
        self.samples.append((now, wall, {key: procs[key].ticks for key in mine}))

    def _classify(self, key: ProcKey) -> None:
        pid = key[0]
        try:
            argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            cpus = sorted(os.sched_getaffinity(pid))
        except (OSError, ProcessLookupError):
            argv, comm, cpus = [], "", []
        omp = None
        with contextlib.suppress(OSError):
            for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                if item.startswith(b"OMP_NUM_THREADS="):
                    omp = item.split(b"=", 1)[1].decode(errors="replace")
        role = self.root_role if pid == self.root else role_of(argv, comm)
        self.roles[key] = role
        self.seen[key] = {"pid": pid, "role": role, "cpus": cpus, "omp_num_threads": omp}

    def cpus_by_role(self) -> dict[str, list[int]]:
        """The CPUs each role's processes had when first seen, together."""
        out: dict[str, set[int]] = {}
        for info in self.seen.values():
            out.setdefault(info["role"], set()).update(info["cpus"])
        return {role: sorted(cpus) for role, cpus in sorted(out.items(), key=lambda r: _role_rank(r[0]))}

    def threads_by_role(self) -> dict[str, list[str]]:
        out: dict[str, set[str]] = {}
        for info in self.seen.values():
            out.setdefault(info["role"], set()).add(str(info["omp_num_threads"]))
        return {role: sorted(v) for role, v in out.items()}

    def profile(self, t0: float, t1: float, samples_per_s: float, *, wall: bool) -> dict[str, Any]:
        """Each role's CPU between ``t0`` and ``t1`` (wall-clock or monotonic seconds): milliseconds per sample
        at ``samples_per_s``, and share of one CPU."""
        series = [(w if wall else m, ticks) for m, w, ticks in self.samples]
        ticks, span = cpu_between(series, self.roles, t0, t1)
        hz = os.sysconf("SC_CLK_TCK")
        ordered = sorted(ticks.items(), key=lambda r: _role_rank(r[0]))
        return {"span_s": span,
                "ms_per_sample": {role: ms_per_sample(t, hz, span, samples_per_s) for role, t in ordered},
                "cpu_share": {role: (t / hz / span if span > 0 else float("nan")) for role, t in ordered}}


def _role_rank(role: str) -> int:
    return ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER)


class BatchTap:
    """Reads a run's ``BatchReady`` events of ``policy`` and its executors' ``RolloutCompleted`` live from the
    run's Redis (plain ``XREAD`` from the start of both streams; events are msgpack, ``events.schema.decode``),
    until ``want`` batches and their completions are in, or ``stop``."""

    def __init__(self, url: str, keys: Any, policy: str, want: int) -> None:
        self.url = url
        self.streams = {keys.batch_stream(policy): "0-0", keys.rollout_stream: "0-0"}
        self.policy = policy
        self.want = want
        self.batches: list[tuple[str, int, int]] = []
        self.tokens: dict[str, float] = {}
        self.jobs: dict[str, dict[str, float]] = {}
        """The executor's timings of each batch's job (``RolloutCompleted.metrics``: ``JOB_TIMES``)."""
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batch-tap", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def done(self) -> bool:
        if len(self.batches) < self.want:
            return False
        firsts = delivered_points(self.batches, self.tokens, self.want)
        return all(p.tokens == p.tokens for p in firsts)

    def _run(self) -> None:
        from rollout_bus.events.connection import connect
        from rollout_bus.events.errors import DecodeError
        from rollout_bus.events.schema import BatchReady, RolloutCompleted, decode

        try:
            client = connect(self.url, socket_timeout_s=10.0)
            while not self._stop.is_set() and not self.done():
                reply: Any = client.xread(dict(self.streams), count=1000, block=200)  # type: ignore[arg-type]
                for stream, entries in reply or []:
                    name = stream.decode() if isinstance(stream, bytes) else str(stream)
                    for entry_id, fields in entries:
                        self.streams[name] = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                        try:
                            event = decode(fields)
                        except DecodeError:
                            continue
                        if isinstance(event, BatchReady) and event.policy == self.policy:
                            self.batches.append((event.batch_id, event.ts_ms, event.n_samples))
                        elif isinstance(event, RolloutCompleted) and event.policy == self.policy and event.batch_id:
                            mean = float(event.metrics.get("response_len_mean", float("nan")))
                            self.tokens[event.batch_id] = (float(round(mean * event.n_samples)) if mean == mean
                                                           else mean)
                            self.jobs[event.batch_id] = {k: float(event.metrics[k]) for k in JOB_TIMES
                                                         if k in event.metrics}
            client.close()
        except Exception as exc:  # the run's Redis stopped under us, or never answered
            if not self._stop.is_set():
                self.error = f"{type(exc).__name__}: {exc}"


# --- the bus side --------------------------------------------------------------------------------------------

@dataclass
class RunFigures:
    side: str
    repeat: int
    steady: Steady
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"side": self.side, "repeat": self.repeat, "samples_per_s": self.steady.samples_per_s,
                "tokens_per_s": self.steady.tokens_per_s, "window_s": self.steady.window_s,
                "samples": self.steady.samples, "tokens": self.steady.tokens,
                "tokens_per_sample": self.steady.tokens_per_sample, "wall_s": self.wall_s, **self.extra}


def step_points(metrics_log: Path) -> tuple[list[Point], list[dict[str, Any]]]:
    """The trainer's steps from its JSONL metric log (the first record of each step: a restart appends)."""
    seen: dict[int, dict[str, Any]] = {}
    for line in metrics_log.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            seen.setdefault(int(record["step"]), record)
    records = [seen[s] for s in sorted(seen)]
    return [Point(float(r["time"]), float(r["metrics"]["batch/samples"]), float(r["metrics"]["batch/tokens"]))
            for r in records], records


def run_bus(config: Any, repeat: int) -> tuple[RunFigures, list[list[str]]]:
    """One bus run: ``run_job`` with a ``BatchTap`` on its Redis (from ``on_start``) and a ``CpuWatch`` on its
    processes; the figures are what the bus delivered (``delivered_points``), the trainer's beside them."""
    from rollout_bus.launch.job import run_job

    policy = config.policies()[0]
    taps: list[BatchTap] = []

    def on_start(handle: Any) -> None:
        tap = BatchTap(handle.url, handle.keys, policy, config.steps)
        taps.append(tap)
        tap.start()

    with CpuWatch("launcher") as watch:
        try:
            result = run_job(config, on_start=on_start)
        finally:
            for tap in taps:
                tap.stop()
    if not taps:
        raise RuntimeError("the run never started its roles: no batch stream to read")
    tap = taps[-1]
    points = delivered_points(tap.batches, tap.tokens, config.steps)
    if len(points) < config.steps or any(p.tokens != p.tokens for p in points):
        raise RuntimeError(f"read {len(points)} of the run's {config.steps} batches ({tap.error or 'no error'}); "
                           f"tokens of {sum(p.tokens == p.tokens for p in points)}")
    st = steady(points)
    steps, records = step_points(result.out / "metrics" / f"{result.namespace}-{policy}.jsonl")
    trainer = steady(steps)
    summary = result.summaries[policy]
    rest = records[1:]
    busy = sum(float(r["metrics"]["time/update_s"]) + float(r["metrics"]["time/weight_publish_s"]) for r in rest)
    delivered_tokens = sum(p.tokens for p in points)
    trained_tokens = sum(p.tokens for p in steps)
    profile = watch.profile(points[0].t, points[-1].t, st.samples_per_s, wall=True)
    ids = [b for b, _ in sorted({b: ts for b, ts, _ in tap.batches}.items(), key=lambda item: (item[1], item[0]))]
    timed = [tap.jobs.get(b, {}) for b in ids[1:config.steps]]
    job_s = {k: statistics.fmean([t[k] for t in timed if k in t]) if any(k in t for t in timed) else float("nan")
             for k in JOB_TIMES}
    busy_jobs = sum(t.get("wall_s", 0.0) for t in timed)
    placement: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        placement = json.loads((result.out / "summary.json").read_text()).get("placement", {})
    extra = {"trainer_samples_per_s": trainer.samples_per_s,
             "trainer_steps_per_s": (len(steps) - 1) / trainer.window_s if trainer.window_s > 0 else float("nan"),
             "trainer_window_s": trainer.window_s,
             "summary_samples_per_s": summary["samples_per_s"], "steps": summary["steps"],
             "stale_groups": summary["stale_groups"], "batches_unused": summary["batches_unused"],
             "staleness_hist": summary["staleness_hist"],
             "trainer_busy_share": busy / trainer.window_s if trainer.window_s > 0 else float("nan"),
             "job_s": job_s, "busy_share": busy_jobs / st.window_s / max(1, min(config.executors, config.in_flight))
             if st.window_s > 0 else float("nan"),
             "batches_read": len(tap.batches), "tokens_delivered": delivered_tokens, "tokens_trained": trained_tokens,
             "cpus": watch.cpus_by_role(), "omp_num_threads": watch.threads_by_role(),
             "placement_observed": placement.get("observed"), "profile": profile, "faults": result.faults}
    controller_log = result.out / "logs" / "controller.log"
    commands = launched_commands(controller_log.read_text(errors="replace")) if controller_log.is_file() else []
    return RunFigures("bus", repeat, st, result.wall_s, extra), commands


# --- the direct side -----------------------------------------------------------------------------------------

@dataclass
class Work:
    """What both sides do, resolved once: the model, the prompts, the sampling, the reward, the engines."""

    config: Any
    init: Path
    task: dict[str, Any]
    item: Callable[[int], dict[str, Any]]
    reward: Callable[[Any], Any]
    sampling_params: dict[str, Any]
    lora: tuple[int, int] | None
    policy: str
    jobs_at_once: int
    placement: Any = None
    """``launch.placement.Placement`` of the bus run, which the direct loop's engines and client follow."""


@dataclass
class _Sample:
    prompt_ids: list[int]
    label: Any
    metadata: dict[str, Any]
    response_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    reward: float = 0.0


def resolve_work(config: Any, init_dir: Path) -> Work:
    """The model directory, task, data source, reward and sampling parameters of ``config``, as the run
    resolves them (``launch.job``) and as its trainer asks for them (``trainer.client``)."""
    from rollout_bus.events.rollouts import SamplingParams

    policy = config.policies()[0]
    jobs_at_once = max(1, min(config.executors, config.in_flight))
    if config.model is None:
        from rollout_bus.lm.tokenizer import EOS_ID
        from rollout_bus.tasks.arithmetic import ArithmeticSource, exact_match
        from rollout_bus.tasks.warmstart import WarmStartConfig, warm_start_cached

        init = warm_start_cached(init_dir, WarmStartConfig(steps=config.warm_steps, keep=config.warm_keep,
                                                           digits=config.digits, seed=config.seed))
        task: dict[str, Any] = {"digits": config.digits, "seed": config.seed}
        source: Any = ArithmeticSource(**task)
        stop: tuple[int, ...] = (EOS_ID,)
        return Work(config, init, task, source.item, exact_match,
                    SamplingParams(temperature=config.temperature, max_new_tokens=config.max_new_tokens,
                                   stop_token_ids=stop).to_sglang(), None, policy, jobs_at_once)
    from rollout_bus.launch.job import resolve_model, task_options
    from rollout_bus.lm import hf_tokenizer
    from rollout_bus.tasks.math_reward import reward
    from rollout_bus.tasks.math_words import MathWordsSource

    init = resolve_model(config.model)
    task = task_options(config, init)
    source = MathWordsSource(**task)
    stop = hf_tokenizer.load(str(init)).stop_token_ids  # the trainer's: EOS and the generation config's
    spec = config.lora_spec()
    lora = (int(spec.split(",")[0]), int(spec.split(",")[1])) if spec else None
    return Work(config, init, task, source.item, reward,
                SamplingParams(temperature=config.temperature, max_new_tokens=config.max_new_tokens,
                               stop_token_ids=stop).to_sglang(), lora, policy, jobs_at_once)


def controller_argv(config: Any, init: Path, weights_root: Path, placement: Any = None) -> list[str]:
    """The controller arguments ``launch.job.run_job`` gives that shape the engines' command line (under a
    disaggregated ``placement``, the engines' torch threads too)."""
    from rollout_bus.launch.job import _health_args, _pool_args

    threads = (["--engine-arg=--torch-threads", f"--engine-arg={placement.engine_threads}"]
               if placement is not None and placement.disaggregated else [])
    return ["--num-engines", str(config.engines), "--model-path", str(init), "--weights-root", str(weights_root),
            "--base-policy", config.base_policy(), "--seed", str(config.seed), *_pool_args(config),
            "--token-delay-ms", str(config.token_delay_ms),
            "--engine-arg=--max-batch-size", f"--engine-arg={config.engine_max_batch}", *_health_args(config),
            *threads]


def engine_specs(work: Work, weights_root: Path) -> list[Any]:
    """The launch specs of the base pool's engines, as the controller makes them (fresh ports)."""
    from rollout_bus.controller.cli import parse_config
    from rollout_bus.controller.lifecycle import launch_spec
    from rollout_bus.events.embedded import free_port

    cfg, _ = parse_config(controller_argv(work.config, work.init, weights_root, work.placement))
    ids = sorted(e for e, pool in cfg.expected_engines().items() if pool == cfg.base_policy)
    return [launch_spec(cfg, e, free_port(), addresses=("127.0.0.1", "127.0.0.1")) for e in ids]


def engine_command(work: Work, weights_root: Path) -> list[str]:
    from rollout_bus.controller.backends import CpuBackend

    return CpuBackend().command(engine_specs(work, weights_root)[0])


def write_adapter(work: Work, weights_root: Path) -> Path:
    """A fresh LoRA adapter of the trainer's rank and alpha on the model (what the trainer publishes as v0)."""
    import torch

    from rollout_bus.lm.hf import save_version
    from rollout_bus.trainer.hf_config import LoraSettings
    from rollout_bus.trainer.hf_learner import load_causal_lm, with_lora

    assert work.lora is not None
    directory = weights_root / work.policy / "v0"
    if not (directory / "adapter_config.json").is_file():
        torch.manual_seed(work.config.seed)
        model = with_lora(load_causal_lm(str(work.init)), LoraSettings(r=work.lora[0], alpha=work.lora[1]))
        save_version(directory, model, policy=work.policy, version=0)
    return directory


def _wait_healthy(url: str, handle: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not handle.alive():
            raise RuntimeError(f"engine at {url} exited:\n{handle.log_tail()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2.0) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"engine at {url} not healthy after {timeout_s:.0f}s:\n{handle.log_tail()}")


async def drive(urls: Sequence[str], work: Work, jobs: int, lora_path: str | None,
                durations: list[float] | None = None) -> list[Point]:
    """The direct loop: ``jobs`` jobs, ``work.jobs_at_once`` at a time, every sample of a job in flight at once,
    each group scored as it finishes; one point per job at its end (and its duration in ``durations``)."""
    from rollout_bus.engine.http_client import EngineClient, close_shared_session

    api_key = os.environ.get("ROLLOUT_BUS_ENGINE_API_KEY") or None
    clients = {u: EngineClient(u, timeout_s=600.0, api_key=api_key) for u in urls}
    in_flight = dict.fromkeys(urls, 0)
    cfg = work.config
    next_job = 0
    points: list[Point] = []

    async def sample(s: _Sample, rid: str) -> None:
        url = min(urls, key=lambda u: in_flight[u])  # the least loaded engine, as the executors' router
        in_flight[url] += 1
        try:
            reply = await clients[url].generate(s.prompt_ids, work.sampling_params, return_logprob=True, rid=rid,
                                                lora_path=lora_path)
        finally:
            in_flight[url] -= 1
        s.response_ids = [int(i) for i in reply["output_ids"]]
        s.log_probs = [float(e[0]) for e in reply["meta_info"]["output_token_logprobs"]]

    async def group(job: int, g: int) -> list[_Sample]:
        item = work.item(job * cfg.n_groups + g)
        samples = [_Sample(list(item["prompt_ids"]), item.get("label"), dict(item.get("metadata") or {}))
                   for _ in range(cfg.n_samples)]
        await asyncio.gather(*(sample(s, f"direct-{job}-{g}-{j}") for j, s in enumerate(samples)))
        for s in samples:
            value = work.reward(s)
            s.reward = float(await value if inspect.isawaitable(value) else value)
        return samples

    async def worker() -> None:
        nonlocal next_job
        while next_job < jobs:
            job, next_job = next_job, next_job + 1
            began = time.monotonic()
            groups = await asyncio.gather(*(group(job, g) for g in range(cfg.n_groups)))
            done = [s for g in groups for s in g]
            points.append(Point(time.monotonic(), len(done), sum(len(s.response_ids) for s in done)))
            if durations is not None:
                durations.append(points[-1].t - began)

    try:
        await asyncio.gather(*(worker() for _ in range(work.jobs_at_once)))
    finally:
        await close_shared_session()
    return points


@contextlib.contextmanager
def pinned(cpus: Sequence[int] | None, home: Sequence[int]) -> Iterator[None]:
    """This process, every thread of it, on ``cpus`` (None: left where it is), back on ``home`` after; the
    processes it starts meanwhile inherit the set."""
    from rollout_bus.launch.placement import pin_process

    if cpus is None:
        yield
        return
    pin_process(os.getpid(), cpus)
    try:
        yield
    finally:
        pin_process(os.getpid(), home)


@contextlib.contextmanager
def environ(extra: Mapping[str, str]) -> Iterator[None]:
    """``extra`` in this process's environment (what the engines it launches inherit), as it was after."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_direct(work: Work, repeat: int, weights_root: Path, logs: Path, home: Sequence[int]
               ) -> tuple[RunFigures, list[str]]:
    """One direct run: the engines and this process on the bus run's engine CPUs (disaggregated), with its engine
    environment (``OMP_NUM_THREADS``), the loop, the engines stopped; a ``CpuWatch`` on all of it."""
    from rollout_bus.controller.backends import CpuBackend, launch

    placement = work.placement
    cpus = placement.engine_cpus if placement is not None and placement.disaggregated else None
    engine_env = placement.env("controller") if placement is not None else {}  # what the controller passes on
    backend = CpuBackend()
    specs = engine_specs(work, weights_root)
    started = time.monotonic()
    handles: list[Any] = []
    with pinned(cpus, home), CpuWatch("client") as watch:
        try:
            with environ(engine_env):
                for spec in specs:  # one at a time, so a failed start still stops the others
                    handle = launch(backend, spec, logs)
                    handles.append(handle)
                    _wait_healthy(spec.url, handle, 300.0)
            lora_path = None
            if work.lora is not None:
                from rollout_bus.engine.http_client import EngineClient, close_shared_session

                lora_path = f"{work.policy}@v0"
                adapter = str(weights_root / work.policy / "v0")

                async def load_all() -> None:
                    try:
                        for spec in specs:
                            await EngineClient(spec.url, timeout_s=300.0).load_lora_adapter(lora_path, adapter)
                    finally:
                        await close_shared_session()

                asyncio.run(load_all())
            durations: list[float] = []
            points = asyncio.run(drive([s.url for s in specs], work, work.config.steps, lora_path, durations))
        finally:
            for handle in handles:
                asyncio.run(handle.stop())
    st = steady(points)
    rest = [d for _, d in sorted(zip([p.t for p in points], durations, strict=True))][1:]
    extra = {"cpus": watch.cpus_by_role(), "omp_num_threads": watch.threads_by_role(),
             "job_s": {"wall_s": statistics.fmean(rest) if rest else float("nan")},
             "busy_share": sum(rest) / st.window_s / work.jobs_at_once if st.window_s > 0 else float("nan"),
             "profile": watch.profile(min(p.t for p in points), max(p.t for p in points), st.samples_per_s,
                                      wall=False)}
    return RunFigures("direct", repeat, st, time.monotonic() - started, extra), backend.command(specs[0])


# --- main ----------------------------------------------------------------------------------------------------

def _median_iqr(values: Sequence[float]) -> str:
    if not values:
        return "-"
    s = spread(values)
    return f"{s.median:8.1f} [IQR {s.q1:.1f}-{s.q3:.1f}]"


def _ms(value: float) -> str:
    return "-" if value != value else f"{value:.3g}"


def _profile_line(profile: dict[str, Any]) -> str:
    per = profile["ms_per_sample"]
    share = profile["cpu_share"]
    return ", ".join(f"{role} {_ms(v)} ({share[role]:.0%})" for role, v in per.items())


def median_profiles(runs: Sequence[RunFigures], side: str) -> dict[str, float]:
    """The median over a side's runs of each role's CPU milliseconds per sample (a role missing from a run: 0)."""
    profiles = [r.extra["profile"]["ms_per_sample"] for r in runs if r.side == side and "profile" in r.extra]
    roles = sorted({role for prof in profiles for role in prof}, key=_role_rank)
    return {role: statistics.median([prof.get(role, 0.0) for prof in profiles]) for role in roles}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the bench and prints its table; returns the figures per run, the ratio rows and the load."""
    from rollout_bus.launch.placement import PLACEMENTS, PlacementError, available_cpus, plan

    argv = list(sys.argv[1:] if argv is None else argv)
    run_flags: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, run_flags = argv[:cut], argv[cut + 1:]
    home = available_cpus()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, metavar="smollm2|DIR", help="default: the tiny LM")
    p.add_argument("--placement", choices=PLACEMENTS, default=default_placement(len(home)),
                   help="disaggregated: the bus run's trainer on CPUs of its own, the direct loop (engines and "
                        "client) on the bus run's engine CPUs; shared: every process on every CPU "
                        f"(default here: {default_placement(len(home))})")
    p.add_argument("--repeats", type=int, default=None, help="bus and direct runs each (default 5; quick 2)")
    p.add_argument("--steps", type=int, default=None,
                   help="trainer steps of a bus run = batches counted = jobs of a direct run (default: tiny LM 200, "
                        "a HF model 6; quick 20 and 3)")
    p.add_argument("--learn", action="store_true",
                   help="train with the run's learning rate, staleness bound and requests in flight (default: a "
                        "frozen policy, every request in flight; see above)")
    p.add_argument("--executors", type=int, default=1)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="a smoke run: fewer steps and repeats, figures not to quote")
    p.add_argument("--settle", type=float, default=90.0,
                   help="seconds to wait at most for the 1-minute load average to fall to 1 before starting")
    p.add_argument("--json", default=None, metavar="FILE", help="write every run's figures and the rows here")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep the runs' directories here (default: a temp dir)")
    args = p.parse_args(argv)
    hf = args.model is not None
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    steps = args.steps if args.steps is not None else ({(False, False): 200, (False, True): 6, (True, False): 20,
                                                        (True, True): 3}[(args.quick, hf)])
    if repeats < 1 or steps < 2:
        p.error("--repeats must be >= 1 and --steps >= 2 (the steady state leaves the first step out)")

    from rollout_bus.launch.cli import build_parser, config_from_args
    from rollout_bus.launch.job import _engine_count

    base = bus_flags(steps=steps, executors=args.executors, engines=args.engines, model=args.model,
                     learn=args.learn, placement=args.placement)  # before the run flags: theirs win
    config = config_from_args(build_parser().parse_args([*base, *run_flags]))
    problems = [msg for bad, msg in (
        (config.agent is not None, "agent runs are not measured here"),
        (config.trainers != 1, "one trainer only"),
        (config.autoscale is not None, "a fixed number of executors only"),
        (config.eval_problems() > 0, "no held-out evals (they share the engines): --eval-groups 0"),
        (config.filters_groups(), "no dynamic sampling (it draws more than it keeps): --no-dynamic-sampling"),
        (config.eval_engines > 0, "no eval engines")) if bad]
    if problems:
        p.error("; ".join(problems))
    try:  # the run's own plan (launch.job.run_job makes the same one)
        placement = plan(config.placement, engine_cpus=config.engine_cpus, trainer_cpus=config.trainer_cpus,
                         engines=_engine_count(config), trainers=config.trainers)
    except PlacementError as exc:
        p.error(str(exc))

    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-bus-tax-"))
    tmp.mkdir(parents=True, exist_ok=True)
    init_dir = tmp / "init"
    config = dataclasses.replace(config, init_dir=str(init_dir))
    work = resolve_work(config, init_dir)
    work.placement = placement
    direct_root = tmp / "direct-weights"
    direct_root.mkdir(exist_ok=True)
    if work.lora is not None:
        write_adapter(work, direct_root)
    lora = f", LoRA {work.lora[0]},{work.lora[1]}" if work.lora else ""
    print(f"# bus tax: {config.model or 'tiny LM'}{lora}; {steps} steps of {config.n_groups} groups x "
          f"{config.n_samples} samples, {config.max_new_tokens} new tokens, T={config.temperature:g}; "
          f"lr {config.lr:g}, max staleness {config.max_staleness}; {config.engines} engine(s), "
          f"{config.executors} executor(s), in flight {config.in_flight}; {repeats} repeat(s), ABAB; "
          f"{os.cpu_count()} CPUs", flush=True)
    if placement.disaggregated:
        print(f"# placement disaggregated: engine side on CPUs {list(placement.engine_cpus)} (engines' torch threads "
              f"{placement.engine_threads}), the bus run's trainer on CPUs {list(placement.trainer_cpus)}; the "
              f"direct loop's engines and client on CPUs {list(placement.engine_cpus)}", flush=True)
    else:
        print(f"# placement shared: every process of both sides on CPUs {list(home)}, the bus run's trainer "
              "included", flush=True)
    print("# bus:    rollout-bus run --mode async (its redis, controller, engines, executors, a trainer consuming "
          "every batch, weight updates); what the bus delivered: BatchReady 2..K over first..K-th delivery",
          flush=True)
    print(f"# direct: the same engines over HTTP, {work.jobs_at_once} job(s) at a time, every sample of a job in "
          f"flight, scored by the task's reward; no redis, no trainer; jobs 2..K", flush=True)
    print(f"# direct engine: {shlex.join(engine_command(work, direct_root))}", flush=True)

    before = wait_for_quiet(0.0 if args.quick else args.settle)
    print(f"# load average {before:.2f} before the runs", flush=True)
    runs: list[RunFigures] = []
    mismatch: list[str] | None = None
    t0 = time.monotonic()
    try:
        with OutsideLoad() as outside:
            for rep, side in schedule(repeats):
                if side == "bus":
                    out = tmp / f"bus-{rep}"
                    figures, launched = run_bus(dataclasses.replace(config, out=str(out)), rep)
                    if launched and mismatch is None:
                        mismatch = same_command(launched[0], engine_command(work, direct_root))
                        print("# engine command: the direct loop's is the controller's" if not mismatch else
                              f"# WARNING engine command differs from the controller's: {mismatch}", flush=True)
                else:
                    logs = tmp / f"direct-{rep}"
                    figures, _ = run_direct(work, rep, direct_root, logs, home)
                runs.append(figures)
                x = figures.extra
                more = ""
                if side == "bus":
                    more = (f"  trainer {x['trainer_samples_per_s']:.1f} samples/s ({x['trainer_steps_per_s']:.2f} "
                            f"steps/s, busy {x['trainer_busy_share']:.0%}), stale groups {x['stale_groups']:.0f}, "
                            f"tokens delivered/trained {x['tokens_delivered']:.0f}/{x['tokens_trained']:.0f}")
                print(f"  rep {rep} {side:6} {figures.steady.samples_per_s:9.1f} samples/s "
                      f"{figures.steady.tokens_per_s:9.1f} tokens/s {figures.steady.tokens_per_sample:5.2f} "
                      f"tokens/sample  (window {figures.steady.window_s:.1f} s, run {figures.wall_s:.0f} s){more}  "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)
                print(f"      CPU ms/sample (share of a CPU): {_profile_line(x['profile'])}; CPUs "
                      + ", ".join(f"{role} {cpus}" for role, cpus in x["cpus"].items()), flush=True)
                print("      job s (mean of jobs 2..K): " + ", ".join(f"{k} {v:.3g}" for k, v in x["job_s"].items())
                      + f"; {'executors' if side == 'bus' else 'loop'} busy {x['busy_share']:.0%} of the window",
                      flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    load = outside.load
    threads = {side: next((r.extra["omp_num_threads"].get("engines") for r in runs if r.side == side), None)
               for side in SIDES}
    if threads["bus"] != threads["direct"]:
        print(f"# WARNING engines' OMP_NUM_THREADS differ: bus {threads['bus']}, direct {threads['direct']}")
    figs: dict[str, dict[str, list[float]]] = {
        side: {m: [getattr(r.steady, m) for r in runs if r.side == side] for m in ("samples_per_s", "tokens_per_s")}
        for side in SIDES}
    n = min(len(figs["bus"]["samples_per_s"]), len(figs["direct"]["samples_per_s"]))
    figs = {side: {m: v[:n] for m, v in f.items()} for side, f in figs.items()}
    print(f"\n{'side':8} {'samples/s median':>30} {'tokens/s median':>30}  CPUs (read back)")
    cpus: dict[str, dict[str, list[int]]] = {side: next((r.extra["cpus"] for r in runs if r.side == side), {})
                                             for side in SIDES}
    for side in SIDES:
        print(f"{side:8} {_median_iqr(figs[side]['samples_per_s']):>30} {_median_iqr(figs[side]['tokens_per_s']):>30}  "
              + ", ".join(f"{role} {c}" for role, c in cpus[side].items()))
    trainer_rates = [r.extra["trainer_samples_per_s"] for r in runs if r.side == "bus"]
    if trainer_rates:
        print(f"{'trainer':8} {_median_iqr(trainer_rates):>30}  (the bus run's trainer steps, for information)")
    profiles = {side: median_profiles(runs, side) for side in SIDES}
    print("\nCPU ms per sample delivered, median over repeats (steady window):")
    for side in SIDES:
        print(f"  {side:8} " + ", ".join(f"{role} {_ms(v)}" for role, v in profiles[side].items()))
    rows = ratio_rows(figs, load)
    for row in rows:
        row.seconds = time.monotonic() - t0
    print()
    print(table(rows))
    for line in reasons(rows):
        print(f"  {line}")
    print(f"{load.describe()}; target: bus / direct {TARGET}"
          + (" (--quick: a smoke run, not figures to quote)" if args.quick else ""))
    result = {"model": config.model or "tiny", "steps": steps, "repeats": repeats, "quick": args.quick,
              "placement": placement.planned(), "cpus": cpus, "engine_omp_num_threads": threads,
              "config": {k: v for k, v in dataclasses.asdict(config).items() if k != "autoscale"},
              "engine_command_mismatch": mismatch, "runs": [r.to_dict() for r in runs],
              "cpu_ms_per_sample": profiles,
              "load": {"before": load.before, "outside_share": load.outside_share, "wall_s": load.wall_s},
              "rows": [{"figure": r.figure, "values": r.values, "median": statistics.median(r.values) if r.values
                        else None, "verdict": r.verdict.explain()} for r in rows]}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


if __name__ == "__main__":
    main()
