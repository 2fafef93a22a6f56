"""Two policies trained at once on one engine pool, and a recorder beside the first: each consumer
group gets exactly its own batches, each policy its own weight versions."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_bus.events.connection import connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.schema import BatchConsumed, BatchReady, WeightsPublished, decode
from rollout_bus.launch.config import RunConfig
from rollout_bus.launch.job import run_job
from rollout_bus.trainer.checkpoint import CheckpointStore
from rollout_bus.trainer.recorder import read_recording
from tests.support.fake_rollouts import shared_init_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 6


def test_two_trainers_and_a_recorder_each_get_exactly_their_own_batches(tmp_path: Path, redis_server: RedisServer,
                                                                        keys: Keys) -> None:
    result = run_job(RunConfig(mode="async", trainers=2, steps=STEPS, seed=1, out=str(tmp_path / "out"),
                               redis_url=redis_server.url, namespace=keys.namespace, recorder=True,
                               init_dir=str(shared_init_dir()), progress=False, plot=False, timeout_s=240.0))
    client = connect(redis_server.url)
    streams = {p: [decode(f) for _, f in page(client, keys.batch_stream(p))] for p in ("p0", "p1")}
    produced = {p: {e.batch_id for e in evs if isinstance(e, BatchReady)} for p, evs in streams.items()}
    assert produced["p0"] and produced["p1"] and not produced["p0"] & produced["p1"]
    for p in ("p0", "p1"):
        assert all(e.policy == p for e in streams[p])
        assert all(e.request_id.startswith(f"trainer-{p}-") for e in streams[p] if isinstance(e, BatchReady))
        trained = [b for _, b in CheckpointStore(result.out / "checkpoints" / p).load().state.trained]  # type: ignore[union-attr]
        assert len(trained) == STEPS and set(trained) <= produced[p]
        assert result.summaries[p]["steps"] == STEPS
    trainer_events = [decode(f) for _, f in page(client, keys.trainer_stream)]
    for c in trainer_events:
        if isinstance(c, BatchConsumed):
            assert c.batch_id in produced[c.policy] and c.trainer_id == f"trainer-{c.policy}"
    # the recorder read every p0 batch in its own group, none of p1, and took nothing from the trainer
    recorded = [event["batch_id"] for event, _ in read_recording(result.out / "recording")]
    assert sorted(recorded) == sorted(produced["p0"])
    groups = {g["name"].decode(): g for g in client.xinfo_groups(keys.batch_stream("p0"))}
    assert set(groups) == {"trainer-p0", "recorder"} and groups["recorder"]["pending"] == 0
    # each policy has its own line of weight versions
    published = [decode(f) for p in ("p0", "p1") for _, f in page(client, keys.weight_stream(p))]
    for p in ("p0", "p1"):
        versions = sorted({e.version for e in published if isinstance(e, WeightsPublished) and e.policy == p})
        assert versions[-STEPS:] == list(range(1, STEPS + 1))
    client.close()
