"""Chaos: the main job's controller paused (SIGSTOP) past its lease while a standby controller runs.

The standby takes the lease and adopts the engines with a newer token; the engines then refuse the
paused leader's token (409 fenced). Resumed (SIGCONT), the old leader steps down without writing
anything more: no registry record and no event of its own after the pause. The run completes, and
when it stops no engine process is left for the launcher to kill.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rollout_bus.engine.http_client import EngineClient, EngineHTTPError, close_shared_session
from rollout_bus.events import processes
from rollout_bus.events.connection import Guard, ReconnectPolicy, connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import weight_streams
from rollout_bus.events.registry import EngineState, Registry
from rollout_bus.events.schema import TrainStepDone, decode
from rollout_bus.launch.config import RunConfig, RunFailed
from rollout_bus.launch.job import RunHandle, run_job
from tests.support.fake_rollouts import shared_init_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 12
TTL_S = 2.0


def _wait(what: str, cond: Callable[[], object], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


class Pause:
    """Pauses the controller past its lease once the trainer reached step 2, with a standby beside it."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.evidence: dict[str, object] = {}
        self.engine_pids: set[int] = set()
        self.thread: threading.Thread | None = None

    def start(self, handle: RunHandle) -> None:
        self.thread = threading.Thread(target=self._run, args=(handle,), name="pause", daemon=True)
        self.thread.start()

    def _run(self, handle: RunHandle) -> None:
        try:
            self._pause(handle)
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _pause(self, handle: RunHandle) -> None:
        keys = handle.keys
        guard = Guard(connect(handle.url), ReconnectPolicy(max_wait_s=30), name="pause")
        registry = Registry(guard.client, keys, guard)

        def step() -> int:
            rows = guard.call(lambda c: c.xrevrange(keys.trainer_stream, count=20))
            return max((e.step for e in (decode(f) for _, f in rows) if isinstance(e, TrainStepDone)), default=0)

        first = next(c for c in handle.procs.children if c.name == "controller")
        second = handle.procs.start("controller-standby", [*first.args, "--instance", "standby"])
        _wait("trainer step 2", lambda: step() >= 2, 120)

        def holder_pid() -> int:
            raw = guard.call(lambda c: c.get(keys.controller_lease)) or b""
            parts = raw.decode().rsplit(":", 3)
            return int(parts[2]) if len(parts) == 4 and parts[2].isdigit() else 0

        leader, standby = (first, second) if holder_pid() == first.pid else (second, first)
        assert holder_pid() == leader.pid
        self.engine_pids |= {r.pid for r in registry.engines().values() if r.pid}
        old_token = int(guard.call(lambda c: c.get(keys.controller_fence)) or 0)
        old_producer = f"{socket.gethostname()}-{leader.pid}"
        os.kill(leader.pid, signal.SIGSTOP)
        try:
            paused_ms = time.time_ns() // 1_000_000
            _wait("the standby holds the lease", lambda: holder_pid() == standby.pid, 30)
            _wait("the standby serving the engines", lambda: all(
                r.state == EngineState.SERVING and r.updated_ms > paused_ms for r in registry.engines().values()), 60)
            new_token = int(guard.call(lambda c: c.get(keys.controller_fence)) or 0)
            url = next(iter(registry.engines().values())).url
            self.evidence["refused"] = asyncio.run(_refused(url, old_token))  # the paused leader's token
            assert processes.alive(leader.pid) and leader.proc.poll() is None  # paused, not dead
        finally:
            os.kill(leader.pid, signal.SIGCONT)
        _wait("the old leader stepping down", lambda: "stepping down" in leader.log_path.read_text(errors="replace"),
              30)
        _wait("the old leader standing by", lambda: "handed over" in leader.log_path.read_text(errors="replace"), 30)
        assert holder_pid() == standby.pid
        self.evidence["late"] = [  # what the old leader wrote from its pause to standing by again
            e for stream in (keys.engine_stream, *weight_streams(guard.client, keys))
            for e in (decode(f) for _, f in guard.call(lambda c, s=stream: c.xrange(s)))  # type: ignore[misc]
            if e.producer.instance == old_producer and e.ts_ms > paused_ms]
        self.evidence.update(old_token=old_token, new_token=new_token)
        self.engine_pids |= {r.pid for r in registry.engines().values() if r.pid}


async def _refused(url: str, token: int) -> EngineHTTPError:
    try:
        with pytest.raises(EngineHTTPError) as refused:
            await EngineClient(url, fence=token).model_info()
        return refused.value
    finally:
        await close_shared_session()


def _where(pause: Pause, logs: Path, lines: int = 25) -> str:
    alive = pause.thread is not None and pause.thread.is_alive()
    try:
        seen = sorted(pause.evidence)
    except RuntimeError:  # the pause thread is writing it now
        seen = ["(changing)"]
    parts = [f"pause thread {'still running' if alive else 'done'}, error {pause.error!r}, evidence {seen}"]
    for log_file in sorted(logs.glob("*.log")):
        tail = log_file.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log_file.name}\n" + "\n".join(line[:300] for line in tail))
    return "\n".join(parts)


@pytest.fixture()
def server() -> RedisServer:
    return RedisServer().start()


def test_a_controller_paused_past_its_lease_is_fenced_steps_down_writing_nothing_and_the_run_completes(
        server: RedisServer, keys: Keys, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pause = Pause()
    config = RunConfig(mode="async", steps=STEPS, seed=0, out=str(tmp_path / "out"), redis_url=server.url,
                       namespace=keys.namespace, init_dir=str(shared_init_dir()), progress=False, plot=False,
                       timeout_s=200.0, restart_budget=2, controller_args=["--lease-ttl-s", f"{TTL_S:g}"])
    caplog.set_level(logging.WARNING, logger="rollout_bus.launch.procs")
    try:
        try:
            result = run_job(config, on_start=pause.start)
        except RunFailed as exc:  # what the pause saw and each role's last lines say where the run stopped
            raise AssertionError(f"{exc}; {_where(pause, tmp_path / 'out' / 'logs')}") from None
        assert pause.thread is not None
        pause.thread.join(10)
        assert pause.error is None, f"{type(pause.error).__name__}: {pause.error}"
        refused = pause.evidence["refused"]
        assert isinstance(refused, EngineHTTPError) and refused.status == 409 and refused.fenced
        assert int(pause.evidence["new_token"]) > int(pause.evidence["old_token"])  # type: ignore[call-overload]
        assert pause.evidence["late"] == []  # no event (nor the record written before each) from the old leader
        assert result.summaries["p0"]["steps"] == STEPS
        assert result.faults["restarts"]["controller"] == 0  # it stepped down; it did not crash
        assert not any(processes.alive(pid, cmdline_has="engine") for pid in pause.engine_pids)
        assert "still alive: SIGKILL" not in caplog.text  # the controllers stopped their engines themselves
    finally:
        server.stop()
