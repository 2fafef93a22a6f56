"""verify: a clean run passes; each planted violation is named with its ids and entries."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import redis

from rollout_bus.events import schema as s
from rollout_bus.events.names import Keys, stream_key
from rollout_bus.replay.exporter import export_log, read_live
from rollout_bus.replay.logfile import LogEvent, LogReader
from rollout_bus.replay.verify import VerifyConfig, Violation, verify, verify_log
from tests.unit.test_timeline import (
    CTRL,
    EXEC,
    POLICY,
    TRAIN,
    WEIGHTS,
    Step,
    batch_ready,
    publish_scenario,
    scenario,
    synthetic,
)


def kinds(found: list[Violation]) -> list[str]:
    return sorted(v.kind for v in found)


def test_a_clean_run_has_no_violations() -> None:
    assert verify(synthetic(scenario())) == []


def test_strict_mode_flags_the_unpublished_launch_version() -> None:
    found = verify(synthetic(scenario()), VerifyConfig(base_version=None))
    assert found and {v.kind for v in found} == {"version_not_published"}
    assert all(v.ids["version"] == 0 for v in found)


def test_an_engine_serving_a_version_never_published_is_named() -> None:
    steps = scenario()
    steps.append(("engines", s.EngineServing(producer=CTRL, engine_id="e0", url="u", versions={POLICY: 7})))
    log = synthetic(steps)
    (v,) = verify(log)
    assert v.kind == "version_not_published"
    assert v.ids == {"policy": POLICY, "version": 7, "engine_id": "e0"}
    assert v.entries == [f"engines@{log[-1].id}"]
    assert "engine e0 served version 7" in str(v)


def test_an_engine_serving_a_published_version_it_never_received_is_named() -> None:
    steps = scenario()
    steps += [(WEIGHTS, s.WeightsPublished(producer=TRAIN, policy=POLICY, version=3, uri="u", sha256="x")),
              (WEIGHTS, s.WeightsApplied(producer=CTRL, policy=POLICY, version=3, engine_id="e0", duration_ms=1)),
              ("engines", s.EngineServing(producer=CTRL, engine_id="e1", url="u", versions={POLICY: 3}))]
    (v,) = verify(synthetic(steps))
    assert (v.kind, v.ids) == ("version_not_received", {"engine_id": "e1", "policy": POLICY, "version": 3})


def test_a_relaunched_engine_must_receive_the_weights_again_before_serving_them() -> None:
    steps = scenario()
    steps += [("engines", s.EngineLaunching(producer=CTRL, engine_id="e0", url="u", backend="cpu")),
              ("engines", s.EngineReady(producer=CTRL, engine_id="e0", url="u")),
              ("engines", s.EngineServing(producer=CTRL, engine_id="e0", url="u", versions={POLICY: 2}))]
    (v,) = verify(synthetic(steps))
    assert (v.kind, v.ids) == ("version_not_received", {"engine_id": "e0", "policy": POLICY, "version": 2})
    steps.insert(-1, (WEIGHTS, s.WeightsApplied(producer=CTRL, policy=POLICY, version=2, engine_id="e0",
                                                  duration_ms=1)))
    assert verify(synthetic(steps)) == []


def test_a_request_with_two_batches_is_named_with_both_entries() -> None:
    steps = scenario()
    at = next(i for i, (_, ev) in enumerate(steps) if isinstance(ev, s.BatchReady) and ev.batch_id == "batch-1")
    steps.insert(at + 1, ("batches/p0", batch_ready("batch-1-retry", "req-1", 1, 1, 1)))
    log = synthetic(steps)
    (v,) = verify(log)
    assert v.kind == "duplicate_batch"
    assert v.ids == {"request_id": "req-1", "batch_ids": ["batch-1", "batch-1-retry"]}
    assert v.entries == [f"batches/p0@{log[at].id}", f"batches/p0@{log[at + 1].id}"]


def test_versions_going_backwards_are_named_per_policy_and_per_engine() -> None:
    steps = scenario()
    steps += [(WEIGHTS, s.WeightsPublished(producer=TRAIN, policy=POLICY, version=1, uri="u", sha256="x")),
              (WEIGHTS, s.WeightsApplied(producer=CTRL, policy=POLICY, version=1, engine_id="e0", duration_ms=1)),
              (WEIGHTS, s.WeightVersionServing(producer=CTRL, policy=POLICY, version=1, engine_ids=["e0"]))]
    found = verify(synthetic(steps))
    assert kinds(found) == ["version_backwards"] * 3
    by_what = {tuple(sorted(v.ids.items())): v for v in found}
    assert (("engine_id", "e0"), ("policy", POLICY), ("previous", 2), ("version", 1)) in by_what
    assert all(len(v.entries) == 2 for v in found)  # the earlier higher version and the lower one


def test_a_completed_request_without_its_batch_or_naming_another_is_named() -> None:
    steps: list[Step] = scenario()
    steps.append(("rollouts", s.RolloutCompleted(producer=EXEC, policy=POLICY, rollout_id=9, request_id="req-9",
                                                 batch_id="batch-9", n_samples=4, duration_ms=1.0)))
    steps.append(("batches/p0", batch_ready("batch-x", "req-8", 8, 2, 2)))
    steps.append(("rollouts", s.RolloutCompleted(producer=EXEC, policy=POLICY, rollout_id=8, request_id="req-8",
                                                 batch_id="batch-8", n_samples=4, duration_ms=1.0)))
    found = verify(synthetic(steps))
    assert kinds(found) == ["batch_mismatch", "missing_batch"]
    assert {v.kind: v.ids["request_id"] for v in found} == {"missing_batch": "req-9", "batch_mismatch": "req-8"}


def test_samples_of_an_unpublished_version_are_named() -> None:
    steps = scenario()
    steps.append(("batches/p0", batch_ready("batch-7", "req-7", 7, 2, 5)))
    (v,) = verify(synthetic(steps))
    assert v.kind == "version_not_published" and v.ids["batch_id"] == "batch-7" and v.ids["version"] == 5


def test_several_planted_violations_are_all_reported() -> None:
    steps = scenario()
    steps += [("engines", s.EngineServing(producer=CTRL, engine_id="e0", url="u", versions={POLICY: 7})),
              ("batches/p0", batch_ready("batch-0-dup", "req-0", 0, 0, 0)),
              (WEIGHTS, s.WeightsPublished(producer=TRAIN, policy=POLICY, version=1, uri="u", sha256="x"))]
    assert kinds(verify(synthetic(steps))) == ["duplicate_batch", "version_backwards", "version_not_published"]


def numbered(steps: list[Step]) -> list[Step]:
    """The steps with the numbers the bus gives out as it appends them: per producer, from 1."""
    counters: dict[s.Producer, int] = {}
    out: list[Step] = []
    for stream, ev in steps:
        counters[ev.producer] = counters.get(ev.producer, 0) + 1
        out.append((stream, dataclasses.replace(ev, seq=counters[ev.producer])))
    return out


def test_a_log_missing_a_rollout_started_and_a_batch_consumed_names_both_producers_gaps() -> None:
    steps = numbered(scenario())
    assert verify(synthetic(steps)) == []
    started = next(i for i, (_, ev) in enumerate(steps) if isinstance(ev, s.RolloutStarted))
    consumed_at = next(i for i, (_, ev) in enumerate(steps) if isinstance(ev, s.BatchConsumed))
    lost = {str(steps[started][1].producer): steps[started][1].seq, str(steps[consumed_at][1].producer):
            steps[consumed_at][1].seq}
    log = synthetic(steps)
    del log[consumed_at], log[started]
    found = verify(log)
    assert kinds(found) == ["seq_gap", "seq_gap"]
    assert {v.ids["producer"]: v.ids["missing"] for v in found} == {p: [n] for p, n in lost.items()}
    assert all(v.ids["lost"] == 1 and v.entries for v in found)  # the entries beside each gap


def test_a_log_with_a_train_step_done_twice_names_the_repeat() -> None:
    log = synthetic(numbered(scenario()))
    at = next(i for i, item in enumerate(log) if isinstance(item.event, s.TrainStepDone))
    log.insert(at + 1, s_log_event(log[at], ms=log[at].ms))  # the same event appended again
    (v,) = verify(log)
    assert v.kind == "seq_repeat" and v.ids["type"] == "TrainStepDone"
    assert v.entries == [f"trainers@{log[at].id}", f"trainers@{log[at + 1].id}"]


def s_log_event(item: LogEvent, ms: int) -> LogEvent:
    return LogEvent(item.stream, f"{ms}-1", item.event)


def test_gaps_are_counted_from_the_first_number_of_a_time_range_and_not_at_all_in_a_trimmed_log() -> None:
    log = synthetic(numbered(scenario()))
    tail = log[len(log) // 2:]
    gaps = [v for v in verify(tail) if v.kind == "seq_gap"]
    assert len(gaps) == len({str(i.event.producer) for i in tail})
    assert not [v for v in verify(tail, VerifyConfig(from_start=False)) if v.kind.startswith("seq")]
    trimmed = [*log[:3], *log[5:]]
    assert kinds(verify(trimmed)) == ["seq_gap"]
    housekeeping = LogEvent("housekeeping", "99999-0",
                            s.StreamsTrimmed(producer=s.Producer("controller", "janitor"), entries={"engines": 2}, seq=1))
    assert verify([*trimmed, housekeeping]) == []


def test_events_published_through_the_bus_and_exported_verify_with_no_gaps_and_no_repeats(
        fake_client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    publish_scenario(fake_client, keys, scenario())
    path = tmp_path / "run.rblog"
    export_log(fake_client, keys, path)
    assert verify_log(path) == []
    with LogReader(path) as reader:
        numbers = [e.event.seq for e in reader.events()]
    assert all(n > 0 for n in numbers)
    started = next(e for e in read_live(fake_client, keys) if isinstance(s.decode(e.fields), s.RolloutStarted))
    fake_client.xdel(stream_key(keys, started.stream), started.id)
    export_log(fake_client, keys, path)
    (v,) = verify_log(path)
    assert v.kind == "seq_gap" and v.ids["producer"] == str(EXEC)


def test_a_number_near_two_to_the_sixty_four_is_a_gap_counted_without_listing_it() -> None:
    """Any role may set a producer's counter (one ACL grant covers every publisher's): a huge number is a
    reported gap, found from the numbers seen, not from a list of the range they span."""
    steps = numbered(scenario())
    stream, last = steps[-1]
    huge = 2**63
    steps.append((stream, dataclasses.replace(last, event_id="f" * 32, seq=huge)))
    found = [v for v in verify(synthetic(steps)) if v.kind == "seq_gap"]
    assert len(found) == 1 and found[0].ids["last"] == huge
    assert found[0].ids["lost"] == huge - last.seq - 1 and len(found[0].ids["missing"]) <= 20
