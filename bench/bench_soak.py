"""Soak: the tiny-LM main job for many steps with the janitor on; does anything grow?

Runs the main job (``launch.job.run_job``: controller, engine, executor and trainer processes
on a private redis-server) and, every ``--every`` training steps, samples Redis
(``used_memory``, ``used_memory_dataset``, the number of keys, each stream's length, the
payload index) and the resident memory (VmRSS) of every role: controller, engine(s),
executor(s), trainer. At the end it prints the samples as a table and, for each series, the
growth per 100 steps over the second half of the run (least-squares slope), where a run that
holds memory flat shows only noise. Nothing is a verdict when the 1-minute load average is
above 1 (printed at the start and the end).

The janitor runs every ``--janitor-interval-s`` with ``--retention-max-len`` entries per stream
and ``--payload-max-age-s``; business-key dedupe keys live ``--dedupe-ttl-s``
(``ROLLOUT_BUS_DEDUPE_TTL_S``; the default of 7 days keeps about one key per event published
with a business key for that long, which a run shorter than that never sees flatten).

    python bench/bench_soak.py [--steps 2000] [--every 100] [--json soak.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_bus.events.connection import Guard, connect  # noqa: E402
from rollout_bus.events.names import Keys, logical_stream  # noqa: E402
from rollout_bus.events.paging import discover_streams  # noqa: E402
from rollout_bus.events.registry import Registry  # noqa: E402
from rollout_bus.events.schema import TrainStepDone, decode  # noqa: E402
from rollout_bus.launch.config import RunConfig  # noqa: E402
from rollout_bus.launch.job import RunHandle, run_job  # noqa: E402
from tests.support.fake_rollouts import shared_init_dir  # noqa: E402


@dataclass
class Sample:
    step: int
    t_s: float
    used_memory: int
    used_memory_dataset: int
    keys: int
    dedupe_keys: int
    rq_keys: int
    payloads_indexed: int
    streams: dict[str, int] = field(default_factory=dict)
    rss_kib: dict[str, int] = field(default_factory=dict)


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def take_sample(handle: RunHandle, guard: Guard, step: int, started: float) -> Sample:
    keys: Keys = handle.keys
    info = guard.call(lambda c: c.info("memory"))
    streams = {logical_stream(keys, s): int(guard.call(lambda c, st=s: c.xlen(st)))
               for s in discover_streams(guard.client, keys, guard=guard)}
    dedupe = keys.dedupe("", "").rstrip(":") + "*"

    def count(c: Any, match: str) -> int:
        return sum(1 for _ in c.scan_iter(match=match, count=1000))
    sample = Sample(step=step, t_s=time.monotonic() - started, used_memory=int(info["used_memory"]),
                    used_memory_dataset=int(info.get("used_memory_dataset", 0)),
                    keys=int(guard.call(lambda c: c.dbsize())), dedupe_keys=guard.call(lambda c: count(c, dedupe)),
                    rq_keys=guard.call(lambda c: count(c, "rq:*")),
                    payloads_indexed=int(guard.call(lambda c: c.zcard(keys.payload_index))), streams=streams)
    for child in handle.procs.children:
        if child.alive():
            value = rss_kib(child.pid)
            if value is not None:
                sample.rss_kib[child.name] = value
    for record in guard.call(lambda c: list(Registry(c, keys).engines().values())):
        if record.pid:
            value = rss_kib(record.pid)
            if value is not None:
                sample.rss_kib[record.engine_id] = value
    own = rss_kib(os.getpid())
    if own is not None:
        sample.rss_kib["run (this process)"] = own
    return sample


def latest_step(guard: Guard, keys: Keys) -> int:
    rows = guard.call(lambda c: c.xrevrange(keys.trainer_stream, count=20))
    return max((e.step for e in (decode(f) for _, f in rows) if isinstance(e, TrainStepDone)), default=0)


def slope_per_100(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of value over step, times 100."""
    if len(points) < 2:
        return float("nan")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 100 * sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else float("nan")


