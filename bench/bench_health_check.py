"""Health check round over 32 engines with one hung: the round takes about one timeout, not 32.

32 real torch engines do not fit on a small CI machine, so this benchmark runs 32
lightweight aiohttp stub servers *in this process*, each answering ``/health_generate``
after a short delay like a one-token generation, except the hung ones, which never
answer. The round itself is the controller's own (``controller.health.check_all``, the
same code the controller runs every interval), so what is measured is its concurrency.
For contrast it also times a one-after-another round (miles' monitor checks engines in
turn), where every hung engine costs a full timeout.

    python bench/bench_health_check.py [--engines 32] [--hung 1,4] [--timeout-s 1.0] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_bus.controller.health import HealthResult, check_all, check_engine  # noqa: E402
from rollout_bus.engine.http_client import EngineClient, close_shared_session  # noqa: E402


async def start_stub(hung: bool, delay_s: float) -> tuple[web.AppRunner, str]:
    async def health_generate(_: web.Request) -> web.Response:
        await asyncio.sleep(3600 if hung else delay_s)
        return web.Response(status=200)

    app = web.Application()
    app.add_routes([web.get("/health_generate", health_generate)])
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def sequential(clients: dict[str, EngineClient], timeout_s: float) -> list[HealthResult]:
    return [await check_engine(eid, c, timeout_s) for eid, c in clients.items()]


async def main(args: argparse.Namespace) -> None:
    for hung in (int(h) for h in args.hung.split(",")):
        await scenario(args, hung)
        print()


async def scenario(args: argparse.Namespace, hung: int) -> None:
    stubs = [await start_stub(i < hung, args.delay_ms / 1000) for i in range(args.engines)]
    clients = {f"stub-{i}": EngineClient(url) for i, (_, url) in enumerate(stubs)}
    await check_all(clients, args.timeout_s)  # warm the connection pool
    parallel_s, seq_s = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        results = await check_all(clients, args.timeout_s)
        parallel_s.append(time.perf_counter() - t)
        assert sum(not r.ok for r in results) == hung, results
    for _ in range(max(1, args.repeats // 2)):
        t = time.perf_counter()
        await sequential(clients, args.timeout_s)
        seq_s.append(time.perf_counter() - t)
    par, seq = statistics.median(parallel_s), statistics.median(seq_s)
    print(f"engines={args.engines} hung={hung} timeout={args.timeout_s:.3f}s "
          f"healthy-check delay={args.delay_ms:.1f}ms repeats={args.repeats}; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"parallel round (controller):   median {par:.3f}s  min {min(parallel_s):.3f}s  max {max(parallel_s):.3f}s"
          f"  = {par / args.timeout_s:.2f} x timeout")
    print(f"sequential round (one by one): median {seq:.3f}s  = {seq / args.timeout_s:.2f} x timeout")
    print(f"sequential / parallel: {seq / par:.1f}x;  worst case if all {args.engines} hung, sequential: "
          f"{args.engines * args.timeout_s:.1f}s = {args.engines} x timeout, parallel: ~1 x timeout")
    await close_shared_session()
    for runner, _ in stubs:
        await runner.cleanup()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=32)
    p.add_argument("--hung", default="1,4", help="comma-separated: how many stubs never answer, per scenario")
    p.add_argument("--timeout-s", type=float, default=1.0)
    p.add_argument("--delay-ms", type=float, default=2.0, help="how long a healthy stub takes to answer")
    p.add_argument("--repeats", type=int, default=5)
    asyncio.run(main(p.parse_args()))
