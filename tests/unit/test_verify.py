"""verify: a clean run passes; each planted violation is named with its ids and entries."""

from __future__ import annotations

from rollout_bus.events import schema as s
from rollout_bus.replay.verify import VerifyConfig, Violation, verify
from tests.unit.test_timeline import CTRL, EXEC, POLICY, TRAIN, Step, batch_ready, scenario, synthetic


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
    steps += [("weights", s.WeightsPublished(producer=TRAIN, policy=POLICY, version=3, uri="u", sha256="x")),
              ("weights", s.WeightsApplied(producer=CTRL, policy=POLICY, version=3, engine_id="e0", duration_ms=1)),
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
    steps.insert(-1, ("weights", s.WeightsApplied(producer=CTRL, policy=POLICY, version=2, engine_id="e0",
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
    steps += [("weights", s.WeightsPublished(producer=TRAIN, policy=POLICY, version=1, uri="u", sha256="x")),
              ("weights", s.WeightsApplied(producer=CTRL, policy=POLICY, version=1, engine_id="e0", duration_ms=1)),
              ("weights", s.WeightVersionServing(producer=CTRL, policy=POLICY, version=1, engine_ids=["e0"]))]
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
              ("weights", s.WeightsPublished(producer=TRAIN, policy=POLICY, version=1, uri="u", sha256="x"))]
    assert kinds(verify(synthetic(steps))) == ["duplicate_batch", "version_backwards", "version_not_published"]
