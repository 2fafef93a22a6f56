"""An executor told to stop while its Redis is gone stops on the first SIGTERM: a real redis-server that the
test kills, a real executor process, a real CPU engine; the executor is idle, or in the middle of a job whose
engine went too, so that its router is waiting for the registry (a read in a worker thread, retrying for its
reconnect budget, which held the process's exit before)."""

from __future__ import annotations

import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_bus.events.connection import connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.rollouts import RolloutRequest, SamplingParams
from rollout_bus.events.submit import RolloutSubmitter
from tests.engine_proc import EngineProcess, make_weights_dir
from tests.support.executor_procs import ExecutorProcess, register_engines, rollout_events
from tests.support.procs import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture()
def engine() -> Iterator[EngineProcess]:
    with tempfile.TemporaryDirectory() as tmp:
        engine = EngineProcess(make_weights_dir(Path(tmp) / "w"), token_delay_ms=200)  # a job of many seconds
        try:
            yield engine
        finally:
            engine.kill()


def _wait_log(executor: ExecutorProcess, what: str, line: str, timeout_s: float = 30.0) -> None:
    """Wait for ``line`` anywhere in the executor's log (the whole log: the reconnect warnings of its other
    threads can push an early line out of any tail); on a timeout, the log's end says what it did instead."""
    try:
        wait_for(what, lambda: line in executor.log_path.read_text(errors="replace"), timeout_s)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; the executor's log ends:\n{executor.log_tail(6000)}") from None


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "mid-job"])
def test_an_executor_that_gets_sigterm_while_redis_is_gone_exits(keys: Keys, engine: EngineProcess,
                                                                  busy: bool) -> None:
    server = RedisServer().start()
    executor = None
    try:
        client = connect(server.url)
        register_engines(client, keys, {"e0": engine.url})
        executor = ExecutorProcess(server.url, keys.namespace, 0)
        if busy:
            request = RolloutRequest.create("p", 0, 1, 2, sampling=SamplingParams(max_new_tokens=40), timeout_s=600)
            RolloutSubmitter(client, keys).submit(request)
            wait_for("the job started", lambda: bool(rollout_events(client, keys, "RolloutStarted")), 60)
            # in its engine call (RolloutStarted comes before the job reads its prompt from Redis: a kill of Redis
            # then would leave the job waiting on that read, never on the registry after the engine's death)
            wait_for("the job's call running on the engine", lambda: engine.state()["running"] >= 1, 60)
        else:
            wait_for("the executor's worker registered",
                     lambda: any(k.endswith(b"-executor-0") for k in client.scan_iter("rq:worker:*")), 60)
        client.close()
        server.kill()
        if busy:
            engine.kill()  # the job's call fails: its router reads the registry again, from a worker thread
            _wait_log(executor, "the router waiting for the registry", "registry: connection to Redis lost")
        _wait_log(executor, "the executor saw Redis go", "Connection refused")
        assert executor.proc.poll() is None  # Redis is gone and the executor is still there
        executor.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while executor.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert executor.proc.poll() is not None, "one SIGTERM did not stop the executor:\n" + executor.log_tail()
    finally:
        if executor is not None:
            executor.kill()
        server.stop()
