"""The timeline fold: state at any moment of a realistic run, from synthetic or published events.

``scenario`` and ``publish_scenario`` are shared with the verify, replay and status tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis

from rollout_bus.events import schema as s
from rollout_bus.events.names import Keys, stream_key
from rollout_bus.events.publish import Publisher
from rollout_bus.replay.logfile import LogEvent
from rollout_bus.replay.timeline import render, timeline, version_at

CTRL = s.Producer("controller", "c-0")
EXEC = s.Producer("executor", "x-0")
TRAIN = s.Producer("trainer", "t-0")
POLICY = "p0"
WEIGHTS = f"weights/{POLICY}"
"""The logical name of the policy's weight stream."""
BATCHES = f"batches/{POLICY}"

Step = tuple[str, s.Event]
MakeBatch = Callable[[str, str, int, int, int], s.BatchReady]


def batch_ready(batch_id: str, request_id: str, rollout_id: int, vmin: int, vmax: int) -> s.BatchReady:
    return s.BatchReady(producer=EXEC, policy=POLICY, batch_id=batch_id, rollout_id=rollout_id,
                        request_id=request_id, n_samples=4, min_weight_version=vmin, max_weight_version=vmax,
                        bytes=1024, payload={"store": "test", "ref": batch_id})


def rollout(rollout_id: int, vmin: int, vmax: int, make_batch: MakeBatch, attempts: int = 1) -> list[Step]:
    req, batch = f"req-{rollout_id}", f"batch-{rollout_id}"
    steps: list[Step] = [("rollouts", s.RolloutRequested(producer=TRAIN, policy=POLICY, rollout_id=rollout_id,
                                                         request_id=req, n_groups=2, n_samples_per_group=2))]
    steps += [("rollouts", s.RolloutStarted(producer=EXEC, policy=POLICY, rollout_id=rollout_id, request_id=req,
                                            executor="x-0", attempt=a)) for a in range(1, attempts + 1)]
    steps.append((BATCHES, make_batch(batch, req, rollout_id, vmin, vmax)))
    steps.append(("rollouts", s.RolloutCompleted(producer=EXEC, policy=POLICY, rollout_id=rollout_id,
                                                 request_id=req, batch_id=batch, n_samples=4, duration_ms=12.5)))
    return steps


def update(version: int, engines: tuple[str, ...] = ("e0", "e1")) -> list[Step]:
    steps: list[Step] = [
        (WEIGHTS, s.WeightsPublished(producer=TRAIN, policy=POLICY, version=version, uri=f"file:///w/{version}",
                                       sha256="ab" * 32)),
        (WEIGHTS, s.WeightUpdateStarted(producer=CTRL, policy=POLICY, version=version, engine_ids=list(engines)))]
    steps += [(WEIGHTS, s.WeightsApplied(producer=CTRL, policy=POLICY, version=version, engine_id=e,
                                           duration_ms=3.0)) for e in engines]
    steps.append((WEIGHTS, s.WeightVersionServing(producer=CTRL, policy=POLICY, version=version,
                                                    engine_ids=list(engines))))
    return steps


def consumed(rollout_id: int, staleness: int, step: int, version: int) -> list[Step]:
    return [("trainers", s.BatchConsumed(producer=TRAIN, policy=POLICY, batch_id=f"batch-{rollout_id}",
                                         trainer_id="t0", staleness=staleness, accepted=True)),
            ("trainers", s.TrainStepDone(producer=TRAIN, policy=POLICY, trainer_id="t0", step=step,
                                         weight_version=version, metrics={"loss": 0.5}))]


