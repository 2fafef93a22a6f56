"""The fence in front of an engine that does not read it: SGLang ignores ``X-Rollout-Bus-Fence``.

A small HTTP proxy on the engine's registered port (where every controller call goes), with the
engine behind it on a port of its own (where executors may send ``/generate`` directly).
Control routes (everything but ``/generate`` and the open routes) get the CPU engine's fence: once
the API key is checked (SGLang's own 401 when it is wrong), a call whose token is older than the
highest seen is answered 409 (``{"success": false, "fenced": true, "highest": H, "message":
"fenced: token T is older than H: another controller took over"}``) and never reaches the engine; a
token as new or newer becomes the highest. Open routes (``/health*``, ``/ready``, ``/metrics``) never
read the fence, and ``/generate`` goes straight through, its reply streamed back as it comes.

    python -m rollout_bus.engine.guard --port P --upstream-port Q [--api-key K] -- ENGINE COMMAND...
    python -m rollout_bus.engine.guard --port P --upstream http://host:port [--api-key K]

With an engine command the guard starts it as its child (in its own process group, so stopping the
group stops both), and exits with the engine's status when the engine exits: a dead engine is a dead
process to the controller, as without a guard. Without one it fronts a server someone else runs (an
engine to adopt: adopt the guard's URL).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import signal
import sys
from collections.abc import Sequence

import aiohttp
from aiohttp import web

from rollout_bus.engine.http_client import FENCE_HEADER

log = logging.getLogger(__name__)

OPEN_PREFIXES = ("/health", "/ready", "/metrics")
STRAIGHT = frozenset({"/generate"})
_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade",
                  FENCE_HEADER.lower()})
_HIGHEST = web.AppKey("highest", list)
_UPSTREAM = web.AppKey("upstream", str)
_SESSION = web.AppKey("session", aiohttp.ClientSession)


def fenced_reply(token: int, highest: int) -> web.Response:
    return web.json_response({"success": False, "fenced": True, "highest": highest,
                              "message": f"fenced: token {token} is older than {highest}: "
                                         "another controller took over"}, status=409)


def build_guard_app(upstream: str, *, api_key: str | None = None, timeout_s: float = 3600.0) -> web.Application:
    """The guard as an aiohttp app in front of ``upstream`` (``http://host:port``)."""
    expected = api_key.encode() if api_key else None

    async def handle(request: web.Request) -> web.StreamResponse:
        path = request.path
        if path in STRAIGHT or path.startswith(OPEN_PREFIXES) or request.method == "OPTIONS":
            return await forward(request)
        if expected is not None:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
                return web.json_response({"error": "Unauthorized"}, status=401)  # SGLang's own answer
        raw = request.headers.get(FENCE_HEADER)
        if raw is not None:
            try:
                token = int(raw)
            except ValueError:
                return web.json_response({"error": {"message": f"{FENCE_HEADER} must be an integer, got {raw!r}"}},
                                         status=400)
            highest = request.app[_HIGHEST]
            if token < highest[0]:
                log.warning("%s %s refused: fencing token %d is older than %d", request.method, path, token,
                            highest[0])
                return fenced_reply(token, highest[0])
            highest[0] = token
        return await forward(request)

    async def forward(request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        body = await request.read() if request.body_exists else None
        session = request.app[_SESSION]
        try:
            async with session.request(request.method, request.app[_UPSTREAM] + request.path_qs, data=body,
                                       headers=headers, allow_redirects=False) as resp:
                content_type = resp.headers.get("Content-Type", "")
                if not content_type.startswith("text/event-stream"):
                    return web.Response(body=await resp.read(), status=resp.status,
                                        headers={"Content-Type": content_type} if content_type else None)
                out = web.StreamResponse(status=resp.status, headers={"Content-Type": content_type,
                                                                       "Cache-Control": "no-cache"})
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (aiohttp.ClientError, OSError) as exc:
            return web.json_response({"error": {"message": f"engine behind the guard: {type(exc).__name__}: {exc}"}},
                                     status=502)

    async def open_session(app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0)
        app[_SESSION] = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                              timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def close_session(app: web.Application) -> None:
        await app[_SESSION].close()

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[_HIGHEST] = [0]
    app[_UPSTREAM] = upstream.rstrip("/")
    app.router.add_route("*", "/{tail:.*}", handle)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    return app


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1:]
    p = argparse.ArgumentParser(prog="python -m rollout_bus.engine.guard", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="where the guard listens")
    p.add_argument("--port", type=int, required=True, help="the engine's registered port: the guard's")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--upstream-port", type=int, help="the engine's own port (with an engine command)")
    target.add_argument("--upstream", help="the URL of a server someone else runs (no engine command)")
    p.add_argument("--upstream-host", default="127.0.0.1", help="the engine's address (with --upstream-port)")
    p.add_argument("--api-key", default=None, help="the engines' API key (checked before the fence)")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    if command and args.upstream:
        p.error("an engine command goes with --upstream-port, not --upstream")
    if not command and args.upstream_port is not None:
        p.error("--upstream-port needs the engine command after --")
    return args, command


async def serve(args: argparse.Namespace, command: list[str]) -> int:
    upstream = args.upstream or f"http://{args.upstream_host}:{args.upstream_port}"
    runner = web.AppRunner(build_guard_app(upstream, api_key=args.api_key), handler_cancellation=True,
                           access_log=None)
    await runner.setup()
    child: asyncio.subprocess.Process | None = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if command:
            child = await asyncio.create_subprocess_exec(*command)  # same process group as the guard
            log.info("engine pid %d behind the guard on port %d", child.pid, args.port)
        await web.TCPSite(runner, args.host, args.port).start()
        log.info("guard on %s:%d in front of %s", args.host, args.port, upstream)
        waiters: list[asyncio.Future[object]] = [asyncio.ensure_future(stop.wait())]
        if child is not None:
            waiters.append(asyncio.ensure_future(child.wait()))
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
    finally:
        if child is not None and child.returncode is None:
            child.terminate()
            try:
                await asyncio.wait_for(child.wait(), 30.0)
            except TimeoutError:
                child.kill()
                await child.wait()
        await runner.cleanup()
    if child is not None and not stop.is_set():
        rc = child.returncode or 0
        log.error("the engine behind the guard exited with status %d", rc)
        return rc if rc >= 0 else 128 - rc  # killed by a signal: the shell's convention
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args, command = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rollout_bus.events.processes import watch_run

    watch_run()  # in a run: the guard and its SGLang (one process group) go when the run is gone
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(serve(args, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
