"""Chaos: the main job on the tiny LM while a seeded random schedule SIGKILLs an executor, the engine, the
trainer and the controller, one after another, and restarts Redis once (AOF ``always``).

Each fault fires once the trainer reached the step the schedule drew for it, and is shown to have
landed (the process exited with SIGKILL, the engine pid is gone, the server is down) before the next
one. Then the run must complete, and its exported event log must show that nothing was lost, nothing
happened twice and nothing was left undecided: ``verify`` finds no violation, no batch was trained
twice, and every rollout request ended trained or dropped by the staleness rule, with its reason.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rollout_bus.events import processes
from rollout_bus.events.connection import Guard, ReconnectPolicy, connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.errors import BusError
from rollout_bus.events.names import Keys
from rollout_bus.events.registry import Registry
from rollout_bus.events.schema import (
    BatchConsumed,
    BatchReady,
    EngineLaunching,
    RolloutRequested,
    TrainStepDone,
    decode,
)
from rollout_bus.launch.config import RunConfig
from rollout_bus.launch.job import RunHandle, run_job
from rollout_bus.replay.logfile import LogEntry, LogReader, Payload, decode_entries
from rollout_bus.replay.verify import verify_log
from tests.support.fake_rollouts import shared_init_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

SEED = int(os.environ.get("ROLLOUT_BUS_CHAOS_SEED", "1212"))
"""The schedule's seed; set ROLLOUT_BUS_CHAOS_SEED to try another (each run prints its schedule and faults)."""
STEPS = 24
FAULTS = ("executor", "engine", "trainer", "controller", "redis")


@pytest.fixture()
def aof_server(tmp_path: Path) -> Iterator[RedisServer]:
    (tmp_path / "redis").mkdir()
    server = RedisServer(data_dir=tmp_path / "redis", appendonly=True, appendfsync="always").start()
    yield server
    server.stop()


@dataclass
class Landed:
    fault: str
    at_step: int
    evidence: str


@dataclass
class Chaos:
    """Runs the schedule in a thread of its own, from the moment every role is started."""

    server: RedisServer
    schedule: list[tuple[int, str]]
    landed: list[Landed] = field(default_factory=list)
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def start(self, handle: RunHandle) -> None:
        self.thread = threading.Thread(target=self._run, args=(handle,), name="chaos", daemon=True)
        self.thread.start()

    def _run(self, handle: RunHandle) -> None:
        try:
            client = connect(handle.url)
            guard = Guard(client, ReconnectPolicy(max_wait_s=60), name="chaos")
            for step, fault in self.schedule:
                _wait(f"step {step}", lambda s=step: _trainer_step(guard, handle.keys) >= s, 150)  # type: ignore[misc]
                evidence = getattr(self, f"_{fault}")(handle, guard)
                self.landed.append(Landed(fault, step, evidence))
        except BaseException as exc:  # reported by the test
            self.error = exc

    @staticmethod
    def _kill_child(handle: RunHandle, name: str) -> str:
        child = next(c for c in handle.procs.children if c.name == name)
        pid, seen = child.pid, len(child.exits)
        os.kill(pid, signal.SIGKILL)
        _wait(f"{name} seen dead", lambda: len(child.exits) > seen, 20)  # the run's supervisor noticed
        assert child.exits[-1] == -signal.SIGKILL, child.exits
        return f"{name} pid {pid} exited with {child.exits[-1]}"

    def _executor(self, handle: RunHandle, guard: Guard) -> str:
        return self._kill_child(handle, "executor-0")

    def _trainer(self, handle: RunHandle, guard: Guard) -> str:
        return self._kill_child(handle, "trainer-p0")

    def _controller(self, handle: RunHandle, guard: Guard) -> str:
        return self._kill_child(handle, "controller")

    def _engine(self, handle: RunHandle, guard: Guard) -> str:
        record = guard.call(lambda c: Registry(c, handle.keys).engines()["engine-0"])
        pid = record.pid
        assert pid is not None and processes.alive(pid, cmdline_has="engine")
        os.kill(pid, signal.SIGKILL)
        _wait("the engine process gone", lambda: not processes.alive(pid, cmdline_has="engine"), 20)
        return f"engine-0 pid {pid} gone"

    def _redis(self, handle: RunHandle, guard: Guard) -> str:
        self.server.kill()
        assert self.server.proc is not None and self.server.proc.returncode == -signal.SIGKILL
        time.sleep(0.5)  # down for a while: every role sees its connection refused
        self.server.restart()
        return "redis-server killed (-9) and restarted from its append-only file"


