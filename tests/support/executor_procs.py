"""Helpers of the executor tests: executor subprocesses (stopped and killed by pid), engine records,
and readers for the rollout and batch streams."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.registry import EngineRecord, EngineState, PolicyRecord, Registry
from rollout_bus.events.schema import BatchReady, Event, decode
from rollout_bus.events.train_data import TrainData
from rollout_bus.executor.output import read_batch

ROOT = Path(__file__).resolve().parents[2]

#: Fault-test timings: a dead executor's job is retried within about 3 + 1 seconds.
FAST_FAULTS = ("--heartbeat-ttl-s", "3", "--heartbeat-interval-s", "1", "--reap-interval-s", "1",
               "--worker-ttl-s", "20", "--engine-cooldown-s", "1", "--registry-refresh-s", "0.2")


class ExecutorProcess:
    """``rollout-bus executor`` as a subprocess."""

    def __init__(self, redis_url: str, namespace: str, index: int, extra_args: Sequence[str] = (),
                 log_path: Path | None = None) -> None:
        self.index = index
        self.log_path = log_path or Path(tempfile.mkstemp(prefix=f"executor-{index}-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "rollout_bus", "executor", "--redis-url", redis_url,
               "--namespace", namespace, "--index", str(index), *FAST_FAULTS, *extra_args]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL by pid: a crash, nothing cleaned up."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def register_engines(client: redis.Redis, keys: Keys, engines: dict[str, str], *, policy: str = "p",
                     version: int = 0) -> None:
    """Engine records serving ``policy`` at ``version`` and the policy's record, as the controller writes them."""
    registry = Registry(client, keys)
    for engine_id, url in engines.items():
        registry.put_engine(EngineRecord(engine_id=engine_id, url=url, state=EngineState.SERVING,
                                         versions={policy: version}, base_policy=policy))
    registry.put_policy(PolicyRecord(policy=policy, published=version, serving=version))


def events(client: redis.Redis, stream: str) -> list[Event]:
    return [decode(fields) for _, fields in page(client, stream)]


def rollout_events(client: redis.Redis, keys: Keys, type_name: str | None = None) -> list[Any]:
    return [e for e in events(client, keys.rollout_stream) if type_name is None or e.type == type_name]


def batch_ready(client: redis.Redis, keys: Keys, policy: str = "p") -> list[BatchReady]:
    return [e for e in events(client, keys.batch_stream(policy)) if isinstance(e, BatchReady)]


def batch_counts(client: redis.Redis, keys: Keys, policy: str = "p") -> Counter[str]:
    return Counter(e.batch_id for e in batch_ready(client, keys, policy))


def train_data(client: redis.Redis, keys: Keys, event: BatchReady) -> TrainData:
    return read_batch(client, keys, event)


def job(client: redis.Redis, job_id: str) -> Job:
    return Job.fetch(job_id, connection=client, serializer=JSONSerializer)


def jobs_done(client: redis.Redis, job_ids: Sequence[str]) -> bool:
    return all(job(client, j).get_status() in (JobStatus.FINISHED, JobStatus.FAILED) for j in job_ids)
