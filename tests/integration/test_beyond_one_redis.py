"""Beyond one Redis: one policy over three independent Redis primaries, one of them killed mid-run.

The test starts three redis-servers itself and gives them to the main job as three shards
(``--redis-url A,B,C``): each gets its own controller, engine and executor, and the one trainer spreads
its requests over all three. First every request must be served exactly once and every shard must take
requests and serve the trained versions. Then, with a request of the trainer in flight on shard 2 (its
``RolloutRequested`` there, no ``BatchReady`` yet), shard 2's redis-server is SIGKILLed; the kill is shown
to have landed before anything else is asserted. The run must go on with shards 0 and 1 to its last
step; the requests in flight on shard 2 must be resubmitted and served there; no rollout may be trained
twice, and no request served twice on the shards left.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rollout_bus.events.connection import connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.registry import Registry
from rollout_bus.events.schema import BatchConsumed, BatchReady, RolloutRequested, WeightsPublished, decode
from rollout_bus.launch.config import RunConfig
from rollout_bus.launch.job import RunHandle, run_job
from rollout_bus.trainer.checkpoint import CheckpointStore
from tests.support.fake_rollouts import shared_init_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 18
POLICY = "p0"


@pytest.fixture()
def shards() -> Iterator[list[RedisServer]]:
    servers = [RedisServer().start() for _ in range(3)]
    yield servers
    for server in servers:
        server.stop()


def events_of(url: str, stream: str) -> list:
    client = connect(url)
    try:
        return [decode(fields) for _, fields in client.xrange(stream)]
    finally:
        client.close()


def served(url: str, keys: Keys) -> Counter[str]:
    """BatchReady events per request id on one shard."""
    return Counter(e.request_id for e in events_of(url, keys.batch_stream(POLICY)) if isinstance(e, BatchReady))


def requested(url: str, keys: Keys) -> list[str]:
    return [e.request_id for e in events_of(url, keys.rollout_stream)
            if isinstance(e, RolloutRequested) and not e.eval]


@dataclass
class Killer:
    """Kills shard 2's redis-server once it trained a batch from there and holds a request there in flight."""

    server: RedisServer
    keys: Keys
    in_flight: list[str] = field(default_factory=list)
    trained_before: int = 0
    landed: str = ""
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def start(self, handle: RunHandle) -> None:
        self.thread = threading.Thread(target=self._run, name="shard-killer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            client = connect(self.server.url)
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                consumed = [e for _, f in client.xrange(self.keys.trainer_stream)
                            if isinstance(e := decode(f), BatchConsumed) and e.accepted]
                asked = [decode(f) for _, f in client.xrange(self.keys.rollout_stream)]
                done = {decode(f).request_id for _, f in client.xrange(self.keys.batch_stream(POLICY))}
                waiting = [e.request_id for e in asked
                           if isinstance(e, RolloutRequested) and not e.eval and e.request_id not in done]
                if consumed and waiting:
                    self.trained_before, self.in_flight = len(consumed), waiting
                    pid = self.server.proc.pid
                    os.kill(pid, signal.SIGKILL)
                    status = self.server.proc.wait(10)
                    self.landed = f"redis-server pid {pid} exited with {status}"
                    return
                time.sleep(0.02)
            raise AssertionError("shard 2 never held a request in flight after a trained batch")
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            self.error = exc


def test_one_policy_over_three_redis_primaries_survives_losing_one(shards: list[RedisServer], tmp_path: Path) -> None:
    keys = Keys("shards")
    killer = Killer(shards[2], keys)
    config = RunConfig(mode="async", steps=STEPS, seed=0, out=str(tmp_path / "out"),
                       redis_url=",".join(s.url for s in shards), namespace=keys.namespace,
                       init_dir=str(shared_init_dir()), progress=False, plot=False, timeout_s=360.0,
                       n_groups=4, n_samples=4, in_flight=3, max_staleness=2, token_delay_ms=15.0)
    result = run_job(config, on_start=killer.start)
    assert killer.thread is not None
    killer.thread.join(5)
    assert killer.error is None, killer.error

    # the fault happened: shard 2's server died of SIGKILL with requests of the trainer waiting there
    assert killer.landed.endswith(f"exited with {-signal.SIGKILL}"), killer.landed
    assert killer.trained_before >= 1 and killer.in_flight, (killer.trained_before, killer.in_flight)
    trainer_log = (tmp_path / "out" / "logs" / f"trainer-{POLICY}.log").read_text()
    assert "Redis shard 2" in trainer_log and "lost" in trainer_log, trainer_log[-3000:]
    run_log = (tmp_path / "out" / "logs")
    assert (run_log / "shard-2").is_dir() and (run_log / "shard-1").is_dir()

    # the run went on to its last step
    summary = result.summaries[POLICY]
    assert summary["steps"] == STEPS
    assert result.faults["unread_shards"] == [2]  # the fault counts say which shard they could not read
    assert "shard(s) 2 not read: lost" in result.text, result.text

    # every shard took requests before the kill; the ones left served each request exactly once
    live = [served(s.url, keys) for s in shards[:2]]
    for counts in live:
        assert counts, "a live shard served no request"
        assert max(counts.values()) == 1, counts
    both = set(live[0]) & set(live[1])
    assert not both, f"requests served on two shards: {both}"

    # shard 2's requests in flight were resubmitted and served on a live shard, exactly once
    for request_id in killer.in_flight:
        assert f"{request_id} -> shard" in trainer_log, (request_id, trainer_log[-3000:])
        assert sum(counts[request_id] for counts in live) == 1, request_id
        asked_again = [r for s in shards[:2] for r in requested(s.url, keys) if r == request_id]
        assert len(asked_again) == 1, (request_id, asked_again)

    # nothing counted twice: each trained batch (the checkpoint's list) is a different rollout
    state = CheckpointStore(tmp_path / "out" / "checkpoints" / POLICY).load()
    assert state is not None
    rollouts = [int(m.group(1)) for _, batch_id in state.state.trained
                if (m := re.search(r"-r(\d+)(?:-a\d+)?$", batch_id)) is not None]
    assert len(rollouts) == len(state.state.trained) >= STEPS // 2, state.state.trained
    assert len(rollouts) == len(set(rollouts)), Counter(rollouts).most_common(3)

    # weight versions reached every shard left: each was told of the trainer's last version, and serves versions
    for server in shards[:2]:
        announced = [e.version for e in events_of(server.url, keys.weight_stream(POLICY))
                     if isinstance(e, WeightsPublished)]
        assert summary["version"] in announced, (server.url, announced[-5:])
        client = connect(server.url)
        try:
            record = Registry(client, keys).policy(POLICY)
        finally:
            client.close()
        assert record is not None and record.serving >= 1, (server.url, record)