def scenario(make_batch: MakeBatch = batch_ready) -> list[Step]:
    """Two engines, three weight versions, four rollouts (one retried, one failed), a restart, an offload."""
    steps: list[Step] = []
    for e in ("e0", "e1"):
        steps.append(("engines", s.EngineLaunching(producer=CTRL, engine_id=e, url=f"http://h/{e}", backend="cpu")))
    for e in ("e0", "e1"):
        steps.append(("engines", s.EngineReady(producer=CTRL, engine_id=e, url=f"http://h/{e}")))
        steps.append(("engines", s.EngineServing(producer=CTRL, engine_id=e, url=f"http://h/{e}",
                                                 versions={POLICY: 0})))
    steps.append((WEIGHTS, s.WeightVersionServing(producer=CTRL, policy=POLICY, version=0,
                                                    engine_ids=["e0", "e1"])))
    steps.append(("trainers", s.TrainerJoined(producer=TRAIN, policy=POLICY, trainer_id="t0", group="trainer-p0")))
    steps += rollout(0, 0, 0, make_batch)
    steps += consumed(0, 0, 0, 0)
    steps += update(1)
    steps += rollout(1, 0, 1, make_batch, attempts=2)
    steps += [("engines", s.EngineUnhealthy(producer=CTRL, engine_id="e1", reason="timeout", failures=3)),
              ("engines", s.EngineRestarting(producer=CTRL, engine_id="e1", attempt=1)),
              ("engines", s.EngineLaunching(producer=CTRL, engine_id="e1", url="http://h/e1b", backend="cpu")),
              ("engines", s.EngineReady(producer=CTRL, engine_id="e1", url="http://h/e1b")),
              (WEIGHTS, s.WeightsApplied(producer=CTRL, policy=POLICY, version=1, engine_id="e1", duration_ms=2.0)),
              ("engines", s.EngineServing(producer=CTRL, engine_id="e1", url="http://h/e1b", versions={POLICY: 1}))]
    steps += consumed(1, 1, 1, 1)
    steps += update(2)
    steps += rollout(2, 1, 2, make_batch)
    steps += [("rollouts", s.RolloutRequested(producer=TRAIN, policy=POLICY, rollout_id=3, request_id="req-3",
                                              n_groups=2, n_samples_per_group=2)),
              ("rollouts", s.RolloutStarted(producer=EXEC, policy=POLICY, rollout_id=3, request_id="req-3",
                                            executor="x-0", attempt=3)),
              ("rollouts", s.RolloutFailed(producer=EXEC, policy=POLICY, rollout_id=3, request_id="req-3",
                                           reason="engines unavailable", attempts=3)),
              ("engines", s.EngineOffloaded(producer=CTRL, engine_id="e0", tags=["kv_cache"])),
              ("engines", s.EngineOnloaded(producer=CTRL, engine_id="e0", tags=["kv_cache"]))]
    return steps


def synthetic(steps: list[Step], start_ms: int = 1_000) -> list[LogEvent]:
    """The steps as a log with one entry per millisecond."""
    return [LogEvent(stream, f"{start_ms + i}-0", ev) for i, (stream, ev) in enumerate(steps)]


def publish_scenario(client: redis.Redis, keys: Keys, steps: list[Step],
                     publish_batch: Callable[[s.BatchReady], str] | None = None) -> list[str]:
    """Publish ``steps`` with the real Publisher (``BatchReady`` through ``publish_batch`` when given),
    each on its stream, one millisecond apart.

    Entry ids order a log across streams only to the millisecond (the sequence part counts
    per stream), so causally ordered events on different streams must not share one.
    """
    pubs: dict[str, Publisher] = {}
    ids: list[str] = []
    for stream, ev in steps:
        pub = pubs.setdefault(ev.producer.role, Publisher(client, keys, ev.producer))
        while ids and time.time_ns() // 1_000_000 <= int(ids[-1].split("-")[0]):
            time.sleep(0.0002)
        if publish_batch is not None and isinstance(ev, s.BatchReady):
            ids.append(publish_batch(ev))
        else:
            ids.append(pub.publish(stream_key(keys, stream), ev))
    return ids


def expected_final() -> dict[str, Any]:
    return {"engines": {"e0": ("serving", {POLICY: 2}), "e1": ("serving", {POLICY: 2})},
            "policy": (2, 2), "staleness": {"batch-0": 0, "batch-1": 1, "batch-2": 1}}


# --- tests ---------------------------------------------------------------------------------------

def test_the_end_state_has_every_engine_serving_the_last_version_and_each_batch_its_staleness() -> None:
    t = timeline(synthetic(scenario()))
    want = expected_final()
    assert {e: (v.state, v.versions) for e, v in t.engines.items()} == want["engines"]
    assert (t.policies[POLICY].published, t.policies[POLICY].serving) == want["policy"]
    assert {b: v.staleness for b, v in t.batches.items()} == want["staleness"]
    assert [t.batches[b].staleness_source for b in ("batch-0", "batch-1", "batch-2")] == [
        "consumed", "consumed", "serving"]
    assert t.engines["e1"].restarts == 1 and t.engines["e1"].url == "http://h/e1b"
    assert t.engines["e0"].offloaded_tags == []
    assert {r: v.state for r, v in t.requests.items()} == {
        "req-0": "completed", "req-1": "completed", "req-2": "completed", "req-3": "failed"}
    assert t.requests["req-1"].attempts == 2 and t.requests["req-3"].reason == "engines unavailable"
    tr = t.trainers["t0"]
    assert (tr.step, tr.weight_version, tr.consumed, tr.group) == (1, 1, 2, "trainer-p0")


