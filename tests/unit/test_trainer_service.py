"""The trainer's modes, staleness budget and resume, against a fake rollout service on fakeredis."""

from __future__ import annotations

from pathlib import Path

import fakeredis
import pytest

from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.schema import BatchConsumed, TrainStepDone, decode
from rollout_bus.lm.model import ModelConfig, build_model, save_weights
from rollout_bus.trainer.checkpoint import CheckpointStore
from rollout_bus.trainer.config import PublishConfig, RolloutConfig, ScheduleConfig, TrainerConfig
from rollout_bus.trainer.service import Trainer
from tests.support.fake_rollouts import FakeRollouts


@pytest.fixture()
def model_path(tmp_path: Path) -> str:
    model = build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=32), seed=0)
    save_weights(model, tmp_path / "init")
    return str(tmp_path / "init")


def make_config(tmp_path: Path, model_path: str, keys: Keys, mode: str, steps: int, **schedule: object) -> TrainerConfig:
    return TrainerConfig(
        policy="default", trainer_id="t0", namespace=keys.namespace, steps=steps, model_path=model_path,
        checkpoint_dir=str(tmp_path / "ckpt"), get_timeout_s=20.0,
        rollout=RolloutConfig(n_groups=2, n_samples_per_group=2, timeout_s=5.0),
        schedule=ScheduleConfig(mode=mode, **schedule),  # type: ignore[arg-type]
        publish=PublishConfig(weights_root=str(tmp_path / "weights"), serving_timeout_s=5.0))


def events_of(client: fakeredis.FakeRedis, stream: str, cls: type) -> list:
    out = []
    for _, fields in page(client, stream):
        event = decode(fields)
        if isinstance(event, cls):
            out.append(event)
    return out


def run_trainer(client: fakeredis.FakeRedis, config: TrainerConfig, keys: Keys) -> Trainer:
    trainer = Trainer(config, client, keys)
    trainer.start()
    trainer.run()
    trainer.stop()
    return trainer