def load_average() -> float:
    return os.getloadavg()[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--mode", default="async")
    p.add_argument("--token-delay-ms", type=float, default=0.0,
                   help="engine sleep per decode step: time an accelerator would spend, so a short run spans the TTLs")
    p.add_argument("--janitor-interval-s", type=float, default=10.0)
    p.add_argument("--retention-max-len", type=int, default=2000)
    p.add_argument("--payload-max-age-s", type=float, default=600.0)
    p.add_argument("--dedupe-ttl-s", type=int, default=600)
    p.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the samples here")
    args = p.parse_args(argv)
    os.environ["ROLLOUT_BUS_DEDUPE_TTL_S"] = str(args.dedupe_ttl_s)  # every role inherits it
    load_start = load_average()
    print(f"load average (1 min) at start: {load_start:.2f}", flush=True)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-soak-"))
    try:
        return soak(args, out, load_start)
    finally:
        if not args.out:  # a run directory it made itself: removed again
            shutil.rmtree(out, ignore_errors=True)


def soak(args: argparse.Namespace, out: Path, load_start: float) -> int:
    config = RunConfig(mode=args.mode, steps=args.steps, out=str(out), init_dir=str(shared_init_dir()),
                       token_delay_ms=args.token_delay_ms,
                       progress=False, plot=False, timeout_s=max(3600.0, args.steps * 3.0),
                       controller_args=[f"--janitor-interval-s={args.janitor_interval_s}",
                                        f"--retention-max-len={args.retention_max_len}",
                                        f"--payload-max-age-s={args.payload_max_age_s}"])
    handles: list[RunHandle] = []
    ready = threading.Event()

    def on_start(handle: RunHandle) -> None:
        handles.append(handle)
        ready.set()

    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = run_job(config, on_start=on_start)
        except BaseException as exc:  # reported below
            outcome["error"] = exc
        finally:
            ready.set()

    runner = threading.Thread(target=run, name="soak-run")
    started = time.monotonic()
    runner.start()
    ready.wait()
    samples: list[Sample] = []
    if handles:
        handle = handles[0]
        client = connect(handle.url)
        guard = Guard(client, name="soak")
        next_step = args.every
        while runner.is_alive() and next_step <= args.steps:
            step = latest_step(guard, handle.keys)
            if step >= next_step:
                sample = take_sample(handle, guard, step, started)
                samples.append(sample)
                print(f"step {step}: used_memory {sample.used_memory / 1e6:.2f} MB, keys {sample.keys}, "
                      f"streams {sample.streams}, rss MiB "
                      f"{ {k: round(v / 1024, 1) for k, v in sample.rss_kib.items()} }", flush=True)
                next_step = (step // args.every + 1) * args.every
            time.sleep(0.5)
        client.close()
    runner.join()
    load_end = load_average()
    if "error" in outcome:
        print(f"the run failed: {outcome['error']}", file=sys.stderr)
        return 1
    report(samples, args, load_start, load_end, time.monotonic() - started)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "load_start": load_start, "load_end": load_end,
                                               "samples": [asdict(s) for s in samples]}, indent=1) + "\n")
    return 0


def report(samples: list[Sample], args: argparse.Namespace, load_start: float, load_end: float,
           wall_s: float) -> None:
    if not samples:
        print("no samples")
        return
    roles = sorted({r for s in samples for r in s.rss_kib})
    streams = sorted({k for s in samples for k in s.streams})
    print(f"\nsoak: {samples[-1].step} steps in {wall_s:.0f}s ({args.mode}, token delay {args.token_delay_ms:g} ms), "
          f"janitor every {args.janitor_interval_s:g}s, "
          f"retention {args.retention_max_len} entries, payloads {args.payload_max_age_s:g}s, "
          f"dedupe ttl {args.dedupe_ttl_s}s")
    header = ["step", "used_MB", "dataset_MB", "keys", "dedupe", "rq", "payloads", *streams,
              *(f"{r}_MiB" for r in roles)]
    print(" ".join(f"{h:>12}" for h in header))
    for s in samples:
        row = [s.step, f"{s.used_memory / 1e6:.2f}", f"{s.used_memory_dataset / 1e6:.2f}", s.keys,
               s.dedupe_keys, s.rq_keys, s.payloads_indexed, *(s.streams.get(k, 0) for k in streams),
               *(f"{s.rss_kib.get(r, 0) / 1024:.1f}" for r in roles)]
        print(" ".join(f"{v!s:>12}" for v in row))
    half = [s for s in samples if s.step > samples[-1].step / 2] or samples
    print(f"\ngrowth per 100 steps over the second half (steps {half[0].step}-{half[-1].step}):")
    print(f"  redis used_memory      {slope_per_100([(s.step, s.used_memory) for s in half]) / 1e3:+.1f} kB")
    print(f"  redis keys             {slope_per_100([(s.step, s.keys) for s in half]):+.1f}")
    print(f"  of which dedupe keys   {slope_per_100([(s.step, s.dedupe_keys) for s in half]):+.1f}"
          f" (they expire {args.dedupe_ttl_s}s after they were set)")
    print(f"  of which rq keys       {slope_per_100([(s.step, s.rq_keys) for s in half]):+.1f}")
    for k in streams:
        print(f"  stream {k:<15} {slope_per_100([(s.step, s.streams.get(k, 0)) for s in half]):+.1f} entries")
    for r in roles:
        pts = [(s.step, s.rss_kib[r]) for s in half if r in s.rss_kib]
        print(f"  rss {r:<18} {slope_per_100(pts) / 1024:+.2f} MiB")
    print(f"load average (1 min): {load_start:.2f} at start, {load_end:.2f} at the end"
          + ("" if max(load_start, load_end) <= 1 else " (above 1: figures, not verdicts)"))


if __name__ == "__main__":
    sys.exit(main())