def test_the_state_at_a_moment_ignores_everything_after_it() -> None:
    log = synthetic(scenario())
    published_1 = next(e for e in log if isinstance(e.event, s.WeightsPublished) and e.event.version == 1)
    t = timeline(log, at_ms=published_1.ms)
    assert t.policies[POLICY].published == 1 and t.policies[POLICY].serving == 0
    assert {e: v.versions for e, v in t.engines.items()} == {"e0": {POLICY: 0}, "e1": {POLICY: 0}}
    assert set(t.batches) == {"batch-0"} and t.last_id == published_1.id

    unhealthy = next(e for e in log if isinstance(e.event, s.EngineUnhealthy))
    mid = timeline(log, at_ms=unhealthy.ms)
    assert mid.engines["e1"].state == "unhealthy" and mid.engines["e0"].state == "serving"
    assert timeline(log, at_ms=0).events == 0


def test_each_engine_keeps_its_version_history_and_the_version_at_any_time() -> None:
    t = timeline(synthetic(scenario()))
    history = t.engines["e1"].version_history[POLICY]
    assert [v for _, v in history] == [0, 1, 1, 2]  # v1 again after its relaunch
    first_ms, second_ms = history[0][0], history[1][0]
    assert version_at(history, first_ms - 1) is None
    assert version_at(history, second_ms - 1) == 0 and version_at(history, second_ms) == 1
    assert [v for _, v in t.policies[POLICY].serving_history] == [0, 1, 2]


def test_an_offloaded_engine_returns_to_its_state_when_every_tag_is_back() -> None:
    steps: list[Step] = [
        ("engines", s.EngineServing(producer=CTRL, engine_id="e0", url="u", versions={POLICY: 0})),
        ("engines", s.EngineOffloaded(producer=CTRL, engine_id="e0", tags=["weights", "kv_cache"])),
        ("engines", s.EngineOnloaded(producer=CTRL, engine_id="e0", tags=["kv_cache"]))]
    t = timeline(synthetic(steps))
    assert (t.engines["e0"].state, t.engines["e0"].offloaded_tags) == ("offloaded", ["weights"])
    steps.append(("engines", s.EngineOnloaded(producer=CTRL, engine_id="e0", tags=["weights"])))
    assert timeline(synthetic(steps)).engines["e0"].state == "serving"


def test_the_timeline_of_a_published_run_matches_the_synthetic_one(fake_client: redis.Redis, keys: Keys) -> None:
    from rollout_bus.replay.exporter import read_live
    from rollout_bus.replay.logfile import decode_entries

    steps = scenario()
    publish_scenario(fake_client, keys, steps)
    live = timeline(decode_entries(read_live(fake_client, keys)))
    want = timeline(synthetic(steps))
    assert live.events == len(steps) and live.counts == want.counts
    assert {b: v.staleness for b, v in live.batches.items()} == expected_final()["staleness"]
    assert {e: v.versions for e, v in live.engines.items()} == {e: v.versions for e, v in want.engines.items()}


def test_the_rendered_timeline_names_engines_policies_and_batches() -> None:
    text = render(timeline(synthetic(scenario())), max_batches=2)
    assert "ENGINES" in text and "e1" in text and "p0=2" in text
    assert "3 batches, staleness mean 0.67 max 1; showing 2" in text
    assert "batch-0" not in text and "batch-2" in text
    assert "completed=3 failed=1" in text


def test_a_version_refused_as_a_whole_counts_for_the_policy_and_makes_no_engine() -> None:
    refused = (WEIGHTS, s.WeightUpdateFailed(producer=CTRL, policy=POLICY, version=9, engine_id="",
                                               reason="superseded by a newer version"))
    t = timeline(synthetic([*scenario(), refused]))
    assert "" not in t.engines and set(t.engines) == {"e0", "e1"}
    assert t.policies[POLICY].failed_updates >= 1
