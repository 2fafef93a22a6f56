"""A trainer paused (SIGSTOP) mid-step past its lease writes nothing when it is continued.

Trainer A stops itself in the middle of its first step (the step computed, nothing of it written).
Its lease lapses while it is stopped, and trainer B takes the policy and publishes v1. Only once
that is shown (A stopped, its rank field gone, B's process holding the lease, B's v1 announced)
is A continued. A must then write nothing: not over B's v1 directory, no ``BatchConsumed``,
``TrainStepDone``, ``WeightsPublished`` or rollout request, no ack and no checkpoint; it stops
with the ``deposed:`` line and exit status ``LeaseLost.exit_code``, and the controller serves B's v1.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rollout_bus.events.connection import Redis, connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.errors import LeaseLost, ReplicationTimeout
from rollout_bus.events.leased import LeaseFence
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import (
    Producer,
    WeightsPublished,
    WeightUpdateFailed,
    WeightVersionServing,
    decode,
)
from rollout_bus.launch.procs import Child, ProcessSet
from rollout_bus.lm.files import read_manifest, verify_weights_dir
from rollout_bus.tasks.warmstart import WarmStartConfig, warm_start_cached
from rollout_bus.trainer.checkpoint import CHECKPOINT_FILE
from rollout_bus.trainer.weights import version_dir
from tests.support.fake_rollouts import shared_init_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

LEASE_TTL_S = 2.0


def wait_until(what: str, cond: Callable[[], bool], timeout_s: float = 120.0, *children: Child) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        for child in children:
            if not child.alive():
                raise AssertionError(f"{child.name} exited with {child.proc.returncode} waiting for {what}:\n"
                                     f"{child.tail(40)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def process_state(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def events(client: Redis, keys: Keys) -> list[tuple[str, object]]:
    return [(stream, decode(f)) for stream in (keys.trainer_stream, keys.weight_stream("p0"), keys.rollout_stream)
            for _, f in page(client, stream)]


def written_by(client: Redis, keys: Keys, instance: str) -> list[str]:
    return [f"{type(e).__name__} on {stream}" for stream, e in events(client, keys)
            if getattr(e, "producer", None) is not None and e.producer.instance == instance]  # type: ignore[attr-defined]


def test_a_trainer_paused_past_its_lease_writes_nothing_when_continued(tmp_path: Path, redis_server: RedisServer,
                                                                        keys: Keys) -> None:
    init = warm_start_cached(shared_init_dir(), WarmStartConfig())
    weights = tmp_path / "weights"
    url, ns = redis_server.url, keys.namespace
    procs = ProcessSet(tmp_path / "logs", env={"ROLLOUT_BUS_NAMESPACE": ns})
    client = connect(url)
    lease_key, stream = keys.trainer_lease("p0"), keys.batch_stream("p0")

    def trainer(trainer_id: str, steps: int) -> list[str]:
        return ["train", "--redis-url", url, "--namespace", ns, "--policy", "p0", "--trainer-id", trainer_id,
                "--mode", "sync", "--steps", str(steps), "--model-path", str(init), "--weights-root", str(weights),
                "--checkpoint-dir", str(tmp_path / f"ckpt-{trainer_id}"), "--n-groups", "4", "--n-samples", "4",
                "--lease-ttl-s", str(LEASE_TTL_S), "--log-dir", str(tmp_path / "metrics")]

    def b_v1() -> WeightsPublished | None:
        return next((e for _, e in events(client, keys) if isinstance(e, WeightsPublished) and e.version == 1), None)

    instance_a = f"{socket.gethostname()}-trainer-a"
    try:
        procs.start("controller", ["-m", "rollout_bus", "controller", "--redis-url", url, "--namespace", ns,
                                   "--num-engines", "1", "--model-path", str(init), "--weights-root", str(weights),
                                   "--base-policy", "p0", "--log-dir", str(tmp_path / "logs")])
        procs.start("executor", ["-m", "rollout_bus", "executor", "--redis-url", url, "--namespace", ns,
                                 "--data-source-args", json.dumps({"digits": 1})])
        a = procs.start("trainer-a", ["-m", "tests.support.trainer_pause", *trainer("trainer-a", 3)])
        wait_until("trainer A stopped mid-step", lambda: process_state(a.pid) == "T", 120.0, a)
        assert "paused mid-step" in a.log_path.read_text()
        before = written_by(client, keys, instance_a)
        assert client.xpending(stream, "trainer-a")["pending"] == 1  # the batch of its step, not acked
        b = procs.start("trainer-b", ["-m", "rollout_bus", "trainer", *trainer("trainer-b", 1)])
        # the pause landed: A is still stopped, its rank field lapsed, and B's process holds the policy
        wait_until("trainer B holds the lease", lambda: client.hget(lease_key, "owner") == b"trainer-b/1", 60.0, b)
        holder = client.hget(lease_key, "r0")
        assert holder is not None and holder.decode().endswith(f":{b.pid}")
        assert process_state(a.pid) == "T"
        wait_until("B's v1 announced", lambda: b_v1() is not None, 120.0, b)
        published = b_v1()
        assert published is not None and published.producer.instance == f"{socket.gethostname()}-trainer-b"
        os.kill(a.pid, signal.SIGCONT)
        a.proc.wait(60)
        assert b.proc.wait(120) == 0, b.tail(40)  # sync mode: B waited until the controller served its v1
    finally:
        for child in procs.children:  # a stopped process would sit out SIGTERM: let it see it
            if child.alive():
                os.kill(child.pid, signal.SIGCONT)
        procs.stop_all()

    log_a = a.log_path.read_text()
    assert "continued after the pause" in log_a  # A really ran on after the pause
    assert written_by(client, keys, instance_a) == before  # no BatchConsumed, TrainStepDone, request, publish
    assert client.xpending(stream, "trainer-a")["pending"] == 1  # and no ack
    assert not (tmp_path / "ckpt-trainer-a" / CHECKPOINT_FILE).exists()  # nor a checkpoint
    v1 = version_dir(weights, "p0", 1)
    assert read_manifest(v1)[1] == published.sha256  # B's v1, not replaced
    verify_weights_dir(v1, published.sha256)  # what the controller checks before it loads a version
    outcomes = [e for _, e in events(client, keys) if isinstance(e, WeightVersionServing | WeightUpdateFailed)]
    assert not [e for e in outcomes if isinstance(e, WeightUpdateFailed) and e.version == 1]
    assert any(isinstance(e, WeightVersionServing) and e.policy == "p0" and e.version == 1 for e in outcomes)
    assert a.proc.returncode == LeaseLost.exit_code, log_a[-3000:]
    assert "deposed: trainer trainer-a no longer holds the lease of policy p0" in log_a
    client.close()


def test_a_durable_leased_publish_waits_for_replicas_and_is_refused_once_the_lease_is_lost(
        redis_client: Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_BUS_WAIT_REPLICAS", "1")  # a lone server has none: every WAIT falls short
    monkeypatch.setenv("ROLLOUT_BUS_WAIT_TIMEOUT_MS", "20")
    monkeypatch.setenv("ROLLOUT_BUS_WAIT_DEGRADED_S", "0")  # no degraded wait: the error at once
    publisher = Publisher(redis_client, keys, Producer("trainer", "a"))
    fence = LeaseFence(keys.trainer_lease("p0"), "r0", "tok-a")
    until = time.time_ns() // 1_000_000 + 60_000
    redis_client.hset(fence.key, "r0", f"tok-a|{until}|host:1")
    event = WeightsPublished(producer=Producer("trainer", "a"), policy="p0", version=1, uri="/w", sha256="0" * 64)
    with pytest.raises(ReplicationTimeout):
        publisher.publish(keys.weight_stream("p0"), event, idempotency_key="weights.p0.1", durable=True, lease=fence)
    assert len(list(page(redis_client, keys.weight_stream("p0")))) == 1  # written once, whatever the retries
    redis_client.hset(fence.key, "r0", f"tok-b|{until}|host:2")
    with pytest.raises(LeaseLost):
        publisher.publish(keys.weight_stream("p0"), event, idempotency_key="weights.p0.2", durable=True, lease=fence)
    assert len(list(page(redis_client, keys.weight_stream("p0")))) == 1
