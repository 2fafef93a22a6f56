"""The main job on the tiny LM against a Sentinel deployment, its primary SIGKILLed mid-run.

A primary, one replica and three sentinels run as local ``redis-server`` processes; every role
gets the ``redis+sentinel://`` url. At a seeded random training step the primary is SIGKILLed
(shown dead), the sentinels promote the replica (shown: they name another primary), and the
killed server comes back as a replica of the new one. The run must complete on the new primary,
with every training step announced once, no batch trained twice, and every event the roles were
told was written present in the exported log.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from rollout_bus.events.connection import Guard, ReconnectPolicy, connect
from rollout_bus.events.errors import BusError
from rollout_bus.events.names import Keys
from rollout_bus.events.schema import BatchConsumed, BatchReady, TrainStepDone, WeightsPublished, decode
from rollout_bus.launch.config import RunConfig
from rollout_bus.launch.job import RunHandle, run_job
from rollout_bus.replay.logfile import LogEntry, LogReader, decode_entries
from rollout_bus.replay.verify import verify_log
from tests.support.fake_rollouts import shared_init_dir
from tests.support.sentinel import SentinelCluster

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

SEED = int(os.environ.get("ROLLOUT_BUS_SENTINEL_SEED", "1414"))
STEPS = 12


def _trainer_step(guard: Guard, keys: Keys) -> int:
    try:
        rows = guard.call(lambda c: c.xrevrange(keys.trainer_stream, count=20))
    except BusError:
        return 0
    return max((e.step for e in (decode(f) for _, f in rows) if isinstance(e, TrainStepDone)), default=0)


class Failover:
    def __init__(self, cluster: SentinelCluster, at_step: int) -> None:
        self.cluster = cluster
        self.at_step = at_step
        self.evidence: list[str] = []
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self, handle: RunHandle) -> None:
        self.thread = threading.Thread(target=self._run, args=(handle,), name="failover", daemon=True)
        self.thread.start()

    def _run(self, handle: RunHandle) -> None:
        try:
            guard = Guard(connect(handle.url), ReconnectPolicy(max_wait_s=60), name="failover")
            deadline = time.monotonic() + 150
            while _trainer_step(guard, handle.keys) < self.at_step:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the trainer never reached step {self.at_step}")
                time.sleep(0.05)
            victim = self.cluster.kill_primary()  # asserts it exited with SIGKILL
            self.evidence.append(f"primary on port {victim.port} killed: exit {victim.proc.returncode}"  # type: ignore[union-attr]
                                 f" at step {_trainer_step(guard, handle.keys)}")
            new_port = self.cluster.wait_failover(victim.port)
            self.evidence.append(f"sentinels promoted the replica on port {new_port}")
            self.cluster.rejoin(victim, new_port)
            self.evidence.append(f"port {victim.port} back as a replica")
        except BaseException as exc:  # reported by the test
            self.error = exc


def test_the_main_job_completes_across_a_sentinel_failover_losing_and_repeating_nothing(tmp_path: Path) -> None:
    at_step = random.Random(SEED).randint(2, STEPS - 4)
    keys = Keys(f"sent{SEED}")
    log_path = tmp_path / "run.rblog"
    with SentinelCluster() as cluster:
        failover = Failover(cluster, at_step)
        config = RunConfig(mode="async", steps=STEPS, seed=0, out=str(tmp_path / "out"), redis_url=cluster.url,
                           namespace=keys.namespace, init_dir=str(shared_init_dir()), progress=False, plot=False,
                           timeout_s=240.0, restart_budget=3, log_events=str(log_path))
        print(f"sentinel run seed {SEED}: primary killed at step {at_step}")
        result = run_job(config, on_start=failover.start)
        assert failover.thread is not None
        failover.thread.join(30)
        print(f"{failover.evidence}\nsummary:\n{result.text}")
        assert failover.error is None, f"{type(failover.error).__name__}: {failover.error}"
        assert len(failover.evidence) == 3, failover.evidence  # killed, promoted, back as a replica
        assert cluster.primary_port() != cluster.servers[0].port  # the run ended on the promoted replica

    assert result.summaries["p0"]["steps"] == STEPS
    assert verify_log(log_path) == []
    with LogReader(log_path) as reader:
        events = [e.event for e in decode_entries(r for r in reader if isinstance(r, LogEntry))]
    steps = [e for e in events if isinstance(e, TrainStepDone)]
    assert sorted(e.step for e in steps) == list(range(1, STEPS + 1))  # each step announced once
    assert max(Counter(int(e.metrics["rollout_id"]) for e in steps).values()) == 1  # no batch trained twice
    accepted = Counter(e.batch_id for e in events if isinstance(e, BatchConsumed) and e.accepted)
    assert accepted and max(accepted.values()) == 1
    ready = {e.batch_id for e in events if isinstance(e, BatchReady)}
    assert set(accepted) <= ready  # every trained batch's BatchReady is in the log
    published = sorted(e.version for e in events if isinstance(e, WeightsPublished))
    assert published == sorted(set(published)) and len(published) >= STEPS // 2
