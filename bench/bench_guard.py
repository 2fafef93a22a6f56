"""What the fence guard (``engine.guard``) adds to each ``/generate`` call.

An upstream that answers ``/generate`` at once with an SGLang-shaped reply (so only HTTP and the
guard are measured) runs in a process of its own, the guard in another, as the controller launches
them; this process sends sequential ``/generate`` calls over one kept-alive connection, alternating
direct and through the guard, and prints the median and p90 of each and their difference (the
guard's cost per call), with the load average (a busy machine inflates every figure).

    python bench/bench_guard.py [--calls 2000] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = """
import json, sys
from aiohttp import web
n = int(sys.argv[2])
reply = json.dumps({"output_ids": list(range(n)), "meta_info": {"id": "x", "finish_reason": {"type": "length"},
                    "weight_version": "0", "output_token_logprobs": [[-0.5, t, None] for t in range(n)]}}).encode()
async def generate(request):
    await request.read()
    return web.Response(body=reply, content_type="application/json")
app = web.Application()
app.router.add_post("/generate", generate)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_up(session: aiohttp.ClientSession, url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            async with session.post(url + "/generate", json={}) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        await asyncio.sleep(0.1)


async def measure(direct: str, guarded: str, calls: int) -> tuple[list[float], list[float]]:
    body = json.dumps({"input_ids": list(range(32)), "sampling_params": {"max_new_tokens": 64},
                       "return_logprob": True}).encode()
    headers = {"Content-Type": "application/json"}
    times: dict[str, list[float]] = {direct: [], guarded: []}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4)) as session:
        for url in (direct, guarded):
            await wait_up(session, url)
        for i in range(calls * 2 + 200):
            url = direct if i % 2 == 0 else guarded
            started = time.perf_counter()
            async with session.post(url + "/generate", data=body, headers=headers) as r:
                await r.read()
            if i >= 200:  # warm-up left out
                times[url].append((time.perf_counter() - started) * 1000)
    return times[direct], times[guarded]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=64, help="output tokens in the upstream's reply")
    args = p.parse_args()
    up, guard = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", UPSTREAM, str(up), str(args.tokens)], env=env),
             subprocess.Popen([sys.executable, "-m", "rollout_bus.engine.guard", "--port", str(guard),
                               "--upstream", f"http://127.0.0.1:{up}", "--log-level", "warning"], cwd=ROOT, env=env)]
    load_start = os.getloadavg()[0]
    try:
        direct, guarded = asyncio.run(measure(f"http://127.0.0.1:{up}", f"http://127.0.0.1:{guard}", 50))
        cpu_start = cpu_s(procs[1].pid)
        direct, guarded = asyncio.run(measure(f"http://127.0.0.1:{up}", f"http://127.0.0.1:{guard}", args.calls))
        guard_cpu_ms = (cpu_s(procs[1].pid) - cpu_start) * 1000 / (args.calls + 100)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)

    def p90(xs: list[float]) -> float:
        return statistics.quantiles(xs, n=10)[-1]

    d, g = statistics.median(direct), statistics.median(guarded)
    print(f"/generate, {args.calls} sequential calls each, reply of {args.tokens} tokens; {os.cpu_count()} CPUs")
    print(f"direct        median {d:.3f} ms  p90 {p90(direct):.3f} ms")
    print(f"through guard median {g:.3f} ms  p90 {p90(guarded):.3f} ms")
    print(f"guard's cost per call: median {g - d:.3f} ms (p90 difference {p90(guarded) - p90(direct):.3f} ms)")
    print(f"guard's CPU time per call: {guard_cpu_ms:.3f} ms (what the guard spends, whatever the load)")
    print(f"load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
