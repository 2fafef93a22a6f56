"""Sizing the elastic fleet: autoscaled executors and engine cells against a fixed fleet sized for the peak.

    python bench/bench_autoscale.py [--repeats 5] [--duration-s 1800] [--seed 0]

A simulation in virtual time (deterministic for a seed; wall time only bounds how long it takes to run). A
bursty trace of rollout requests (a Markov-modulated Poisson process: quiet spells at ``--quiet-rate`` jobs/s,
bursts at ``--burst-rate``) goes through an rq-like FIFO queue to executors that hold one job each, which run it
on the least-loaded engine. The engines are the stub engines of ``bench/bench_scale.py`` as a cost model: a
decode step takes ``--token-ms`` times ``1 + in-flight sequences / --batch-knee`` and advances every sequence in
flight on that engine by one token (processor sharing). A job is ``--groups`` x ``--samples`` sequences of a
uniform 32..``--max-tokens`` tokens.

Three fleets see the same trace:

- **fixed peak**: ``--max-executors`` executors and ``--max-engines`` engines all the time;
- **auto executors**: executors scaled by ``launch.autoscale.decide`` (the policy ``rollout-bus run
  --executors auto`` uses, sampled every second, a new executor taking jobs ``--executor-start-s`` later, a
  retired one finishing its job first), engines fixed at the peak;
- **auto both**: the same, and engine cells grown and shrunk from engine load by the same hysteresis policy
  (``decide`` fed the engines' demand: the sequences in flight over ``--engine-target`` per engine, as depth
  above the current count), a new engine serving ``--engine-start-s`` later (weights loading), a removed one
  draining its sequences first. The real engine-scaling mechanism lives in the controller; this only sizes it.

Per fleet: p95 queue wait (submit to an executor taking the job), p95 job latency (submit to done), engine-seconds
and executor-seconds (time each existed, starting and draining included), median over ``--repeats`` traces (seeds
``seed..seed+repeats-1``) with the min-max spread.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout_bus.launch.autoscale import Sample, ScalePolicy, ScalerState, decide  # noqa: E402


@dataclass
class Job:
    arrive_s: float
    sequences: int
    tokens: int
    start_s: float = -1.0
    done_s: float = -1.0
    left: float = 0.0
    """Tokens left per sequence (all of a job's sequences advance together)."""
    engine: Engine | None = None


@dataclass
class Engine:
    ready_s: float
    draining: bool = False
    born_s: float = 0.0
    jobs: list[Job] = field(default_factory=list)

    def load(self) -> int:
        return sum(j.sequences for j in self.jobs)


@dataclass
class Executor:
    ready_s: float
    born_s: float
    job: Job | None = None
    retiring: bool = False


def trace(seed: int, duration_s: float, quiet_rate: float, burst_rate: float, quiet_s: float, burst_s: float,
          groups: int, samples: int, max_tokens: int) -> list[Job]:
    """Arrivals of a two-state Markov-modulated Poisson process (exponential spells of mean quiet_s, burst_s)."""
    rng = random.Random(seed)
    jobs, t, bursting = [], 0.0, False
    spell_end = rng.expovariate(1 / quiet_s)
    while t < duration_s:
        rate = burst_rate if bursting else quiet_rate
        t += rng.expovariate(rate)
        while t > spell_end:  # a spell ended before this arrival: redraw it in the next spell
            bursting = not bursting
            t = spell_end + rng.expovariate(burst_rate if bursting else quiet_rate)
            spell_end += rng.expovariate(1 / (burst_s if bursting else quiet_s))
        if t < duration_s:
            jobs.append(Job(t, groups * samples, rng.randint(32, max_tokens)))
    return jobs


@dataclass
class Result:
    wait_p95_s: float
    latency_p95_s: float
    engine_s: float
    executor_s: float
    peak_executors: int
    peak_engines: int


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def simulate(jobs: list[Job], args: argparse.Namespace, *, auto_executors: bool, auto_engines: bool) -> Result:
    dt, token_s, knee = args.dt_s, args.token_ms / 1000, args.batch_knee
    jobs = [Job(j.arrive_s, j.sequences, j.tokens) for j in jobs]
    exec_policy = ScalePolicy(min=args.min_executors, max=args.max_executors)
    eng_policy = ScalePolicy(min=args.min_engines, max=args.max_engines, up_samples=3,
                             up_cooldown_s=args.engine_start_s, down_samples=30, down_cooldown_s=60.0)
    n_exec = exec_policy.min if auto_executors else args.max_executors
    n_eng = eng_policy.min if auto_engines else args.max_engines
    executors = [Executor(0.0, 0.0) for _ in range(n_exec)]
    engines = [Engine(0.0, born_s=0.0) for _ in range(n_eng)]
    gone_exec_s = gone_eng_s = 0.0
    exec_state, eng_state = ScalerState(), ScalerState()
    queue: deque[Job] = deque()
    arrivals = deque(jobs)
    peak_exec, peak_eng = len(executors), len(engines)
    now, next_sample = 0.0, 1.0
    end = args.duration_s
    while now < end or queue or any(e.job for e in executors):
        while arrivals and arrivals[0].arrive_s <= now:
            queue.append(arrivals.popleft())
        serving = [e for e in engines if not e.draining and e.ready_s <= now]
        for ex in executors:  # free, started executors take the queue's head
            if ex.job is None and not ex.retiring and ex.ready_s <= now and queue and serving:
                job = queue.popleft()
                job.start_s, job.left = now, float(job.tokens)
                job.engine = min(serving, key=Engine.load)
                job.engine.jobs.append(job)
                ex.job = job
        for eng in engines:  # one dt of decoding: each sequence advances dt / step time
            if eng.jobs:
                step = token_s * (1 + eng.load() / knee)
                for job in eng.jobs:
                    job.left -= dt / step
                done = [j for j in eng.jobs if j.left <= 0]
                for job in done:
                    job.done_s = now + dt
                    eng.jobs.remove(job)
        for ex in executors:
            if ex.job is not None and ex.job.done_s >= 0:
                ex.job = None
        for ex in [e for e in executors if e.retiring and e.job is None]:
            gone_exec_s += now - ex.born_s
            executors.remove(ex)
        for eng in [e for e in engines if e.draining and not e.jobs]:
            gone_eng_s += now - eng.born_s
            engines.remove(eng)
        if now >= next_sample:
            next_sample += 1.0
            if auto_executors:
                live = [e for e in executors if not e.retiring]
                busy = sum(1 for e in executors if e.job is not None)
                age = now - queue[0].arrive_s if queue else 0.0
                d = decide(exec_policy, exec_state, Sample(now, len(queue), age, busy, len(live)))
                exec_state = d.state
                if d.target > len(live):
                    executors += [Executor(now + args.executor_start_s, now) for _ in range(d.target - len(live))]
                for ex in sorted(live, key=lambda e: e.job is not None)[:max(0, len(live) - d.target)]:
                    ex.retiring = True  # idle ones first here; a busy one finishes its job
            if auto_engines:
                live_eng = [e for e in engines if not e.draining]
                in_flight = sum(e.load() for e in engines)
                demand = math.ceil(in_flight / args.engine_target)
                d = decide(eng_policy, eng_state, Sample(now, max(0, demand - len(live_eng)), 0.0,
                                                         min(demand, len(live_eng)), len(live_eng)))
                eng_state = d.state
                if d.target > len(live_eng):
                    engines += [Engine(now + args.engine_start_s, born_s=now) for _ in range(d.target - len(live_eng))]
                for eng in sorted(live_eng, key=Engine.load)[:max(0, len(live_eng) - d.target)]:
                    eng.draining = True
            peak_exec = max(peak_exec, sum(1 for e in executors if not e.retiring))
            peak_eng = max(peak_eng, sum(1 for e in engines if not e.draining))
        now += dt
    exec_s = gone_exec_s + sum(now - e.born_s for e in executors)
    eng_s = gone_eng_s + sum(now - e.born_s for e in engines)
    return Result(p95([j.start_s - j.arrive_s for j in jobs]), p95([j.done_s - j.arrive_s for j in jobs]),
                  eng_s, exec_s, peak_exec, peak_eng)


def cell(values: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration-s", type=float, default=1800.0)
    p.add_argument("--dt-s", type=float, default=0.05)
    p.add_argument("--quiet-rate", type=float, default=0.1, help="jobs/s between bursts")
    p.add_argument("--burst-rate", type=float, default=1.5, help="jobs/s in a burst")
    p.add_argument("--quiet-s", type=float, default=240.0, help="mean quiet spell")
    p.add_argument("--burst-s", type=float, default=60.0, help="mean burst")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--token-ms", type=float, default=20.0)
    p.add_argument("--batch-knee", type=float, default=32.0)
    p.add_argument("--min-executors", type=int, default=1)
    p.add_argument("--max-executors", type=int, default=16)
    p.add_argument("--min-engines", type=int, default=1)
    p.add_argument("--max-engines", type=int, default=8)
    p.add_argument("--engine-target", type=float, default=32.0, help="sequences in flight per engine the cells aim at")
    p.add_argument("--executor-start-s", type=float, default=3.0)
    p.add_argument("--engine-start-s", type=float, default=20.0)
    args = p.parse_args()

    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    print(f"# trace: {args.duration_s:g} s, {args.quiet_rate:g} jobs/s quiet (mean {args.quiet_s:g} s), "
          f"{args.burst_rate:g} jobs/s in bursts (mean {args.burst_s:g} s); jobs of {args.groups}x{args.samples} "
          f"sequences, 32..{args.max_tokens} tokens; stub engines {args.token_ms:g} ms/token x (1 + in flight/"
          f"{args.batch_knee:g}); executors start in {args.executor_start_s:g} s, engines in {args.engine_start_s:g} s")
    fleets = {"fixed peak": (False, False), "auto executors": (True, False), "auto both": (True, True)}
    results: dict[str, list[Result]] = {name: [] for name in fleets}
    started = time.monotonic()
    n_jobs = []
    for r in range(args.repeats):
        jobs = trace(args.seed + r, args.duration_s, args.quiet_rate, args.burst_rate, args.quiet_s, args.burst_s,
                     args.groups, args.samples, args.max_tokens)
        n_jobs.append(len(jobs))
        for name, (auto_exec, auto_eng) in fleets.items():
            results[name].append(simulate(jobs, args, auto_executors=auto_exec, auto_engines=auto_eng))
    print(f"# {args.repeats} traces (seeds {args.seed}..{args.seed + args.repeats - 1}), {cell(n_jobs, '{:.0f}')} "
          f"jobs each; median [min-max]; simulated in {time.monotonic() - started:.1f} s wall")
    base = results["fixed peak"]
    header = (f"{'fleet':<15} {'p95 wait s':>18} {'p95 latency s':>20} {'engine-s':>22} {'executor-s':>22} "
              f"{'engine-s vs fixed':>18} {'peak exec/eng':>14}")
    print(header)
    for name, rs in results.items():
        ratio = [r.engine_s / b.engine_s for r, b in zip(rs, base, strict=True)]
        print(f"{name:<15} {cell([r.wait_p95_s for r in rs], '{:.2f}'):>18} "
              f"{cell([r.latency_p95_s for r in rs]):>20} {cell([r.engine_s for r in rs], '{:.0f}'):>22} "
              f"{cell([r.executor_s for r in rs], '{:.0f}'):>22} {cell(ratio, '{:.2f}'):>18} "
              f"{statistics.median([r.peak_executors for r in rs]):>6.0f}/{statistics.median([r.peak_engines for r in rs]):.0f}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
