"""One-step-ahead and fully async against sync, in one run: speed-up against the ideal.

Each mode runs the main job (``launch.job.run_job``: controller, engine, executor and
trainer processes on a private redis-server) with the same settings. From the sync run:
``rollout`` is the time a trainer waits for the batch it just asked for, ``train`` the rest
of a step (the GRPO update, saving and publishing the weights, waiting until they are
served). The ideal speed-up of overlapping the two is ``(rollout + train) / max(rollout,
train)``; the measured one is the sync step time over the mode's step time (steady state:
the first ``--warmup`` steps and the last one are left out). Rollouts are made long with the engine's
per-decode-step delay (time an accelerator would spend, which the 2-core CPU box does not
have to give twice), training with several PPO epochs and mini-batches.

    python bench/bench_modes.py [--steps 14] [--token-delay-ms 60] [--epochs 12] [--minibatches 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_bus.events.connection import connect  # noqa: E402
from rollout_bus.events.embedded import private_redis  # noqa: E402
from rollout_bus.events.names import Keys  # noqa: E402
from rollout_bus.events.paging import page  # noqa: E402
from rollout_bus.events.schema import RolloutCompleted, TrainStepDone, decode  # noqa: E402
from rollout_bus.launch.config import RunConfig  # noqa: E402
from rollout_bus.launch.job import run_job  # noqa: E402
from tests.support.fake_rollouts import shared_init_dir  # noqa: E402


@dataclass
class ModeTiming:
    mode: str
    step_s: float
    wait_s: float
    train_s: float
    serving_s: float
    staleness: dict[int, int]
    wall_s: float
    rollout_s: float
    """The executors' own time per rollout (``RolloutCompleted.duration_ms``)."""


def steady_timing(url: str, namespace: str, mode: str, warmup: int, wall_s: float) -> ModeTiming:
    client = connect(url)
    keys = Keys(namespace)
    try:
        steps = sorted((e for e in (decode(f) for _, f in page(client, keys.trainer_stream))
                        if isinstance(e, TrainStepDone)), key=lambda e: e.step)
        done = [e for e in (decode(f) for _, f in page(client, keys.rollout_stream))
                if isinstance(e, RolloutCompleted)]
    finally:
        client.close()
    rollouts = [e.duration_ms / 1000 for e in done if e.rollout_id >= warmup]
    steady = steps[warmup:-1]  # the last step waits for no next rollout: left out too
    intervals = [(b.ts_ms - a.ts_ms) / 1000 for a, b in zip(steps[warmup - 1:-2], steady, strict=True)]
    hist: dict[int, int] = {}
    for e in steady:
        for k, v in e.metrics.items():
            if k.startswith("staleness_n"):
                hist[int(k[len("staleness_n"):])] = hist.get(int(k[len("staleness_n"):]), 0) + int(v)
    return ModeTiming(
        mode=mode, step_s=statistics.fmean(intervals),
        wait_s=statistics.fmean(e.metrics["wait_ms"] for e in steady) / 1000,
        train_s=statistics.fmean(e.metrics["step_ms"] for e in steady) / 1000,
        serving_s=statistics.fmean(e.metrics["serving_wait_ms"] for e in steady) / 1000,
        staleness=dict(sorted(hist.items())), wall_s=wall_s,
        rollout_s=statistics.fmean(rollouts) if rollouts else float("nan"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the timing")
    p.add_argument("--token-delay-ms", type=float, default=60.0)
    p.add_argument("--max-new-tokens", type=int, default=3, help="1-digit sums need at most 3 (with EOS)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--minibatches", type=int, default=16)
    p.add_argument("--in-flight", type=int, default=2)
    p.add_argument("--n-groups", type=int, default=32)
    p.add_argument("--engine-max-batch", type=int, default=32,
                   help="continuous batching over several waves: rollout time is not quantised by the delay")
    p.add_argument("--modes", default="sync,one-step,async")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    modes = ns.modes.split(",")
    if modes[0] != "sync":
        raise SystemExit("--modes must start with sync (the baseline)")
    server = private_redis()
    timings: dict[str, ModeTiming] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-modes-") as tmp:
            for mode in modes:
                namespace = f"bench-{mode}-{int(time.time())}"
                config = RunConfig(mode=mode, steps=ns.steps, seed=ns.seed, out=str(Path(tmp) / mode),
                                   redis_url=server.url, namespace=namespace, token_delay_ms=ns.token_delay_ms,
                                   epochs=ns.epochs, minibatches=ns.minibatches, max_new_tokens=ns.max_new_tokens,
                                   n_groups=ns.n_groups, engine_max_batch=ns.engine_max_batch, in_flight=ns.in_flight,
                                   max_staleness=ns.in_flight, init_dir=str(shared_init_dir()),
                                   progress=False, plot=False)
                result = run_job(config)
                timings[mode] = steady_timing(server.url, namespace, mode, ns.warmup, result.wall_s)
                t = timings[mode]
                print(f"{mode:>8}: {t.step_s:.3f} s/step  (batch wait {t.wait_s:.3f} s, update {t.train_s:.3f} s, "
                      f"serving wait {t.serving_s:.3f} s; executor time per rollout {t.rollout_s:.3f} s; "
                      f"staleness {t.staleness}; run {t.wall_s:.1f} s)",
                      flush=True)
    finally:
        server.stop()
    base = timings["sync"]
    rollout = base.wait_s
    train = base.step_s - base.wait_s
    ideal = (rollout + train) / max(rollout, train)
    print()
    print(f"sync step {base.step_s:.3f} s = rollout {rollout:.3f} s + train {train:.3f} s "
          f"(update {base.train_s:.3f} s, publish and serve {train - base.train_s:.3f} s)")
    print(f"ideal speed-up (rollout + train) / max(rollout, train) = {ideal:.3f}")
    print(f"{'mode':>8}  {'s/step':>7}  {'speed-up':>8}  {'of ideal':>8}")
    for mode, t in timings.items():
        speedup = base.step_s / t.step_s
        print(f"{mode:>8}  {t.step_s:7.3f}  {speedup:8.3f}  " + (f"{speedup / ideal:8.3f}" if mode != "sync" else
                                                                     f"{'-':>8}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
