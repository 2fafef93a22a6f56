"""Every bench in a quick but honest configuration, one after another, and one table of ratios.

Each row is the project against the fair baseline of its bench, measured side by side in the
same run (interleaved, medians), with the target, the verdict and the 1-minute load average
when the row's bench ran. No verdict is given for a row whose load average was above 1: other
work on the machine may have decided it. The configurations are smaller than each bench's
defaults (fewer events, rounds, steps) so that the whole table takes about 5 minutes on a
2-core machine; each bench's own command gives tighter figures.

    python bench/ratios.py [--skip modes,executors] [--quick]

``--quick`` shrinks every configuration further (a smoke run, not figures to quote).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


@dataclass
class Row:
    bench: str
    figure: str
    ratio: float | None
    target: str
    ok: bool | None  # None: a figure reported without a target
    load: float
    seconds: float

    def verdict(self) -> str:
        if self.ok is None or self.ratio is None:
            return "-"
        if self.load > 1.0:
            return "no verdict"
        return "met" if self.ok else "MISSED"


def run_bench(name: str, fn: Callable[[], Any], log: Path) -> tuple[Any, float]:
    """Run one bench's ``main``, its printed output going to ``log`` (and a line to the console)."""
    print(f"running {name} ... (load average {os.getloadavg()[0]:.2f})", flush=True)
    t0 = time.monotonic()
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            result = fn()
    finally:
        with open(log, "a") as f:
            f.write(f"\n===== {name}\n{buf.getvalue()}")
    took = time.monotonic() - t0
    print(f"  done in {took:.0f} s", flush=True)
    return result, took


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip", default="", help="benches to leave out: events,handoff,codec,executors,modes")
    ap.add_argument("--quick", action="store_true", help="a smoke run: smaller still, figures not to quote")
    ap.add_argument("--log", default="ratios.log", help="where every bench's full output goes")
    args = ap.parse_args(argv)
    skip = set(args.skip.split(",")) - {""}
    q = args.quick
    log = Path(args.log)
    log.write_text(f"bench/ratios.py {' '.join(argv or sys.argv[1:])}\n")
    rows: list[Row] = []
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; full output in {log}")

    if "events" not in skip:
        import bench_events

        cfg = ["--n", "2000" if q else "6000", "--reps", "1" if q else "3", "--loads", "0.5"]
        r, took = run_bench("events " + " ".join(cfg), lambda: bench_events.main(cfg), log)
        rows += [
            Row("events 1 KB", "project / idempotent twin, msg/s at saturation", r["throughput"], ">= 0.95",
                r["throughput"] >= 0.95, r["sat_load"], took),
            Row("events 1 KB", "project / transport twin, msg/s (price of the guarantees)", r["transport"], "-",
                None, r["sat_load"], took),
            Row("events 1 KB", "project / idempotent twin, p50 at 0.5 load", r["p50"], "<= 1.0", r["p50"] <= 1.0,
                r["fixed_load"], took),
            Row("events 1 KB", "project / idempotent twin, p99 at 0.5 load", r["p99"], "<= 1.0", r["p99"] <= 1.0,
                r["fixed_load"], took),
        ]
    if "handoff" not in skip:
        import bench_handoff

        cfg = ["--reps", "3" if q else "9", "--warmup", "1" if q else "2", "--only",
               "tcp,redis,shm,shm-shared,shm-unverified,ray"]
        r, took = run_bench("handoff " + " ".join(cfg), lambda: bench_handoff.main(cfg), log)
        med = r["median_ms"]
        if "tcp" in med and "redis" in med:
            x = med["redis"] / med["tcp"]
            rows.append(Row("handoff 64 MiB", "redis store / tcp floor (reused buffer), time", x, "<= 2.0", x <= 2.0,
                            r["load"], took))
        for name, label in (("shm", "shm store (default) / ray, time"), ("shm-shared", "shm store reads=shared / ray"),
                            ("shm-unverified", "shm store, checksum unverified / ray")):
            if name in med and "ray" in med:
                x = med[name] / med["ray"]
                rows.append(Row("handoff 64 MiB", label, x, "< 1.0" if name == "shm" else "-",
                                x < 1.0 if name == "shm" else None, r["load"], took))
        if "ray" not in med:
            rows.append(Row("handoff 64 MiB", f"shm store / ray: ray skipped ({'; '.join(r['skipped'])})", None,
                            "< 1.0", None, r["load"], took))
    if "codec" not in skip:
        import bench_batch_codec

        cfg = ["--reps", "5" if q else "20"]
        r, took = run_bench("codec " + " ".join(cfg), lambda: bench_batch_codec.main(cfg), log)
        rows += [Row("codec 64 MiB", "encode + copy + decode / memcpy, speed", r["ratio"], ">= 0.75",
                     r["ratio"] >= 0.75, r["load"], took),
                 Row("codec 64 MiB", "encode + decode without the copy / memcpy, speed", r["no_copy"], "-", None,
                     r["load"], took)]
    if "executors" not in skip:
        import bench_executors

        cfg = ["--executors", "1,4", "--repeats", "1" if q else "3", "--jobs-per-executor", "2",
               "--max-new-tokens", "8" if q else "16", "--dispatch-calls", "20"]
        r, took = run_bench("executors " + " ".join(cfg), lambda: bench_executors.main(cfg), log)
        eff = r["efficiency"][4]
        rows.append(Row("executors", "scaling efficiency at 4, batch-dependent step cost", eff, ">= 0.9", eff >= 0.9,
                        r["load"], took))
    if "modes" not in skip:
        import bench_modes

        cfg = ["--repeats", "1" if q else "3", "--steps", "5" if q else "7", "--warmup", "2"]
        r, took = run_bench("modes " + " ".join(cfg), lambda: bench_modes.main(cfg), log)
        for mode in ("one-step", "async"):
            if mode in r:
                x = float(r[mode])
                rows.append(Row("modes", f"{mode} step / its own ideal step, speed", x, ">= 0.95", x >= 0.95,
                                r["load"], took))

    print()
    print(f"{'bench':16} {'ratio (project vs fair baseline)':58} {'value':>6} {'target':>7} {'verdict':>11} "
          f"{'load':>5} {'s':>5}")
    for row in rows:
        value = f"{row.ratio:.2f}" if row.ratio is not None else "-"
        print(f"{row.bench:16} {row.figure:58} {value:>6} {row.target:>7} {row.verdict():>11} {row.load:5.2f} "
              f"{row.seconds:5.0f}")
    print(f"load average {os.getloadavg()[0]:.2f} at end; 'load' is the highest 1-minute load average seen by the "
          "row's bench; above 1 there is no verdict")
    return rows


if __name__ == "__main__":
    main()