def test_sync_mode_trains_every_batch_on_policy(tmp_path: Path, model_path: str, keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    with FakeRollouts(client, keys) as fake:
        trainer = run_trainer(client, make_config(tmp_path, model_path, keys, "sync", 4), keys)
    state = trainer.state
    assert state is not None and state.step == 4 and state.version == 4
    assert [b for _, b in state.trained] == fake.batches
    steps = events_of(client, keys.trainer_stream, TrainStepDone)
    assert [s.step for s in steps] == [1, 2, 3, 4]
    assert all(s.metrics["staleness_max"] == 0 for s in steps)
    assert all(s.metrics["serving_wait_ms"] >= 0 for s in steps)
    assert len(fake.requests) == 4


def test_one_step_ahead_trains_each_later_batch_exactly_one_version_stale(tmp_path: Path, model_path: str,
                                                                        keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    with FakeRollouts(client, keys):
        trainer = run_trainer(client, make_config(tmp_path, model_path, keys, "one-step", 5), keys)
    steps = events_of(client, keys.trainer_stream, TrainStepDone)
    assert [int(s.metrics["staleness_max"]) for s in steps] == [0, 1, 1, 1, 1]
    assert trainer.state is not None and not trainer.state.in_flight


def test_async_mode_never_trains_beyond_the_staleness_budget(tmp_path: Path, model_path: str, keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    # every third rollout comes from weights three versions old: over a budget of 1
    lagged = FakeRollouts(client, keys, version_of=lambda rid, serving: max(0, serving - (3 if rid % 3 == 2 else 0)))
    with lagged:
        config = make_config(tmp_path, model_path, keys, "async", 8, in_flight=2, max_staleness=1)
        trainer = run_trainer(client, config, keys)
    state = trainer.state
    assert state is not None and state.step == 8
    steps = events_of(client, keys.trainer_stream, TrainStepDone)
    assert all(s.metrics["staleness_max"] <= 1 for s in steps)
    assert max(state.staleness_hist) <= 1
    consumed = events_of(client, keys.trainer_stream, BatchConsumed)
    dropped = [c for c in consumed if not c.accepted and not c.reason.startswith("no signal")]
    assert dropped and all(c.staleness > 1 for c in dropped)  # besides batches without signal, only stale ones
    assert state.counters["stale_groups"] >= 2
    assert {c.batch_id for c in consumed if c.accepted} == {b for _, b in state.trained}


def test_stale_prompts_travel_back_to_the_data_source_with_the_next_request(tmp_path: Path, model_path: str,
                                                                           keys: Keys) -> None:
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from rollout_bus.events.schema import RolloutRequested

    client = fakeredis.FakeRedis()
    lagged = FakeRollouts(client, keys, version_of=lambda rid, serving: max(0, serving - (5 if rid == 2 else 0)))
    with lagged:
        config = make_config(tmp_path, model_path, keys, "async", 4, in_flight=1, max_staleness=1,
                             stale_policy="requeue")
        trainer = run_trainer(client, config, keys)
    assert trainer.state is not None and trainer.state.counters["requeued_groups"] == 2
    requested = [e for e in (decode(f) for _, f in page(client, keys.rollout_stream))
                 if isinstance(e, RolloutRequested)]
    bodies = {e.rollout_id: Job.fetch(e.request_id, connection=client, serializer=JSONSerializer).kwargs["request"]
              for e in requested}
    carrying = {rid: body["returned"] for rid, body in bodies.items() if body["returned"]}
    assert list(carrying) and min(carrying) > 2  # a request after rollout 2's batch carries them, once
    returned = [item for items in carrying.values() for item in items]
    assert sorted(item["index"] for item in returned) == [4, 5]  # rollout 2's groups (2 per rollout)
    assert all(item["prompt_ids"][0] == 1 for item in returned)  # BOS first: the prompt, not the response
    assert trainer.state.returned == []


def test_a_restarted_trainer_skips_and_acks_what_its_checkpoint_holds(tmp_path: Path, model_path: str,
                                                                      keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
    client = fakeredis.FakeRedis()
    config = make_config(tmp_path, model_path, keys, "sync", 3)
    with FakeRollouts(client, keys) as fake:
        first = Trainer(config, client, keys)
        first.start()
        # the crash window: the checkpoint of step 2 is written, its batch is never acked
        original_ack = first._cl().ack
        calls = {"n": 0}

        def ack_then_crash(batch, **kw):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt("killed between checkpoint and ack")
            original_ack(batch, **kw)
        monkeypatch.setattr(first._cl(), "ack", ack_then_crash)
        with pytest.raises(KeyboardInterrupt):
            first.run()
        saved = CheckpointStore(config.checkpoint_dir).load()
        assert saved is not None and saved.state.step == 2
        pending = client.xpending(keys.batch_stream("default"), "t0")
        assert pending["pending"] == 1
        second = Trainer(config, client, keys)
        second.start()
        second.run()
        second.stop()
    state = second.state
    assert state is not None and state.step == 3
    trained = [b for _, b in state.trained]
    assert trained == fake.batches[:3] and len(set(trained)) == 3
    assert state.counters["skipped_already_trained"] == 1
    assert client.xpending(keys.batch_stream("default"), "t0")["pending"] == 0
    consumed = events_of(client, keys.trainer_stream, BatchConsumed)
    assert sorted(c.batch_id for c in consumed if c.accepted) == sorted(trained)
    # step 2's announcement was lost with the crash: the restart makes it, once
    assert [s.step for s in events_of(client, keys.trainer_stream, TrainStepDone)] == [1, 2, 3]


def test_a_lost_rollout_is_asked_for_again_under_a_new_request_id(tmp_path: Path, model_path: str,
                                                                  keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    config = make_config(tmp_path, model_path, keys, "sync", 2)
    config.rollout.timeout_s = 0.5
    with FakeRollouts(client, keys, drop_requests={1}) as fake:
        trainer = run_trainer(client, config, keys)
    assert trainer.state is not None and trainer.state.counters["rollouts_reasked"] == 1
    assert [r.request_id.endswith("-a2") for r in fake.requests] == [False, True]