def _wait(what: str, cond: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"chaos: timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def _trainer_step(guard: Guard, keys: Keys) -> int:
    try:
        rows = guard.call(lambda c: c.xrevrange(keys.trainer_stream, count=20))
    except BusError:
        return 0
    steps = [e.step for e in (decode(f) for _, f in rows) if isinstance(e, TrainStepDone)]
    return max(steps, default=0)


def draw_schedule(seed: int) -> list[tuple[int, str]]:
    """Each fault at a distinct step, in a random order; the trainer is killed only once it checkpointed."""
    rng = random.Random(seed)
    faults = list(FAULTS)
    rng.shuffle(faults)
    steps = sorted(rng.sample(range(2, STEPS - 6), len(faults)))
    return list(zip(steps, faults, strict=True))


def test_the_main_job_survives_random_kills_and_a_redis_restart_losing_and_repeating_nothing(
        aof_server: RedisServer, keys: Keys, tmp_path: Path) -> None:
    schedule = draw_schedule(SEED)
    chaos = Chaos(aof_server, schedule)
    log_path = tmp_path / "run.rblog"
    config = RunConfig(mode="async", steps=STEPS, seed=0, out=str(tmp_path / "out"), redis_url=aof_server.url,
                       namespace=keys.namespace, init_dir=str(shared_init_dir()), progress=False, plot=False,
                       timeout_s=240.0, restart_budget=3, log_events=str(log_path))
    print(f"chaos seed {SEED}: {schedule}")
    result = run_job(config, on_start=chaos.start)
    print(f"landed: {chaos.landed}\nsummary:\n{result.text}")
    assert chaos.thread is not None
    chaos.thread.join(10)
    assert chaos.error is None, f"{type(chaos.error).__name__}: {chaos.error}"
    # every fault of the schedule landed, in order (each waited for its evidence before the next)
    assert [(f.at_step, f.fault) for f in chaos.landed] == schedule, chaos.landed
    assert result.summaries["p0"]["steps"] == STEPS
    restarts = result.faults["restarts"]
    assert restarts["executor-0"] >= 1 and restarts["trainer-p0"] >= 1 and restarts["controller"] >= 1

    assert verify_log(log_path) == []
    with LogReader(log_path) as reader:
        records = list(reader)
    events = [e.event for e in decode_entries(r for r in records if isinstance(r, LogEntry))]
    ready = {e.batch_id for e in events if isinstance(e, BatchReady)}
    assert {r.batch_id for r in records if isinstance(r, Payload)} == ready  # every batch's bytes, for offline use
    steps = [e for e in events if isinstance(e, TrainStepDone)]
    assert sorted(e.step for e in steps) == list(range(1, STEPS + 1))  # each step announced once
    trained_rollouts = Counter(int(e.metrics["rollout_id"]) for e in steps)
    assert max(trained_rollouts.values()) == 1  # no batch trained twice
    consumed: dict[str, list[BatchConsumed]] = {}
    for e in events:
        if isinstance(e, BatchConsumed):
            consumed.setdefault(e.batch_id, []).append(e)
    assert all(len(v) == 1 for v in consumed.values())
    requested = {e.request_id for e in events if isinstance(e, RolloutRequested)}
    outcome: dict[str, str] = {}
    for request_id in requested:
        (final,) = consumed.get(f"batch-{request_id}", [None])  # type: ignore[list-item]
        assert final is not None, f"request {request_id} never ended"
        outcome[request_id] = "trained" if final.accepted else final.reason
    assert sum(1 for o in outcome.values() if o == "trained") == STEPS
    assert all(o == "trained" or o.startswith("stale:") for o in outcome.values()), outcome
    assert sum(1 for e in events if isinstance(e, EngineLaunching)) >= 2  # the killed engine was relaunched


def test_the_chaos_schedule_is_a_seeded_random_order_of_every_fault() -> None:
    schedule = draw_schedule(SEED)
    assert schedule == draw_schedule(SEED) and sorted(f for _, f in schedule) == sorted(FAULTS)
    assert [s for s, _ in schedule] == sorted({s for s, _ in schedule}) and schedule[0][0] >= 2
    assert draw_schedule(SEED + 1) != schedule



def test_a_redis_restart_without_persistence_stops_the_run_with_that_reason_and_leaves_no_engine(
        tmp_path: Path) -> None:
    """Redis SIGKILLed and started again empty mid-run (no append-only file): every role notices its bus
    epoch gone within seconds and exits with the reason, and ``rollout-bus run`` stops non-zero, saying why,
    with no engine process left, instead of finishing with exit 0 and a summary without rewards."""
    import subprocess
    import sys
    from datetime import datetime

    (tmp_path / "redis").mkdir()
    server = RedisServer(data_dir=tmp_path / "redis").start()  # --appendonly no, --save "": nothing survives
    namespace = "reset-" + os.urandom(4).hex()
    keys = Keys(namespace)
    out = tmp_path / "out"
    env = {**os.environ, "ROLLOUT_BUS_EPOCH_CHECK_S": "0.5"}
    job = subprocess.Popen(
        [sys.executable, "-m", "rollout_bus", "run", "--redis-url", server.url, "--namespace", namespace,
         "--steps", "400", "--seed", "0", "--out", str(out), "--init-dir", str(shared_init_dir()), "--no-progress",
         "--no-plot", "--timeout-s", "200", "--restart-budget", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        client = connect(server.url)
        guard = Guard(client, ReconnectPolicy(max_wait_s=30), name="chaos")
        _wait("trainer step 2", lambda: job.poll() is not None or _trainer_step(guard, keys) >= 2, 150)
        assert job.poll() is None, job.communicate()[0].decode(errors="replace")[-3000:]
        epoch = client.get(keys.bus_epoch)
        engines = {e.engine_id: e.pid for e in Registry(client, keys).engines().values()}
        assert epoch and engines and all(pid and processes.alive(pid, cmdline_has="engine")
                                         for pid in engines.values()), engines
        server.kill()
        assert server.proc is not None and server.proc.returncode == -signal.SIGKILL
        server.restart()
        restarted, restarted_wall = time.monotonic(), time.time()
        client = connect(server.url)
        assert client.get(keys.bus_epoch) != epoch  # the fault landed: the run's data is gone
        output, _ = job.communicate(timeout=120)
        stopped_s = time.monotonic() - restarted
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        server.stop()
    text = output.decode(errors="replace")
    print(text[-3000:])
    assert job.returncode != 0, text[-2000:]
    assert f"run failed: Redis lost the data of namespace {namespace}" in text, text[-2000:]
    assert "reward" not in text.split("run failed:")[1]  # no summary pretending the run finished
    assert stopped_s < 60
    for role in ("controller", "executor-0", "trainer-p0"):  # each noticed on its own and exited with the reason
        log_text = (out / "logs" / f"{role}.log").read_text(errors="replace")
        assert "BusReset: Redis lost the data of namespace" in log_text, (role, log_text[-2000:])
        line = next(ln for ln in log_text.splitlines() if ": stopping: Redis lost the data" in ln)
        noticed = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        assert noticed - restarted_wall < 10, (role, noticed - restarted_wall)
    left = {name: pid for name, pid in engines.items() if pid and processes.alive(pid, cmdline_has="engine")}
    assert left == {}, f"engine processes left after the run stopped: {left}"
    assert "still alive: SIGKILL" not in text, text[-2000:]  # the controller stopped them, not the launcher
