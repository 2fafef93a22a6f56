"""Offline retraining from a log file: stream order, the same ids and bit-identical weights every time."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rollout_bus import cli as rollout_bus_cli
from rollout_bus.events import schema as s
from rollout_bus.events.batch import encode
from rollout_bus.lm.model import ModelConfig, build_model, load_model, save_weights
from rollout_bus.replay.feed import trained_batch_ids
from rollout_bus.replay.logfile import Header, LogEntry, LogWriter, Payload, StreamRange
from rollout_bus.replay.offline import (
    BATCH_IDS_FILE,
    RESULT_FILE,
    OfflineConfig,
    run_offline,
    weights_sha256,
    write_outputs,
)
from rollout_bus.trainer.config import ConfigError, OptimConfig
from tests.support.fake_rollouts import fake_batch

EXEC = s.Producer("executor", "x-0")
TRAIN = s.Producer("trainer", "t-0")

# (policy, rollout id, weight version of its samples); the log interleaves two policies
BATCHES = [("p0", 0, 0), ("p1", 0, 0), ("p0", 1, 0), ("p0", 2, 1), ("p1", 1, 0), ("p0", 3, 0), ("p0", 4, 3)]


def batch_id(policy: str, rollout_id: int) -> str:
    return f"batch-{policy}-r{rollout_id}"


def write_log(path: Path, *, missing: tuple[str, ...] = (), consumed: dict[str, bool] | None = None) -> Path:
    """A log of ``BATCHES`` (payloads included, but for ``missing``) and ``BatchConsumed`` events."""
    streams = sorted({f"batches/{p}" for p, _, _ in BATCHES}) + ["trainers"]
    with path.open("wb") as fh:
        writer = LogWriter(fh, Header("offline-test", 0, [StreamRange(st) for st in streams]))
        for ms, (policy, rid, version) in enumerate(BATCHES, start=1000):
            data = fake_batch(2, 3, rollout_id=rid, version=version, rng=random.Random(rid * 7 + len(policy)))
            fields, meta = data.to_tensors()
            encoded = encode(fields, meta).tobytes()
            bid = batch_id(policy, rid)
            event = s.BatchReady(producer=EXEC, policy=policy, batch_id=bid, rollout_id=rid, request_id=f"req-{bid}",
                                 n_samples=len(data), min_weight_version=version, max_weight_version=version,
                                 bytes=len(encoded), payload={"store": "redis", "ref": f"{policy}:{bid}"})
            entry = LogEntry(f"batches/{policy}", f"{ms}-0", s.encode(event))  # type: ignore[arg-type]
            if bid not in missing:
                writer.payload(Payload(entry.stream, entry.id, bid, event.payload, encoded))
            writer.entry(entry)
        for n, (bid, accepted) in enumerate((consumed or {}).items()):
            ev = s.BatchConsumed(producer=TRAIN, policy=bid.split("-")[1], batch_id=bid, trainer_id="t0",
                                 staleness=0, accepted=accepted)
            writer.entry(LogEntry("trainers", f"{2000 + n}-0", s.encode(ev)))  # type: ignore[arg-type]
        writer.close()
    return path


@pytest.fixture()
def init(tmp_path: Path) -> Path:
    model = build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=32), seed=0)
    directory = tmp_path / "init"
    save_weights(model, directory)
    return directory


def config(log: Path, init: Path, **overrides: object) -> OfflineConfig:
    settings: dict[str, object] = {"policy": "p0", "optim": OptimConfig(lr=1e-2), **overrides}
    return OfflineConfig(log=str(log), model_path=str(init), **settings)  # type: ignore[arg-type]


def p0_ids() -> list[str]:
    return [batch_id(p, r) for p, r, _ in BATCHES if p == "p0"]


def test_two_runs_train_the_same_batches_in_stream_order_to_identical_weights(tmp_path: Path, init: Path) -> None:
    log = write_log(tmp_path / "run.rblog")
    first, model = run_offline(config(log, init))
    second, _ = run_offline(config(log, init))
    assert first.batch_ids == second.batch_ids == p0_ids()
    assert first.weights_sha256 == second.weights_sha256 == weights_sha256(model)
    assert first.weights_sha256 != weights_sha256(load_model(init))
    assert [st.step for st in first.steps] == [1, 2, 3, 4, 5] and first.version == 5
    assert [st.entry_id for st in first.steps] == sorted(st.entry_id for st in first.steps)
    assert first.final_metrics["steps"] == 5.0 and first.final_metrics["samples"] == 30.0
    assert {k: v for k, v in first.final_metrics.items() if k != "train_ms"} == {
        k: v for k, v in second.final_metrics.items() if k != "train_ms"}


def test_a_different_seed_with_several_minibatches_gives_other_weights(tmp_path: Path, init: Path) -> None:
    log = write_log(tmp_path / "run.rblog")
    optim = OptimConfig(lr=1e-2, minibatches=2)
    a, _ = run_offline(config(log, init, seed=1, optim=optim))
    b, _ = run_offline(config(log, init, seed=1, optim=optim))
    c, _ = run_offline(config(log, init, seed=2, optim=optim))
    assert a.weights_sha256 == b.weights_sha256 != c.weights_sha256
    assert a.batch_ids == c.batch_ids


def test_steps_staleness_budget_and_trained_only_choose_the_batches(tmp_path: Path, init: Path) -> None:
    log = write_log(tmp_path / "run.rblog", missing=(batch_id("p0", 1),),
                    consumed={batch_id("p0", 0): True, batch_id("p0", 3): True, batch_id("p0", 2): False,
                              batch_id("p1", 0): True})
    every, _ = run_offline(config(log, init))
    assert every.batch_ids == [batch_id("p0", r) for r in (0, 2, 3, 4)]  # r1's payload is not in the log
    two, _ = run_offline(config(log, init, steps=2))
    assert two.batch_ids == every.batch_ids[:2] and two.version == 2
    assert two.steps[1].metrics["loss"] == every.steps[1].metrics["loss"]
    # versions 0,1,2,3 as the trainer goes: r3's samples (v0) are 2 behind at version 2, r4's (v3) fresh
    budget, _ = run_offline(config(log, init, max_staleness=1))
    assert budget.batch_ids == [batch_id("p0", r) for r in (0, 2, 4)] and budget.skipped == [batch_id("p0", 3)]
    assert trained_batch_ids(log, policy="p0") == [batch_id("p0", 0), batch_id("p0", 3)]
    trained, _ = run_offline(config(log, init, trained_only=True))
    assert trained.batch_ids == [batch_id("p0", 0), batch_id("p0", 3)]
    everything, _ = run_offline(config(log, init, policy=None))
    assert everything.batch_ids == [batch_id(p, r) for p, r, _ in BATCHES if batch_id(p, r) != batch_id("p0", 1)]


def test_outputs_and_the_cli(tmp_path: Path, init: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = write_log(tmp_path / "run.rblog")
    result, model = run_offline(config(log, init, steps=3))
    out = write_outputs(result, model, tmp_path / "out")
    assert (out / BATCH_IDS_FILE).read_text().splitlines() == result.batch_ids
    saved = json.loads((out / RESULT_FILE).read_text())
    assert saved["batch_ids"] == result.batch_ids and saved["weights_sha256"] == result.weights_sha256
    assert weights_sha256(load_model(out / "model")) == result.weights_sha256

    argv = ["offline", "--log", str(log), "--policy", "p0", "--model-path", str(init), "--steps", "3",
            "--lr", "1e-2", "--out", str(tmp_path / "cli")]
    assert rollout_bus_cli.main(["trainer", *argv]) == 0  # the same as ``rollout-bus replay offline``
    printed = json.loads(capsys.readouterr().out)
    assert printed["batch_ids"] == result.batch_ids and printed["weights_sha256"] == result.weights_sha256
    assert (tmp_path / "cli" / BATCH_IDS_FILE).read_text().splitlines() == result.batch_ids

    with pytest.raises(SystemExit, match="is not a file"):
        rollout_bus_cli.main(["replay", "offline", "--log", str(tmp_path / "nope"), "--policy", "p0",
                              "--model-path", str(init)])
    with pytest.raises(ConfigError, match="steps must be >= 0"):
        run_offline(config(log, init, steps=-1))
