"""The session gateway's costs: its overhead per turn, what a durable episode saves, and how many sessions
per second one gateway process serves.

1. ``overhead``: sessions of ``--turns`` chat turns through a gateway process (``python -m rollout_bus
   gateway``, a random Hugging Face Llama's byte tokenizer and ChatML template), each turn followed by
   the same ``/generate`` (the same ``input_ids`` and sampling parameters) sent straight to the engine.
   The engine is a stub in a process of its own that answers at once in SGLang's reply shape (engine
   time ~0, so the gateway's own cost shows: its Redis round trips, the template render, tokenization,
   JSON), and, as a secondary row, the real CPU engine on the same random Llama (greedy, so both calls
   make the same tokens). Clients: plain aiohttp, and the ``openai`` client agents use (its direct
   call stays aiohttp: an engine speaks no OpenAI). Per turn, the gateway's latency minus the direct
   call's; p50 / p90 / p99 of that difference per repeat, then the median and range over repeats.
   Then one more pass through a gateway run under cProfile, whose top entries are printed per turn.
2. ``durable``: an 8-turn episode of the tiny LM (``ModelConfig(max_seq_len=512)``) on the real CPU
   engine through an in-process gateway, uninterrupted; killed after k turns (the agent abandoned, the
   session reopened with ``Gateway.open(..., takeover=True)`` as a retried executor job does, the agent
   run again from the start); and killed the same way but retried without a journal (a fresh session
   id). Engine tokens (the sessions' ``engine_tokens``: context plus output sent to and made by the
   engine), engine calls and wall time.
3. ``saturation``: concurrent short sessions (open, 2 turns, close) against the stub engine through one
   gateway process, concurrency doubling until sessions/s stops rising; sessions/s, turns/s and the CPU
   of the gateway, the stub, redis and this client (from ``/proc/PID/stat``).

The load is judged from outside the bench: the 1-minute load average before each part, and the CPU that
processes outside this bench's process tree used while it ran (from ``/proc/stat``). Part 1's verdict is
``bench/verdict.py``'s ``judge`` over the per-repeat p50s (``overhead_rows``, also ``main(...)["rows"]``):
none when the load says the machine was busy, none when the spread over repeats crosses the target.

    python bench/bench_gateway.py [--quick] [--parts overhead,durable,saturation] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from verdict import Load, Target, paired_ratios  # noqa: E402
from verdict import Row as VerdictRow  # noqa: E402

from rollout_bus.events.connection import connect  # noqa: E402
from rollout_bus.events.embedded import RedisServer  # noqa: E402
from rollout_bus.events.names import Keys  # noqa: E402
from rollout_bus.events.registry import EngineRecord, EngineState, Registry  # noqa: E402

TARGET_MS = 1.0
"""The gateway's p50 cost per turn beyond the engine's time."""
HZ = os.sysconf("SC_CLK_TCK")
STUB = """
import json, sys
from aiohttp import web
ids = json.loads(sys.argv[2])
reply = json.dumps({"text": "", "output_ids": ids, "meta_info": {
    "id": "x", "finish_reason": {"type": "stop", "matched": ids[-1]}, "prompt_tokens": 0,
    "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": "0",
    "output_token_logprobs": [[-0.5, t, None] for t in ids]}}).encode()
async def generate(request):
    await request.read()
    return web.Response(body=reply, content_type="application/json")
app = web.Application()
app.router.add_post("/generate", generate)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


# --- load, from outside the bench ------------------------------------------------------------------

def load1() -> float:
    return os.getloadavg()[0]


