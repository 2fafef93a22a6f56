"""A trainer SIGKILLed twice (once right after a checkpoint, once at a random point) resumes:
no batch is lost and none is trained twice, checked by batch id."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from pathlib import Path

import pytest

from rollout_bus.events.connection import connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.schema import BatchConsumed, BatchReady, TrainStepDone, decode
from rollout_bus.launch.procs import Child, ProcessSet
from rollout_bus.tasks.warmstart import WarmStartConfig, warm_start_cached
from rollout_bus.trainer.checkpoint import CheckpointStore
from tests.support.fake_rollouts import shared_init_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 9


def wait_until(what: str, cond, timeout_s: float = 90.0, child: Child | None = None) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if child is not None and not child.alive():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}" + (f":\n{child.tail()}" if child else ""))
        time.sleep(0.05)


def test_a_killed_trainer_resumes_without_losing_or_repeating_a_batch(tmp_path: Path, redis_server: RedisServer,
                                                                      keys: Keys) -> None:
    init = warm_start_cached(shared_init_dir(), WarmStartConfig())
    weights, ckpt = tmp_path / "weights", tmp_path / "ckpt"
    url, ns = redis_server.url, keys.namespace
    procs = ProcessSet(tmp_path / "logs", env={"ROLLOUT_BUS_NAMESPACE": ns})
    client = connect(url)
    trainer_args = ["train", "--redis-url", url, "--namespace", ns, "--policy", "p0",
                    "--trainer-id", "trainer-p0", "--mode", "async", "--in-flight", "2", "--steps", str(STEPS),
                    "--model-path", str(init), "--weights-root", str(weights), "--checkpoint-dir", str(ckpt),
                    "--n-groups", "8", "--n-samples", "4", "--log-dir", str(tmp_path / "metrics")]

    def steps_done() -> int:
        done = [decode(f) for _, f in page(client, keys.trainer_stream)]
        return max((e.step for e in done if isinstance(e, TrainStepDone)), default=0)

    try:
        procs.start("controller", ["-m", "rollout_bus", "controller", "--redis-url", url, "--namespace", ns, "--num-engines",
                                   "1", "--model-path", str(init), "--weights-root", str(weights), "--base-policy",
                                   "p0", "--log-dir", str(tmp_path / "logs")])
        procs.start("executor", ["-m", "rollout_bus", "executor", "--redis-url", url, "--namespace", ns,
                                 "--data-source-args", json.dumps({"digits": 1})])
        # 1: the trainer kills itself right after the checkpoint of step 3, before acking its batch
        first = procs.start("trainer-1", ["-m", "tests.support.trainer_crash", "3", *trainer_args])
        assert first.proc.wait(120) == -signal.SIGKILL, first.tail()
        state = CheckpointStore(ckpt).load()
        assert state is not None and state.state.step == 3
        # 2: restarted, then SIGKILLed by us at a random moment after step 5, whatever it is doing
        second = procs.start("trainer-2", ["-m", "rollout_bus", "trainer", *trainer_args])
        wait_until("step 5", lambda: steps_done() >= 5, child=second)
        time.sleep(random.Random(7).uniform(0.0, 0.2))
        os.kill(second.pid, signal.SIGKILL)
        second.proc.wait(10)
        # 3: restarted again, runs to the end
        third = procs.start("trainer-3", ["-m", "rollout_bus", "trainer", *trainer_args])
        assert third.proc.wait(120) == 0, third.tail()
    finally:
        procs.stop_all()

    final = CheckpointStore(ckpt).load()
    assert final is not None
    trained = final.state.trained
    assert [s for s, _ in trained] == list(range(1, STEPS + 1))  # every step once, in order
    ids = [b for _, b in trained]
    assert len(set(ids)) == STEPS  # no batch trained twice
    events = [decode(f) for _, f in page(client, keys.trainer_stream)]
    accepted = [e.batch_id for e in events if isinstance(e, BatchConsumed) and e.accepted]
    assert sorted(accepted) == sorted(ids)  # each trained batch acked and announced exactly once
    announced = [e.step for e in events if isinstance(e, TrainStepDone)]
    assert sorted(announced) == list(range(1, STEPS + 1))  # every step announced once, crashes or not
    assert final.state.counters.get("skipped_already_trained", 0) >= 1  # the step-3 batch came back and was skipped
    stream = keys.batch_stream("p0")
    ready = [decode(f) for _, f in page(client, stream)]
    produced = {e.batch_id for e in ready if isinstance(e, BatchReady)}
    in_flight = {f"batch-{r}" for r in final.state.in_flight.values()}
    assert produced - in_flight - set(final.state.dropped) == set(ids)  # no batch lost
    pending = client.xpending(stream, "trainer-p0")["pending"]
    assert pending <= len(in_flight)  # nothing held but what was still in flight at the end
    logged = []
    for line in (tmp_path / "metrics" / f"{ns}-p0.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError):  # a SIGKILL may cut a line short
            logged.append(json.loads(line)["step"])
    assert logged == list(range(1, STEPS + 1))  # the metric log has every step once, crashes or not
    client.close()
