"""Every bench in a configuration that gives stable rows, one after another, and one table of ratios.

Each row is the project against the fair baseline of its bench, measured side by side in the
same run (interleaved), as per-repetition ratios: the table gives their median, interquartile
range, range and count, the target and the verdict (``bench/verdict.py``). A verdict needs a
quiet machine judged from outside the benches: the 1-minute load average before each bench
(at most 1; before each bench the script waits up to ``--settle`` seconds for the previous
bench's own load to decay) and the CPU that processes other than the bench's own used while it
ran (at most 25% of the cores). A row whose interquartile range crosses its target says so
instead of a verdict. The configurations are each bench's own long defaults or close to
them (the short ones gave ratios that a longer run contradicted): about 20 minutes on a
2-core machine, and about 10 more for the bus tax on SmolLM2.

    python bench/ratios.py [--skip modes,executors] [--quick] [--settle 90]

``--quick`` shrinks every configuration (a smoke run, not figures to quote).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from verdict import OutsideLoad, Row, Target, reasons, table, wait_for_quiet  # noqa: E402


def run_bench(name: str, fn: Callable[[], Any], log: Path, settle_s: float) -> tuple[Any, OutsideLoad, float]:
    """Run one bench's ``main`` once the load has settled, its printed output going to ``log`` (and a line to
    the console); returns its result, the outside load around it and its seconds."""
    before = wait_for_quiet(settle_s)
    print(f"running {name} ... (load average {before:.2f})", flush=True)
    t0 = time.monotonic()
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), OutsideLoad() as outside:
            result = fn()
    finally:
        with open(log, "a") as f:
            f.write(f"\n===== {name}\n{buf.getvalue()}")
    took = time.monotonic() - t0
    print(f"  done in {took:.0f} s; {outside.load.describe()}", flush=True)
    return result, outside, took


def timed(rows: list[Row], took: float) -> list[Row]:
    for row in rows:
        row.seconds = took
    return rows


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip", default="", help="benches to leave out: events,handoff,codec,executors,modes,gateway,"
                                                "shards,decode,bus_tax (decode needs the models extra; bus_tax takes "
                                                "about 10 minutes)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: smaller configurations, figures not to quote")
    ap.add_argument("--settle", type=float, default=90.0,
                    help="seconds to wait at most, before each bench, for the load average to fall to 1")
    ap.add_argument("--log", default="ratios.log", help="where every bench's full output goes")
    args = ap.parse_args(argv)
    skip = set(args.skip.split(",")) - {""}
    q = args.quick
    settle = 0.0 if q else args.settle
    log = Path(args.log)
    log.write_text(f"bench/ratios.py {' '.join(argv or sys.argv[1:])}\n")
    rows: list[Row] = []
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; full output in {log}")

    if "codec" not in skip:
        import bench_batch_codec

        cfg = ["--reps", "5" if q else "30"]
        r, _, took = run_bench("codec " + " ".join(cfg), lambda: bench_batch_codec.main(cfg), log, settle)
        rows += timed(r["rows"], took)
    if "handoff" not in skip:
        import bench_handoff

        cfg = ["--reps", "3" if q else "15", "--warmup", "1" if q else "3", "--only",
               "tcp,redis,shm,shm-shared,shm-unverified,memfd,memfd-put,ray"]
        r, _, took = run_bench("handoff " + " ".join(cfg), lambda: bench_handoff.main(cfg), log, settle)
        rows += timed(r["rows"], took)
    if "events" not in skip:
        import bench_events

        cfg = ["--n", "2000" if q else "10000", "--reps", "3" if q else "5", "--loads", "0.5", "--many"]
        r, _, took = run_bench("events " + " ".join(cfg), lambda: bench_events.main(cfg), log, settle)
        rows += timed(r["rows"], took)
    if "executors" not in skip:
        import bench_executors

        cfg = ["--executors", "1,4", "--repeats", "3" if q else "5", "--jobs-per-executor", "2",
               "--max-new-tokens", "8" if q else "16", "--dispatch-calls", "20"]
        r, outside, took = run_bench("executors " + " ".join(cfg), lambda: bench_executors.main(cfg), log, settle)
        rows.append(Row("executors", "scaling efficiency at 4, batch-dependent step cost", r["efficiency_reps"][4],
                        Target(">=", 0.9), outside.load, took))
    if "modes" not in skip:
        import bench_modes

        cfg = ["--repeats", "3" if q else "5", "--steps", "5" if q else "7", "--warmup", "2"]
        r, outside, took = run_bench("modes " + " ".join(cfg), lambda: bench_modes.main(cfg), log, settle)
        for mode in ("one-step", "async"):
            if f"{mode}_reps" in r:
                rows.append(Row("modes", f"{mode} step / its own ideal step, speed", list(r[f"{mode}_reps"]),
                                Target(">=", 0.95), outside.load, took))

    if "gateway" not in skip:
        import bench_gateway

        cfg = ["--parts", "overhead", "--reps", "3" if q else "5"] + (["--quick"] if q else [])
        r, _, took = run_bench("gateway " + " ".join(cfg), lambda: bench_gateway.main(cfg), log, settle)
        rows += timed(list(r.get("rows", [])), took)
    if "decode" not in skip:
        import bench_decode_limits

        cfg = ["--batches", "16", "--reps", "3" if q else "5", "--tokens", "16" if q else "32"]
        r, _, took = run_bench("decode " + " ".join(cfg), lambda: bench_decode_limits.main(cfg), log, settle)
        rows += timed([row for row in r["rows"] if "bandwidth" in row.figure], took)
    if "shards" not in skip:
        import bench_shards

        cfg = ["--no-kill"] + (["--quick"] if q else [])
        r, _, took = run_bench("shards " + " ".join(cfg), lambda: bench_shards.main(cfg), log, settle)
        rows += timed([row for row in r.get("rows", []) if "Redis CPU" in row.figure], took)
    if "bus_tax" not in skip:
        import bench_bus_tax

        cfg = ["--repeats", "3"] + (["--quick"] if q else ["--model", "smollm2"])  # the target is SmolLM2's
        r, outside, took = run_bench("bus_tax " + " ".join(cfg), lambda: bench_bus_tax.main(cfg), log, settle)
        rows += [Row("bus_tax", f"{row['figure']} ({r['model']})", list(row["values"]), bench_bus_tax.TARGET,
                     outside.load, took) for row in r["rows"]]

    print()
    print(table(rows))
    for line in reasons(rows):
        print(line)
    print(f"load average {os.getloadavg()[0]:.2f} at end; 'before' is the 1-minute load average before the row's "
          "bench, 'outside' the share of the cores used by other processes while it ran; verdicts read the IQR")
    return rows


if __name__ == "__main__":
    main()