def proc_jiffies(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    return proc_jiffies(pid) / HZ


def machine_busy() -> int:
    """Busy jiffies of every CPU so far (user, nice, system, irq, softirq, steal)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return f[0] + f[1] + f[2] + f[5] + f[6] + f[7]


def tree_jiffies(root: int) -> int:
    """CPU jiffies of ``root`` and every live process below it."""
    parent: dict[int, int] = {}
    spent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(name)] = int(fields[1])
        spent[int(name)] = int(fields[11]) + int(fields[12])
    ours, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in ours:
                ours.add(child)
                frontier.append(child)
    return sum(spent.get(p, 0) for p in ours)


@dataclass
class Watch:
    """The load before a part and the CPU other processes used during it (in cores)."""

    load_before: float = field(default_factory=load1)
    t0: float = field(default_factory=time.monotonic)
    busy0: int = field(default_factory=machine_busy)
    ours0: int = field(default_factory=lambda: tree_jiffies(os.getpid()))
    others_cores: float = 0.0
    load_after: float = 0.0

    def stop(self) -> Watch:
        wall = time.monotonic() - self.t0
        others = (machine_busy() - self.busy0) - (tree_jiffies(os.getpid()) - self.ours0)
        self.others_cores = max(others, 0) / HZ / max(wall, 1e-9)
        self.load_after = load1()
        return self

    def line(self) -> str:
        return (f"load average {self.load_before:.2f} before, {self.load_after:.2f} after; other processes used "
                f"{self.others_cores:.2f} of {os.cpu_count()} cores meanwhile")

    @property
    def busy(self) -> bool:
        return self.load_before > 1.0 or self.others_cores > 0.25


# --- processes -------------------------------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def wait_http(url: str, method: str = "GET", timeout_s: float = 60.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            req = urllib.request.Request(url, data=b"{}" if method == "POST" else None, method=method,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=1.0):
                return
        except (OSError, urllib.error.URLError):
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up within {timeout_s:.0f}s")


def start_stub(reply_ids: list[int], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-c", STUB, str(port), json.dumps(reply_ids)], env=env(),
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/generate", "POST", proc=proc)
    return proc, url


def start_gateway(model: Path, redis_url: str, keys: Keys, log: Path,
                  source_tree: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m rollout_bus gateway`` as a process of its own; ``source_tree``: from that package tree
    (``source_tree/rollout_bus``) instead of this checkout's."""
    port = free_port()
    cmd = [sys.executable, "-m", "rollout_bus", "gateway", "--model-path", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--redis-url", redis_url, "--namespace", keys.namespace, "--log-level", "WARNING"]
    environ = env()
    if source_tree is not None:
        environ["PYTHONPATH"] = str(source_tree)
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=source_tree or ROOT, env=environ, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc=proc)
    return proc, url


def package_tree(source: Path, tree: Path) -> Path:
    """The folder to put on ``PYTHONPATH`` for the ``rollout_bus`` package of a source checkout at
    ``source``. A checkout whose ``rollout_bus/`` links its package folders is that folder itself; an
    older one (top-level folders mapped by pyproject.toml's package-dir) is laid out as links under
    ``tree``."""
    import tomllib

    if (source / "rollout_bus" / "events" / "__init__.py").is_file():
        return source
    mapping = tomllib.loads((source / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    (tree / "rollout_bus").mkdir(parents=True)
    for name, folder in mapping.items():
        if name == "rollout_bus":
            for item in (source / folder).iterdir():
                (tree / "rollout_bus" / item.name).symlink_to(item.resolve())
        else:
            (tree / "rollout_bus" / name.split(".", 1)[1]).symlink_to((source / folder).resolve())
    return tree


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def register(redis_url: str, keys: Keys, engines: dict[str, tuple[str, str]]) -> None:
    """Engine records as the controller writes them: ``engine_id -> (url, policy)``."""
    client = connect(redis_url)
    try:
        Registry(client, keys).put_engines([
            EngineRecord(engine_id, url, EngineState.SERVING, versions={policy: 0}, base_policy=policy)
            for engine_id, (url, policy) in engines.items()])
    finally:
        client.close()


# --- statistics ------------------------------------------------------------------------------------

def quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    i = min(int(q * len(s)), len(s) - 1)
    return s[i]


def spread(values: Sequence[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


# --- 1. overhead per turn ----------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one short sentence."}


def user_turn(t: int) -> dict[str, str]:
    return {"role": "user", "content": f"Turn {t}: the tool said the value is {t * 37 % 101}. What next?"}


@dataclass
class Row:
    name: str
    policy: str
    engine_url: str
    client: str  # aiohttp | openai
    temperature: float
    sessions: int
    gw_url: str
    gw_pid: int
    gw_ms: list[list[float]] = field(default_factory=list)
    direct_ms: list[list[float]] = field(default_factory=list)
    cpu_ms_per_turn: list[float] = field(default_factory=list)


async def overhead_rep(row: Row, turns: int, max_tokens: int) -> None:
    import httpx
    import openai

    gw_url, gw_pid = row.gw_url, row.gw_pid
    gw_ms: list[float] = []
    direct_ms: list[float] = []
    nonce = uuid.uuid4().hex[:8]
    cpu0 = cpu_s(gw_pid)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=8)) as http, \
            httpx.AsyncClient(timeout=60) as hx:
        for s in range(row.sessions):
            sid = f"ov-{nonce}-{s}"
            async with http.post(gw_url + "/sessions", json={"session_id": sid, "policy": row.policy}) as r:
                assert r.status == 200, await r.text()
            oc = openai.AsyncOpenAI(base_url=f"{gw_url}/sessions/{sid}/v1", api_key="none", max_retries=0,
                                    http_client=hx)
            messages: list[dict[str, Any]] = [SYSTEM]
            context: list[int] = []
            for t in range(turns):
                messages.append(user_turn(t))
                if row.client == "openai":
                    t0 = time.perf_counter()
                    resp = await oc.chat.completions.create(model=row.policy, messages=messages,  # type: ignore[arg-type]
                                                            max_tokens=max_tokens, temperature=row.temperature)
                    took = time.perf_counter() - t0
                    part = resp.model_extra["rollout_bus"] if resp.model_extra else {}
                    message = resp.choices[0].message.model_dump(exclude_none=True)
                else:
                    body = {"model": row.policy, "messages": messages, "max_tokens": max_tokens,
                            "temperature": row.temperature}
                    t0 = time.perf_counter()
                    async with http.post(f"{gw_url}/sessions/{sid}/v1/chat/completions", json=body) as r:
                        data = await r.json()
                    took = time.perf_counter() - t0
                    assert r.status == 200, data
                    part = data["rollout_bus"]
                    message = data["choices"][0]["message"]
                context += part["input_token_ids"]
                direct = {"input_ids": context, "return_logprob": True, "rid": f"d-{sid}-{t}",
                          "sampling_params": {"max_new_tokens": max_tokens, "temperature": row.temperature}}
                t0 = time.perf_counter()
                async with http.post(row.engine_url + "/generate", json=direct) as r:
                    out = await r.json()
                direct_took = time.perf_counter() - t0
                assert r.status == 200, out
                if row.temperature == 0 and out["output_ids"] != part["output_token_ids"]:
                    raise RuntimeError("the direct call made other tokens than the gateway's: not the same call")
                context += part["output_token_ids"]
                messages.append(message)
                gw_ms.append(took * 1000)
                direct_ms.append(direct_took * 1000)
            async with http.post(f"{gw_url}/sessions/{sid}/close", json={"reward": 1.0}) as r:
                assert r.status == 200, await r.text()
    row.gw_ms.append(gw_ms)
    row.direct_ms.append(direct_ms)
    row.cpu_ms_per_turn.append((cpu_s(gw_pid) - cpu0) * 1000 / len(gw_ms))


def reply_ids(model: Path) -> list[int]:
    from rollout_bus.gateway.chat import HFChat

    fmt = HFChat(str(model))
    return fmt.encode("Sure, the next step is to call the tool again.") + list(fmt.stop_token_ids[:1])


def profile_turns(args: argparse.Namespace, redis_url: str, keys: Keys, model: Path, stub_url: str) -> pstats.Stats:
    """The stub rows' turns once more, through a gateway on a thread of this process whose event loop runs
    under cProfile (start-up and the client left out)."""
    import cProfile

    from tests.support.gateway import GatewayThread

    prof = cProfile.Profile()

    async def switch(on: bool) -> None:
        prof.enable() if on else prof.disable()

    with GatewayThread(redis_url, keys, model) as gwt:
        pid = os.getpid()
        asyncio.run(overhead_rep(Row("warm", "stubbed", stub_url, "aiohttp", 1.0, 2, gwt.url, pid), args.turns,
                                 args.max_tokens))
        gwt.call(switch(True))
        asyncio.run(overhead_rep(Row("profile", "stubbed", stub_url, "aiohttp", 1.0, args.sessions, gwt.url, pid),
                                 args.turns, args.max_tokens))
        gwt.call(switch(False))
    return pstats.Stats(prof)


def print_profile(stats: pstats.Stats, turns: int, top: int) -> None:
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    idle = ("select.epoll", "poll", "_run_once", "run_forever", "run_until_complete", "<method 'poll'")
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in raw.items():
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}({fn})" if line else fn
        rows.append((tt, ct, nc, where))
    print(f"\ncProfile of the gateway process, {turns} turns (ms per turn; the event loop's idle wait left out)")
    print(f"{'own ms/turn':>11} {'cum ms/turn':>11} {'calls/turn':>10}  function")
    shown = 0
    for tt, ct, nc, where in sorted(rows, reverse=True):
        if any(s in where for s in idle):
            continue
        print(f"{tt * 1000 / turns:11.3f} {ct * 1000 / turns:11.3f} {nc / turns:10.1f}  {where}")
        shown += 1
        if shown >= top:
            break
    ours = [r for r in rows if any(k in r[3] for k in (
        "service.py", "tito.py", "chat.py", "sessions.py", "publish.py", "engines.py", "app.py", "http_client.py"))
        or "apply_chat_template" in r[3] or "_batch_encode_plus" in r[3] or "json_response" in r[3]]
    print("\nthe gateway's own functions by cumulative time (ms per turn; coroutines count per resumption)")
    for tt, ct, nc, where in sorted(ours, key=lambda r: -r[1])[:top]:
        print(f"{tt * 1000 / turns:11.3f} {ct * 1000 / turns:11.3f} {nc / turns:10.1f}  {where}")


def round_trips(redis_url: str, n: int, reps: int) -> dict[str, list[float]]:
    """A turn's Redis work in the gateway's process: begin, commit and the event's publish as three round
    trips (as before) against the event riding in the commit's script (two), alternated; ms per turn."""
    from rollout_bus.events.publish import Publisher
    from rollout_bus.events.schema import Producer, SessionTurn
    from rollout_bus.events.sessions import SessionStore, new_state

    keys = Keys(f"gwr{uuid.uuid4().hex[:8]}")
    client = connect(redis_url)
    store, publisher = SessionStore(client, keys), Publisher(client, keys, Producer("gateway", "bench"))
    state = new_state("rt", "default", max_context=4096)
    store.create(state)

    def event() -> SessionTurn:
        return SessionTurn(producer=publisher.producer, policy="default", session_id="rt", turn=0, engine_id="e",
                           new_tokens=1, output_tokens=1, cached_tokens=0, oldest_version=0, newest_version=0,
                           finish="stop", gen_ms=1.0, env_ms=0.0)

    def three() -> None:
        held = store.begin("rt", uuid.uuid4().hex)
        store.commit(held, held.state)
        publisher.publish(keys.session_stream, event())

    def two() -> None:
        held = store.begin("rt", uuid.uuid4().hex)
        store.commit(held, held.state, publish=publisher.prepared(keys.session_stream, event()))

    kept: list[Any] = []

    def kept_state() -> None:
        """As a gateway's next turn on a session it served last: the state its commit wrote is not read again."""
        held = store.begin("rt", uuid.uuid4().hex, known=kept[0] if kept else None)
        state = held.state
        store.commit(held, state, publish=publisher.prepared(keys.session_stream, event()))
        held.state = state
        kept[:] = [held]

    out: dict[str, list[float]] = {"three": [], "two": [], "kept": []}
    try:
        for _ in range(reps):
            for name, fn in (("three", three), ("two", two), ("kept", kept_state)):
                fn()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                out[name].append((time.perf_counter() - t0) * 1000 / n)
    finally:
        client.close()
    return out


def part_overhead(args: argparse.Namespace, server: RedisServer, tmp: Path) -> dict[str, Any]:
    from tests.engine_proc import EngineProcess
    from tests.support.models import llama_dir

    model = llama_dir(tmp / "llama", seed=3, max_positions=4096)
    keys = Keys(f"gwb{uuid.uuid4().hex[:8]}")
    stub, stub_url = start_stub(reply_ids(model), tmp / "stub.log")
    engine = EngineProcess(model, log_path=tmp / "engine.log")
    register(server.url, keys, {"stub": (stub_url, "stubbed"), "cpu": (engine.url, "real")})
    gw, gw_url = start_gateway(model, server.url, keys, tmp / "gateway.log")
    gateways = [gw]
    rows = [Row("stub engine, aiohttp client", "stubbed", stub_url, "aiohttp", 1.0, args.sessions, gw_url, gw.pid)]
    if args.compare_source:
        tree = package_tree(Path(args.compare_source), tmp / "compare-tree")
        old, old_url = start_gateway(model, server.url, keys, tmp / "gateway-compare.log", source_tree=tree)
        gateways.append(old)
        rows.append(Row(f"the same, {Path(args.compare_source).name}'s gateway", "stubbed", stub_url, "aiohttp", 1.0,
                        args.sessions, old_url, old.pid))
    rows += [Row("stub engine, openai client", "stubbed", stub_url, "openai", 1.0, args.sessions, gw_url, gw.pid),
             Row("CPU engine (random Llama), aiohttp", "real", engine.url, "aiohttp", 0.0, args.engine_sessions, gw_url,
                 gw.pid)]
    try:
        for row in rows:  # warm-up: templates compiled, connections open
            warm = Row(row.name, row.policy, row.engine_url, row.client, row.temperature, 2, row.gw_url, row.gw_pid)
            asyncio.run(overhead_rep(warm, args.turns, args.max_tokens))
        watch = Watch()
        print(f"\n== 1. gateway overhead per turn: {args.turns}-turn sessions, {args.max_tokens} output tokens, "
              f"{args.reps} repeats; load average {watch.load_before:.2f} before", flush=True)
        for rep in range(args.reps):
            for row in rows[rep % len(rows):] + rows[:rep % len(rows)]:  # no fixed order
                asyncio.run(overhead_rep(row, args.turns, args.max_tokens))
        watch.stop()
    finally:
        for proc in gateways:
            stop(proc)
    prof = None
    if args.profile:
        prof = profile_turns(args, server.url, keys, model, stub_url)
    stop(stub)
    engine.stop()

    print(f"per turn: the gateway's latency minus the direct /generate's, same input_ids; median over {args.reps} "
          "repeats (min-max) of each repeat's quantile")
    print(f"{'row':38} {'turns':>5} {'direct p50':>16} {'gateway p50':>16} {'diff p50':>22} {'diff p90':>22} "
          f"{'diff p99':>22} {'gw CPU ms/turn':>22}")
    out: dict[str, Any] = {"rows": {}, "watch": watch}
    for row in rows:
        diffs = [[g - d for g, d in zip(gs, ds, strict=True)] for gs, ds in zip(row.gw_ms, row.direct_ms, strict=True)]
        q = {name: [quantile(d, p) for d in diffs] for name, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
        d50 = [statistics.median(d) for d in row.direct_ms]
        g50 = [statistics.median(g) for g in row.gw_ms]
        print(f"{row.name:38} {len(diffs[0]):5d} {spread(d50):>16} {spread(g50):>16} {spread(q['p50']):>22} "
              f"{spread(q['p90']):>22} {spread(q['p99']):>22} {spread(row.cpu_ms_per_turn):>22}")
        out["rows"][row.name] = {"p50": q["p50"], "p90": q["p90"], "p99": q["p99"], "cpu": row.cpu_ms_per_turn,
                                 "direct": d50, "gateway": g50}
        by_turn = [statistics.median([d[i] for d in diffs for i in range(t, len(d), args.turns)])
                   for t in range(args.turns)]
        print(f"{'':38} diff p50 by turn index: " + " ".join(f"{x:.2f}" for x in by_turn))
    trips = round_trips(server.url, 300 if args.quick else 1000, args.reps)
    print(f"a turn's Redis work, ms per turn, median of {args.reps} (min-max), alternated: begin + commit + publish "
          f"(3 round trips) {spread(trips['three'])}; begin + commit with the event in its script (2) "
          f"{spread(trips['two'])}; the same, the state kept from the last commit {spread(trips['kept'])}")
    out["trips"] = trips
    print(watch.line())
    out["verdict_rows"] = overhead_rows(out, [row.name for row in rows], bool(args.compare_source))
    for vrow in out["verdict_rows"]:
        values = " ".join(f"{v:.3f}" for v in vrow.values)
        print(f"{vrow.figure}: per repeat {values}; target {vrow.target or '-'}: {vrow.verdict.explain()}")
    if prof is not None:
        print_profile(prof, args.sessions * args.turns, args.top)
    out["model"] = model
    return out


def overhead_rows(out: dict[str, Any], names: list[str], compared: bool) -> list[VerdictRow]:
    """Verdict rows of part 1 (``bench/verdict.py``), per repetition: the gateway's p50 beyond the direct call
    (stub engine, aiohttp client) against the 1 ms target, and, with ``--compare-source``, its ratio to the
    other gateway's p50 in the same repeat (no target: the change, not the goal)."""
    watch: Watch = out["watch"]
    load = Load(watch.load_before, watch.others_cores / (os.cpu_count() or 1))
    p50 = out["rows"][names[0]]["p50"]
    rows = [VerdictRow("gateway", "turn overhead p50, ms beyond the engine call", list(p50), Target("<", TARGET_MS),
                       load)]
    if compared:
        rows.append(VerdictRow("gateway", "turn overhead p50 / the compared gateway's",
                               paired_ratios(p50, out["rows"][names[1]]["p50"]), None, load))
    return rows


# --- 2. durable episodes -------------------------------------------------------------------------------

EPISODE_TURNS = 8


async def durable_runs(redis_url: str, engine_url: str, model: Path, ks: list[int], reps: int) -> dict[str, Any]:
    import httpx
    import openai

    from rollout_bus.events.sessions import ABANDONED
    from rollout_bus.gateway.chat import load_format
    from rollout_bus.gateway.server import make_gateway, serve

    keys = Keys(f"gwd{uuid.uuid4().hex[:8]}")
    register(redis_url, keys, {"tiny": (engine_url, "tiny")})
    client = connect(redis_url)
    gateway = make_gateway(client, keys, load_format(str(model)), instance="bench", engine_key=None)
    running = await serve(gateway)
    hx = httpx.AsyncClient(timeout=120)

    async def agent(sid: str, stop_after: int | None = None) -> None:
        """The episode: EPISODE_TURNS questions, each reply kept in the history; ``stop_after``: abandoned there."""
        oc = openai.AsyncOpenAI(base_url=running.session_url(sid), api_key="none", max_retries=0, http_client=hx)
        messages: list[dict[str, Any]] = [{"role": "system", "content": "answer with a number"}]
        for t in range(EPISODE_TURNS):
            if stop_after is not None and t == stop_after:
                return
            messages.append({"role": "user", "content": f"turn {t}: what is {t}+{t * 3}?"})
            resp = await oc.chat.completions.create(model="tiny", messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                                    temperature=1.0, extra_body={"ignore_eos": True})
            messages.append(resp.choices[0].message.model_dump(exclude_none=True))

    def spent(sids: list[str]) -> tuple[int, int]:
        states = [gateway.get(s) for s in sids]
        return sum(s["engine_tokens"] for s in states), sum(s["engine_calls"] for s in states)

    async def opened(sid: str, takeover: bool = False) -> None:
        await asyncio.to_thread(gateway.open, sid, "tiny", takeover=takeover)

    async def closed(sid: str, status: str = "closed") -> None:
        await asyncio.to_thread(gateway.close, sid, reward=1.0 if status == "closed" else None, status=status)

    results: dict[str, list[tuple[int, int, float, float]]] = {}
    try:
        variants = ["uninterrupted"] + [f"{how} {k}" for k in ks for how in ("journal", "fresh")]
        for rep in range(reps):
            for variant in variants[rep % len(variants):] + variants[:rep % len(variants)]:  # no fixed order
                sid = f"ep-{uuid.uuid4().hex[:12]}"
                t0 = time.perf_counter()
                await opened(sid)
                sids = [sid]
                retry_s = 0.0
                if variant == "uninterrupted":
                    await agent(sid)
                    await closed(sid)
                else:
                    how, k = variant.split()
                    await agent(sid, stop_after=int(k))  # the executor dies here; the job is retried
                    t1 = time.perf_counter()
                    if how == "journal":
                        await opened(sid, takeover=True)
                    else:
                        await closed(sid, ABANDONED)
                        sid = f"ep-{uuid.uuid4().hex[:12]}"
                        sids.append(sid)
                        await opened(sid)
                    await agent(sid)
                    await closed(sid)
                    retry_s = time.perf_counter() - t1
                wall = time.perf_counter() - t0
                tokens, calls = spent(sids)
                results.setdefault(variant, []).append((tokens, calls, wall, retry_s))
    finally:
        await hx.aclose()
        await running.stop()
        client.close()
    return results


def part_durable(args: argparse.Namespace, server: RedisServer, tmp: Path) -> dict[str, Any]:
    from rollout_bus.lm.model import ModelConfig
    from tests.engine_proc import EngineProcess, make_weights_dir

    model = make_weights_dir(tmp / "tiny", seed=1, config=ModelConfig(max_seq_len=512))
    engine = EngineProcess(model, log_path=tmp / "tiny-engine.log")
    ks = [2, 4, 6]
    try:
        asyncio.run(durable_runs(server.url, engine.url, model, [], 1))  # warm-up
        watch = Watch()
        print(f"\n== 2. durable episodes: {EPISODE_TURNS}-turn episode of the tiny LM (8 tokens a reply) on the CPU "
              f"engine, {args.reps} repeats; load average {watch.load_before:.2f} before", flush=True)
        results = asyncio.run(durable_runs(server.url, engine.url, model, ks, args.reps))
        watch.stop()
    finally:
        engine.stop()
    base_tokens = statistics.median(r[0] for r in results["uninterrupted"])
    base_wall = statistics.median(r[2] for r in results["uninterrupted"])
    print(f"{'episode':34} {'engine tokens':>14} {'x uninterrupted':>16} {'engine calls':>13} "
          f"{'wall s, median (min-max)':>26} {'x uninterrupted':>16} {'retry wall s':>20}")
    for variant, rs in results.items():
        tokens = statistics.median(r[0] for r in rs)
        calls = statistics.median(r[1] for r in rs)
        walls = [r[2] for r in rs]
        label = {"uninterrupted": "uninterrupted"}.get(variant) or (
            f"killed at turn {variant.split()[1]}, " + ("journal (takeover)" if variant.startswith("journal")
                                                        else "no journal (new id)"))
        retry = spread([r[3] for r in rs], "{:.2f}") if variant != "uninterrupted" else "-"
        print(f"{label:34} {tokens:14.0f} {tokens / base_tokens:16.2f} {calls:13.0f} {spread(walls, '{:.2f}'):>26} "
              f"{statistics.median(walls) / base_wall:16.2f} {retry:>20}")
    print(watch.line())
    return {"results": results, "watch": watch}


# --- 3. saturation ------------------------------------------------------------------------------------

async def saturate(gw_url: str, policy: str, conc: int, duration_s: float, warm_s: float,
                   pids: dict[str, int]) -> dict[str, Any]:
    nonce = uuid.uuid4().hex[:8]
    done: list[tuple[float, int]] = []  # (finish time, turns)
    errors = 0
    t0 = time.perf_counter()
    begin, end = t0 + warm_s, t0 + warm_s + duration_s
    cpu: dict[str, float] = {}

    async def sample_cpu() -> None:
        await asyncio.sleep(max(begin - time.perf_counter(), 0))
        start = {name: cpu_s(pid) for name, pid in pids.items()}
        busy0, ours0 = machine_busy(), tree_jiffies(os.getpid())
        await asyncio.sleep(max(end - time.perf_counter(), 0))
        for name, pid in pids.items():
            cpu[name] = (cpu_s(pid) - start[name]) / duration_s
        cpu["others"] = max((machine_busy() - busy0) - (tree_jiffies(os.getpid()) - ours0), 0) / HZ / duration_s

    async def worker(w: int, http: aiohttp.ClientSession) -> None:
        nonlocal errors
        i = 0
        while time.perf_counter() < end:
            sid = f"sat-{nonce}-{w}-{i}"
            i += 1
            try:
                async with http.post(gw_url + "/sessions", json={"session_id": sid, "policy": policy}) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                        continue
                messages: list[dict[str, Any]] = [SYSTEM]
                turns = 0
                for t in range(2):
                    messages.append(user_turn(t))
                    async with http.post(f"{gw_url}/sessions/{sid}/v1/chat/completions",
                                         json={"model": policy, "messages": messages, "max_tokens": 16}) as r:
                        data = await r.json()
                    if r.status != 200:
                        errors += 1
                        break
                    messages.append(data["choices"][0]["message"])
                    turns += 1
                async with http.post(f"{gw_url}/sessions/{sid}/close", json={"reward": 0.0}) as r:
                    await r.read()
                if turns == 2 and r.status == 200:
                    done.append((time.perf_counter(), turns))
            except aiohttp.ClientError:
                errors += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(sample_cpu(), *(worker(w, http) for w in range(conc)))
    counted = [d for d in done if begin <= d[0] <= end]
    return {"sessions_s": len(counted) / duration_s, "turns_s": sum(d[1] for d in counted) / duration_s,
            "cpu": cpu, "errors": errors}


def part_saturation(args: argparse.Namespace, server: RedisServer, tmp: Path, model: Path | None) -> dict[str, Any]:
    from tests.support.models import llama_dir

    model = model or llama_dir(tmp / "llama", seed=3, max_positions=4096)
    keys = Keys(f"gws{uuid.uuid4().hex[:8]}")
    stub, stub_url = start_stub(reply_ids(model), tmp / "stub-sat.log")
    register(server.url, keys, {"stub": (stub_url, "stubbed")})
    gw, gw_url = start_gateway(model, server.url, keys, tmp / "gateway-sat.log")
    assert server.proc is not None
    pids = {"gateway": gw.pid, "stub": stub.pid, "redis": server.proc.pid, "client": os.getpid()}
    levels: list[tuple[int, list[dict[str, Any]]]] = []
    try:
        asyncio.run(saturate(gw_url, "stubbed", 4, 1.0, 0.3, pids))  # warm-up
        watch = Watch()
        print(f"\n== 3. saturation: sessions of open + 2 turns + close against the stub engine, one gateway process, "
              f"{args.sat_s:g} s a run, {args.reps} runs a level; load average {watch.load_before:.2f} before",
              flush=True)
        print(f"{'concurrency':>11} {'sessions/s':>22} {'turns/s':>22} {'gateway CPU':>12} {'stub':>6} {'redis':>6} "
              f"{'client':>7} {'others':>7} {'errors':>7}")
        best, since_best, conc = 0.0, 0, 1
        while conc <= args.max_conc:
            runs = [asyncio.run(saturate(gw_url, "stubbed", conc, args.sat_s, 0.5, pids)) for _ in range(args.reps)]
            levels.append((conc, runs))
            sps = [r["sessions_s"] for r in runs]

            def cpu(name: str, rs: list[dict[str, Any]] = runs) -> str:
                return f"{statistics.median(r['cpu'][name] for r in rs) * 100:.0f}%"

            print(f"{conc:11d} {spread(sps, '{:.1f}'):>22} {spread([r['turns_s'] for r in runs], '{:.1f}'):>22} "
                  f"{cpu('gateway'):>12} {cpu('stub'):>6} {cpu('redis'):>6} {cpu('client'):>7} {cpu('others'):>7} "
                  f"{sum(r['errors'] for r in runs):7d}", flush=True)
            if statistics.median(sps) > best * 1.05:
                best, since_best = statistics.median(sps), 0
            else:
                since_best += 1
                if since_best >= 2:
                    break
            conc *= 2
        watch.stop()
    finally:
        stop(gw)
        stop(stub)
    top_conc, top_runs = max(levels, key=lambda lv: statistics.median(r["sessions_s"] for r in lv[1]))
    gw_cpu = statistics.median(r["cpu"]["gateway"] for r in top_runs)
    print(f"saturation: {statistics.median(r['sessions_s'] for r in top_runs):.1f} sessions/s, "
          f"{statistics.median(r['turns_s'] for r in top_runs):.1f} turns/s at concurrency {top_conc}, the gateway "
          f"process at {gw_cpu * 100:.0f}% of a core "
          + ("(CPU-bound: one core is its ceiling)" if gw_cpu > 0.85 else
             "(below one core: the limit is elsewhere, e.g. the machine's cores shared with the client)"))
    per_session = [r["cpu"]["gateway"] / r["sessions_s"] * 1000 for _, rs in levels for r in rs if r["sessions_s"]]
    ms = statistics.median(per_session)
    print(f"the gateway's CPU per session (open, 2 turns, close): {spread(per_session, '{:.2f}')} ms over every run; "
          f"a gateway process with a core of its own would top out near {1000 / ms:.0f} sessions/s "
          f"({2000 / ms:.0f} turns/s)")
    print(watch.line())
    return {"levels": levels, "watch": watch}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="overhead,durable,saturation")
    p.add_argument("--quick", action="store_true", help="fewer repeats and turns: a smoke run")
    p.add_argument("--reps", type=int, default=None, help="repeats of each measurement (default 3, quick 2)")
    p.add_argument("--turns", type=int, default=8, help="turns per session in the overhead part")
    p.add_argument("--sessions", type=int, default=None, help="sessions per repeat, stub rows (default 25, quick 8)")
    p.add_argument("--engine-sessions", type=int, default=None, help="sessions per repeat, CPU engine row")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--top", type=int, default=18, help="profile entries to print")
    p.add_argument("--sat-s", type=float, default=None, help="seconds per saturation run (default 3, quick 1.5)")
    p.add_argument("--max-conc", type=int, default=128)
    p.add_argument("--compare-source", default=None, metavar="DIR",
                   help="another checkout's source (e.g. `git archive BASE | tar -x -C DIR`): its gateway is measured "
                        "side by side with this one's in part 1 (stub engine, aiohttp client)")
    args = p.parse_args(argv)
    args.reps = args.reps or (2 if args.quick else 3)
    args.sessions = args.sessions or (8 if args.quick else 25)
    args.engine_sessions = args.engine_sessions or (2 if args.quick else 5)
    args.sat_s = args.sat_s or (1.5 if args.quick else 3.0)
    parts = set(args.parts.split(","))
    print(f"bench_gateway: {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at "
          f"start", flush=True)
    server = RedisServer().start()
    model = None
    result: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-gateway-") as d:
            tmp = Path(d)
            if "overhead" in parts:
                result["overhead"] = part_overhead(args, server, tmp)
                result["rows"] = result["overhead"]["verdict_rows"]
                model = result["overhead"]["model"]
            if "durable" in parts:
                part_durable(args, server, tmp)
            if "saturation" in parts:
                part_saturation(args, server, tmp, model)
    finally:
        server.stop()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
    return result


if __name__ == "__main__":
    main()
