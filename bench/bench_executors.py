"""Executor scaling and overhead: samples/s with 1, 2 and 4 executors against delayed CPU engines.

    python bench/bench_executors.py [--engines 4] [--token-delay-ms 50] [--token-delay-per-seq-ms 1]
                                    [--executors 1,2,4] [--repeats 3] ...

Engines spend an accelerator's time per decode step, as a cost model
(``engine.scheduler.step_delay_s``): ``--token-delay-ms`` for the step plus
``--token-delay-per-seq-ms`` for every sequence in it, so a fuller batch is cheaper per token
but not free, and more executors sharing the engines do not get engine capacity for nothing
(with the per-sequence part 0, the engines would scale for free and the efficiency would be
near 1 by construction). Engine time dominates and is not CPU bound; every executor gets the
same number of identical jobs (``--jobs-per-executor``). Every executor count runs
``--repeats`` times, interleaved; figures are medians. Reported:

- samples/s per executor count (median and spread) and the scaling efficiency
  ``rate_N / (N * rate_1)`` of the medians, beside the bound the cost model sets if each
  executor keeps one job's samples spread evenly over the engines (step time at 1 executor's
  batch over step time at N executors' batch);
- the share of an executor's wall time spent outside engine calls: per executor,
  ``1 - engine_busy / span``, where ``engine_busy`` is the time at least one of its engine
  calls was in flight (measured inside the executor) and ``span`` runs from its first
  RolloutStarted to its last RolloutCompleted (so rq dequeue and bookkeeping between jobs
  count as outside time);
- the cost of dispatching one job to a warm event-loop thread with a pooled HTTP session,
  against ``asyncio.run`` per job with a fresh session (what the executor avoids).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rq import Worker  # noqa: E402

from rollout_bus.engine.http_client import EngineClient, close_shared_session  # noqa: E402
from rollout_bus.events.connection import connect  # noqa: E402
from rollout_bus.events.embedded import RedisServer  # noqa: E402
from rollout_bus.events.names import Keys  # noqa: E402
from rollout_bus.events.paging import page  # noqa: E402
from rollout_bus.events.registry import EngineRecord, EngineState, PolicyRecord, Registry  # noqa: E402
from rollout_bus.events.rollouts import RolloutRequest, SamplingParams  # noqa: E402
from rollout_bus.events.schema import decode  # noqa: E402
from rollout_bus.events.submit import RolloutSubmitter, rq_queue  # noqa: E402
from rollout_bus.lm import tokenizer  # noqa: E402
from tests.engine_proc import EngineProcess, make_weights_dir  # noqa: E402


def start_executors(url: str, namespace: str, n: int, logs: Path) -> list[subprocess.Popen[bytes]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = []
    for i in range(n):
        with open(logs / f"executor-{namespace}-{i}.log", "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "rollout_bus", "executor", "--redis-url", url, "--namespace", namespace,
                 "--index", str(i), "--queues", "rollout", "--log-level", "WARNING"],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs


def stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(5)


def run_once(url: str, engines: list[EngineProcess], n_exec: int, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    client = connect(url)
    keys = Keys(f"bench{n_exec}-{uuid.uuid4().hex[:6]}")
    registry = Registry(client, keys)
    for i, e in enumerate(engines):
        registry.put_engine(EngineRecord(engine_id=f"e{i}", url=e.url, state=EngineState.SERVING, versions={"p": 0},
                                         base_policy="p"))
    registry.put_policy(PolicyRecord(policy="p", published=0, serving=0))
    procs = start_executors(url, keys.namespace, n_exec, logs)
    try:
        queue = rq_queue(client, keys.rollout_queue)
        deadline = time.monotonic() + 60
        while Worker.count(queue=queue) < n_exec:
            if time.monotonic() > deadline:
                raise TimeoutError("executors did not start")
            time.sleep(0.05)
        submitter = RolloutSubmitter(client, keys)
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
        n_jobs = n_exec * args.jobs_per_executor
        for r in range(n_jobs):
            submitter.submit(RolloutRequest.create("p", r, args.groups, args.samples, sampling=sampling,
                                                   timeout_s=600))
        deadline = time.monotonic() + 600
        while True:
            events = [decode(f) for _, f in page(client, keys.rollout_stream)]
            done = [e for e in events if e.type == "RolloutCompleted"]
            if len(done) >= n_jobs or any(e.type == "RolloutFailed" for e in events):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("jobs did not finish")
            time.sleep(0.1)
    finally:
        stop(procs)
    failed = [e for e in events if e.type == "RolloutFailed"]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed: {failed[0]}")
    started = [e for e in events if e.type == "RolloutStarted"]
    span_s = (max(e.ts_ms for e in done) - min(e.ts_ms for e in started)) / 1000.0
    samples = sum(e.n_samples for e in done)
    per_exec: dict[str, dict[str, float]] = defaultdict(lambda: {"busy": 0.0, "wall": 0.0, "jobs": 0.0})
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for e in started:
        first[e.executor] = min(first.get(e.executor, e.ts_ms), e.ts_ms)
    for e in done:
        name = e.producer.instance
        per_exec[name]["busy"] += e.metrics["engine_busy_s"]
        per_exec[name]["wall"] += e.metrics["wall_s"]
        per_exec[name]["jobs"] += 1
        last[name] = max(last.get(name, e.ts_ms), e.ts_ms)
    outside_span = [1 - v["busy"] / ((last[n] - first[n]) / 1000.0) for n, v in per_exec.items()]
    outside_job = [1 - v["busy"] / v["wall"] for v in per_exec.values()]
    return {"executors": n_exec, "jobs": n_jobs, "samples": samples, "span_s": span_s, "rate": samples / span_s,
            "outside_span": outside_span, "outside_job": outside_job,
            "jobs_per_exec": sorted(int(v["jobs"]) for v in per_exec.values())}


def dispatch_overhead(url: str, n: int) -> tuple[float, float]:
    """Mean ms per job: warm loop thread + pooled session vs asyncio.run with a fresh session (1-token call)."""
    ids = tokenizer.encode("1+1=", add_bos=True)
    params = {"max_new_tokens": 1, "temperature": 1.0}

    async def one() -> None:
        await EngineClient(url).generate(ids, params, return_logprob=True)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(one(), loop).result()  # warm the pool
    t0 = time.perf_counter()
    for _ in range(n):
        asyncio.run_coroutine_threadsafe(one(), loop).result()
    warm_ms = (time.perf_counter() - t0) / n * 1000
    asyncio.run_coroutine_threadsafe(close_shared_session(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()

    async def cold() -> None:
        try:
            await one()
        finally:
            await close_shared_session()

    t0 = time.perf_counter()
    for _ in range(n):
        asyncio.run(cold())
    cold_ms = (time.perf_counter() - t0) / n * 1000
    return warm_ms, cold_ms


def cost_model_bound(args: argparse.Namespace, n: int, base_n: int) -> float:
    """The efficiency the engines' step cost allows at ``n`` executors, if every executor keeps one
    job's samples in flight, spread evenly over the engines: step time at the base count's batch
    over step time at this count's batch."""
    def step_ms(executors: int) -> float:
        batch = min(args.max_batch_size, math.ceil(executors * args.groups * args.samples / args.engines))
        return args.token_delay_ms + args.token_delay_per_seq_ms * batch
    return step_ms(base_n) / step_ms(n)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the bench and prints its table; returns the median efficiency per executor count and the load."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--token-delay-ms", type=float, default=50.0, help="fixed part of a decode step's cost")
    p.add_argument("--token-delay-per-seq-ms", type=float, default=1.0,
                   help="part of a decode step's cost per sequence in the step")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--executors", default="1,2,4")
    p.add_argument("--repeats", type=int, default=3, help="runs of every executor count, interleaved")
    p.add_argument("--jobs-per-executor", type=int, default=4)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dispatch-calls", type=int, default=200)
    args = p.parse_args(argv)
    counts = [int(x) for x in args.executors.split(",")]
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        weights = make_weights_dir(logs / "weights")
        server = RedisServer().start()
        engines: list[EngineProcess] = []
        try:
            for _ in range(args.engines):  # one at a time, so a failed start still stops the others
                engines.append(EngineProcess(weights, token_delay_ms=args.token_delay_ms, extra_args=(
                    "--max-batch-size", str(args.max_batch_size),
                    "--token-delay-per-seq-ms", str(args.token_delay_per_seq_ms))))
            print(f"# {args.engines} engines; step cost {args.token_delay_ms:g} ms + "
                  f"{args.token_delay_per_seq_ms:g} ms per sequence in the step, max batch {args.max_batch_size}; "
                  f"jobs of {args.groups}x{args.samples} samples x {args.max_new_tokens} tokens, "
                  f"{args.jobs_per_executor} jobs per executor; {args.repeats} repeats; {os.cpu_count()} CPUs, "
                  f"load average {load:.2f} at start", flush=True)
            runs: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
            for rep in range(args.repeats):
                for n in counts if rep % 2 == 0 else counts[::-1]:
                    r = run_once(server.url, engines, n, args, logs)
                    runs[n].append(r)
                    load = max(load, os.getloadavg()[0])
                    print(f"  rep {rep}: {n} executor(s) {r['rate']:.1f} samples/s (load average "
                          f"{os.getloadavg()[0]:.2f})", flush=True)
            rate = {n: statistics.median(r["rate"] for r in rs) for n, rs in runs.items()}
            base = rate[counts[0]] / counts[0]
            print(f"{'executors':>9} {'samples/s median':>17} {'spread':>13} {'efficiency':>10} {'cost model':>10} "
                  f"{'outside(span) max':>18} {'outside(job) mean':>18}")
            eff: dict[int, float] = {}
            for n, rs in runs.items():
                eff[n] = rate[n] / (n * base)
                rates = [r["rate"] for r in rs]
                print(f"{n:>9} {rate[n]:>17.1f} {min(rates):>6.1f}-{max(rates):<6.1f} {eff[n]:>10.3f} "
                      f"{cost_model_bound(args, n, counts[0]):>10.3f} "
                      f"{max(max(r['outside_span']) for r in rs):>17.2%} "
                      f"{statistics.median(statistics.mean(r['outside_job']) for r in rs):>17.2%}")
            fast = EngineProcess(weights, token_delay_ms=0)  # no token delay: dispatch cost shows
            try:
                warm, cold = dispatch_overhead(fast.url, args.dispatch_calls)
            finally:
                fast.kill()
            print(f"dispatch per job (1-token generate): warm loop thread + pooled session {warm:.2f} ms; "
                  f"asyncio.run + fresh session {cold:.2f} ms; ratio {cold / warm:.2f}x")
        finally:
            for e in engines:
                e.kill()
            server.stop()
    load = max(load, os.getloadavg()[0])
    top = counts[-1]
    state = f"no verdict (load average {load:.2f} > 1)" if load > 1 else ("met" if eff[top] >= 0.9 else "MISSED")
    print(f"target: scaling efficiency at {top} executors >= 0.9 (medians): {eff[top]:.3f} -> {state}")
    per_rep = {n: [rs[i]["rate"] / (n * runs[counts[0]][i]["rate"] / counts[0]) for i in range(len(rs))]
               for n, rs in runs.items()}  # each repeat's rate against the same repeat's smallest fleet
    return {"efficiency": eff, "efficiency_reps": per_rep, "load": load}


if __name__ == "__main__":
    main()
