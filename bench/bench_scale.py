"""How the bus's cost grows with executors and engines: the real controller, executors, rq and Redis
against stub engines.

    python bench/bench_scale.py [--executors 1,4,16,32] [--engines 8,64,256] [--at-engines 64] [--at-executors 4]

Stub engines are aiohttp servers (many per process, one port each) that answer what the
controller and the executors ask: ``/generate`` sleeps a fixed ``--token-ms`` per token, times
``1 + batch / --batch-knee`` (a step grows with the batch in flight), and answers SGLang's reply
shape; ``/health_generate``, ``/model_info``, ``/v1/models``, ``/v1/loads`` answer at once. The
controller adopts every stub (``--adopt-url``) and runs its health rounds (``--health-interval-s``);
executors are ``rollout-bus executor`` processes taking jobs from rq.

Two sweeps share one point: executors 1, 4, 16, 32 at ``--at-engines`` engines, and engines 8, 64,
256 at ``--at-executors`` executors (the whole grid does not fit ~10 minutes on 2 cores). Each run
submits ``--jobs-per-executor`` jobs per executor (at least ``--min-jobs``) of ``--groups`` x
``--samples`` samples, and measures over the window from the first submit to the last
RolloutCompleted:

- Redis commands per sample: the ``INFO commandstats`` calls of the window / samples;
- Redis CPU per sample: redis-server's user+system CPU of the window (``INFO cpu``) / samples;
- health round: the controller's ``rollout_bus_controller_health_round_seconds``, mean over every round
  since it adopted the engines (idle and busy);
- dispatch overhead: per job, executor wall time outside engine calls (``wall_s - engine_busy_s`` of
  RolloutCompleted), per sample;
- event p99: over every event of the rollout and batch streams, the time from the producer
  stamping it (``ts_ms``) to Redis appending it (the entry id's time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# --- stub engines (run as ``bench_scale.py --serve-stubs N --ports-file F``) -----------------------

def serve_stubs(n: int, ports_file: Path, token_ms: float, knee: float, tokens: list[int]) -> None:
    from aiohttp import web

    async def main() -> None:
        runners = []
        ports = []
        for _ in range(n):
            in_flight = [0]

            async def generate(request: web.Request, in_flight: list[int] = in_flight) -> web.Response:
                body = await request.json()
                params = body.get("sampling_params") or {}
                n_tokens = int(params.get("max_new_tokens", 8))
                in_flight[0] += 1
                try:
                    await asyncio.sleep(n_tokens * token_ms / 1000 * (1 + in_flight[0] / knee))
                finally:
                    in_flight[0] -= 1
                out = [tokens[j % len(tokens)] for j in range(n_tokens)]
                meta = {"id": body.get("rid") or uuid.uuid4().hex, "finish_reason": {"type": "length", "length": n_tokens},
                        "prompt_tokens": len(body.get("input_ids") or []), "weight_version": "0",
                        "output_token_logprobs": [[-0.5, t, None] for t in out], "completion_tokens": n_tokens}
                return web.json_response({"text": "", "output_ids": out, "meta_info": meta})

            async def loads(request: web.Request, in_flight: list[int] = in_flight) -> web.Response:
                return web.json_response({"loads": [{"dp_rank": 0, "num_running_reqs": in_flight[0],
                                                     "num_waiting_reqs": 0}]})

            async def ok(request: web.Request) -> web.Response:
                return web.json_response({})

            async def model_info(request: web.Request) -> web.Response:
                return web.json_response({"model_path": "stub", "weight_version": "0", "is_generation": True})

            async def models(request: web.Request) -> web.Response:
                return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})

            app = web.Application()
            app.add_routes([web.post("/generate", generate), web.get("/v1/loads", loads),
                            web.get("/health", ok), web.get("/health_generate", ok),
                            web.get("/model_info", model_info), web.get("/v1/models", models),
                            web.post("/continue_generation", ok), web.post("/pause_generation", ok),
                            web.post("/flush_cache", ok), web.get("/flush_cache", ok)])
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            ports.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        ports_file.write_text(json.dumps(ports))
        await asyncio.Event().wait()

    asyncio.run(main())


# --- the bench -------------------------------------------------------------------------------------

def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(5)


def start_stubs(n: int, per_proc: int, args: argparse.Namespace, tmp: Path) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    from rollout_bus.lm import tokenizer

    tokens = tokenizer.encode("12", add_bos=False)
    procs, files = [], []
    for k in range(0, n, per_proc):
        f = tmp / f"ports-{k}.json"
        files.append(f)
        procs.append(spawn([str(Path(__file__).resolve()), "--serve-stubs", str(min(per_proc, n - k)), "--ports-file",
                            str(f), "--token-ms", str(args.token_ms), "--batch-knee", str(args.batch_knee),
                            "--stub-tokens", json.dumps(tokens)], tmp / f"stubs-{k}.log"))
    deadline = time.monotonic() + 60
    while not all(f.exists() for f in files):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            stop(procs)
            raise RuntimeError("stub engines did not start")
        time.sleep(0.1)
    urls = [f"http://127.0.0.1:{port}" for f in files for port in json.loads(f.read_text())]
    return procs, urls


def commandstats(client: Any) -> dict[str, int]:
    return {str(k).removeprefix("cmdstat_"): int(v["calls"]) for k, v in client.info("commandstats").items()}


def cpu_s(client: Any) -> float:
    """redis-server's own CPU seconds, user + system, from ``INFO cpu`` (microsecond resolution)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def health_round(metrics_url: str) -> tuple[float, float]:
    with urllib.request.urlopen(metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("rollout_bus_controller_health_round_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("rollout_bus_controller_health_round_seconds_count"):
            count = float(line.split()[-1])
    return total, count


def run_once(n_exec: int, n_engines: int, args: argparse.Namespace, server: Any, tmp: Path) -> dict[str, Any]:
    from rq import Worker

    from rollout_bus.events.connection import connect
    from rollout_bus.events.embedded import free_port
    from rollout_bus.events.names import Keys
    from rollout_bus.events.paging import page
    from rollout_bus.events.registry import EngineState, Registry
    from rollout_bus.events.rollouts import RolloutRequest, SamplingParams
    from rollout_bus.events.schema import RolloutCompleted, decode
    from rollout_bus.events.submit import RolloutSubmitter, rq_queue

    client = connect(server.url)
    keys = Keys(f"scale{n_exec}x{n_engines}-{uuid.uuid4().hex[:4]}")
    run_dir = tmp / keys.namespace
    (run_dir / "weights").mkdir(parents=True)
    procs: list[subprocess.Popen[bytes]] = []
    stubs, urls = start_stubs(n_engines, args.stubs_per_process, args, run_dir)
    procs += stubs
    metrics_port = free_port()
    try:
        procs.append(spawn(["-m", "rollout_bus", "controller", "--redis-url", server.url, "--namespace", keys.namespace,
                            "--num-engines", "0", "--base-policy", "p", "--weights-root", str(run_dir / "weights"),
                            "--health-interval-s", str(args.health_interval_s), "--metrics-port", str(metrics_port),
                            "--log-level", "WARNING", *(a for u in urls for a in ("--adopt-url", u))],
                           run_dir / "controller.log"))
        registry = Registry(client, keys)
        deadline = time.monotonic() + 120
        while sum(1 for r in registry.engines().values() if r.state == EngineState.SERVING) < n_engines:
            if time.monotonic() > deadline or procs[-1].poll() is not None:
                raise RuntimeError(f"the controller did not adopt {n_engines} engines; see {run_dir}/controller.log")
            time.sleep(0.2)
        for i in range(n_exec):
            procs.append(spawn(["-m", "rollout_bus", "executor", "--redis-url", server.url, "--namespace",
                                keys.namespace, "--index", str(i), "--queues", "rollout", "--log-level", "WARNING"],
                               run_dir / f"executor-{i}.log"))
        queue = rq_queue(client, keys.rollout_queue)
        deadline = time.monotonic() + 300
        while Worker.count(queue=queue) < n_exec:
            if time.monotonic() > deadline:
                raise TimeoutError("executors did not start: " + (run_dir / "executor-0.log").read_text()[-2000:])
            time.sleep(0.1)
        time.sleep(args.health_interval_s)  # at least one health round with every engine before the window
        submitter = RolloutSubmitter(client, keys)
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
        n_jobs = max(args.min_jobs, n_exec * args.jobs_per_executor)
        calls0, cpu0 = commandstats(client), cpu_s(client)
        t0 = time.monotonic()
        for r in range(n_jobs):
            submitter.submit(RolloutRequest.create("p", r, args.groups, args.samples, sampling=sampling, timeout_s=600))
        deadline = time.monotonic() + 300
        while True:
            n_done = client.xlen(keys.rollout_stream)
            if n_done >= 3 * n_jobs:  # requested, started, completed (or failed) per job, at least
                events = [decode(f) for _, f in page(client, keys.rollout_stream)]
                done = [e for e in events if isinstance(e, RolloutCompleted)]
                if len(done) >= n_jobs or any(e.type == "RolloutFailed" for e in events):
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs did not finish; see {run_dir}")
            time.sleep(0.05)
        wall = time.monotonic() - t0
        calls1, cpu1 = commandstats(client), cpu_s(client)
        hsum, rounds = health_round(f"http://127.0.0.1:{metrics_port}/metrics")  # every round since adoption
    finally:
        stop(procs[::-1])
    failed = [e for e in events if e.type == "RolloutFailed"]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed: {failed[0]}")
    samples = sum(e.n_samples for e in done)
    lat = []
    for stream in (keys.rollout_stream, keys.batch_stream("p")):
        for entry_id, fields in page(client, stream):
            ms = int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])
            lat.append(ms - decode(fields).ts_ms)
    outside = [max(0.0, e.metrics["wall_s"] - e.metrics["engine_busy_s"]) for e in done]
    client.close()
    return {"executors": n_exec, "engines": n_engines, "jobs": n_jobs, "samples": samples, "wall_s": wall,
            "cmds_per_sample": (sum(calls1.values()) - sum(calls0.values())) / samples,
            "by_command": {k: (n - calls0.get(k, 0)) / samples for k, n in calls1.items() if n > calls0.get(k, 0)}, "redis_cpu_us_per_sample": (cpu1 - cpu0) / samples * 1e6,
            "health_round_ms": hsum / rounds * 1000 if rounds else float("nan"), "rounds": rounds,
            "dispatch_ms_per_sample": sum(outside) / samples * 1000,
            "event_p99_ms": statistics.quantiles(lat, n=100)[98] if len(lat) > 1 else float("nan")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--executors", default="1,4,16,32")
    p.add_argument("--engines", default="8,64,256")
    p.add_argument("--at-engines", type=int, default=64, help="engines of the executor sweep")
    p.add_argument("--at-executors", type=int, default=4, help="executors of the engine sweep")
    p.add_argument("--jobs-per-executor", type=int, default=4)
    p.add_argument("--min-jobs", type=int, default=32)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--token-ms", type=float, default=2.0)
    p.add_argument("--batch-knee", type=float, default=16.0)
    p.add_argument("--health-interval-s", type=float, default=1.0)
    p.add_argument("--stubs-per-process", type=int, default=64)
    p.add_argument("--by-command", action="store_true", help="also print each run's commands per sample by command")
    p.add_argument("--serve-stubs", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--ports-file", default="", help=argparse.SUPPRESS)
    p.add_argument("--stub-tokens", default="[]", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_stubs:
        serve_stubs(args.serve_stubs, Path(args.ports_file), args.token_ms, args.batch_knee,
                    json.loads(args.stub_tokens))
        return 0

    from rollout_bus.events.embedded import RedisServer

    points = [(int(e), args.at_engines) for e in args.executors.split(",")]
    points += [(args.at_executors, int(n)) for n in args.engines.split(",") if (args.at_executors, int(n)) not in points]
    load = os.getloadavg()
    print(f"# stub engines: {args.token_ms:g} ms/token x (1 + batch/{args.batch_knee:g}); jobs of {args.groups}x"
          f"{args.samples} samples x {args.max_new_tokens} tokens, {args.jobs_per_executor}/executor (>= "
          f"{args.min_jobs}); health every {args.health_interval_s:g}s; {os.cpu_count()} CPUs; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    print(f"{'exec':>4} {'engines':>7} {'jobs':>4} {'samples':>7} {'wall_s':>6} {'cmds/sample':>11} "
          f"{'redis_us/sample':>15} {'health_round_ms':>15} {'dispatch_ms/sample':>18} {'event_p99_ms':>12}", flush=True)
    results = []
    random.seed(0)
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as server:
        for n_exec, n_engines in points:
            r = run_once(n_exec, n_engines, args, server, Path(tmp))
            results.append(r)
            print(f"{r['executors']:>4} {r['engines']:>7} {r['jobs']:>4} {r['samples']:>7} {r['wall_s']:>6.1f} "
                  f"{r['cmds_per_sample']:>11.2f} {r['redis_cpu_us_per_sample']:>15.1f} {r['health_round_ms']:>15.1f} "
                  f"{r['dispatch_ms_per_sample']:>18.2f} {r['event_p99_ms']:>12.1f}", flush=True)
            if args.by_command:
                top = sorted(r["by_command"].items(), key=lambda kv: -kv[1])[:10]
                print("      " + "  ".join(f"{k} {v:.2f}" for k, v in top), flush=True)
    load = os.getloadavg()
    print(f"# load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
          + ("; no verdict: 1-minute load above 1" if load[0] > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
