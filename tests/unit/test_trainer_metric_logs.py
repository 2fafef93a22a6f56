"""The trainer's metric logs: every listed metric of every step in JSONL, TensorBoard and W&B (offline).

A reference trainer runs a few steps against the fake rollout service on fakeredis, with
its logs under a temporary directory; the files are read back with each backend's own
reader (``tests.support.metric_logs``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import fakeredis
import pytest

from rollout_bus.events.names import Keys
from rollout_bus.events.schema import STALENESS_PREFIX
from rollout_bus.lm.model import ModelConfig, build_model, save_weights
from rollout_bus.trainer.checkpoint import TrainerState
from rollout_bus.trainer.config import (
    ConfigError,
    LogConfig,
    PublishConfig,
    RolloutConfig,
    ScheduleConfig,
    TrainerConfig,
    parse_log_to,
)
from rollout_bus.trainer.metric_loggers import (
    STALENESS_HISTOGRAM,
    STEP_SCALARS,
    StepLogger,
    output_paths,
    step_record,
)
from rollout_bus.trainer.service import Trainer
from tests.support.fake_rollouts import FakeRollouts
from tests.support.metric_logs import jsonl_steps, tensorboard_run, wandb_history

STEPS = 4
N_GROUPS, N_SAMPLES = 2, 3


@pytest.fixture()
def model_path(tmp_path: Path) -> str:
    model = build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=32), seed=0)
    save_weights(model, tmp_path / "init")
    return str(tmp_path / "init")


def config(tmp_path: Path, model_path: str, keys: Keys, log_to: str, steps: int = STEPS) -> TrainerConfig:
    return TrainerConfig(
        policy="p0", trainer_id="t0", namespace=keys.namespace, steps=steps, model_path=model_path,
        checkpoint_dir=str(tmp_path / "ckpt"), get_timeout_s=20.0,
        rollout=RolloutConfig(n_groups=N_GROUPS, n_samples_per_group=N_SAMPLES, timeout_s=5.0),
        schedule=ScheduleConfig(mode="one-step"),
        publish=PublishConfig(weights_root=str(tmp_path / "weights"), serving_timeout_s=5.0),
        log=LogConfig(to=parse_log_to(log_to), dir=str(tmp_path / "metrics"), run_name="exp"))


def train(client: fakeredis.FakeRedis, cfg: TrainerConfig, keys: Keys) -> dict[str, str]:
    trainer = Trainer(cfg, client, keys)
    trainer.start()
    try:
        trainer.run()
        assert trainer.step_log is not None
        return trainer.step_log.outputs
    finally:
        trainer.stop()


SECRET = "s3cret-password"


def run(tmp_path: Path, model_path: str, keys: Keys, log_to: str) -> dict[str, str]:
    client = fakeredis.FakeRedis()
    cfg = config(tmp_path, model_path, keys, log_to)
    cfg.redis_url = f"redis://trainer:{SECRET}@127.0.0.1:1/0"  # not used (fakeredis), never logged
    # even rollouts come back one version behind: the staleness histogram has two buckets
    with FakeRollouts(client, keys, policies=("p0",), version_of=lambda rid, v: max(0, v - rid % 2)):
        return train(client, cfg, keys)


def test_a_short_run_logs_every_metric_of_every_step_to_jsonl_and_tensorboard(
        tmp_path: Path, model_path: str, keys: Keys) -> None:
    outputs = run(tmp_path, model_path, keys, "tensorboard")
    run_name = "exp-p0"
    assert outputs == {k: str(v) for k, v in output_paths(tmp_path / "metrics", run_name,
                                                          ["jsonl", "tensorboard"]).items()}

    lines = jsonl_steps(Path(outputs["jsonl"]))
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    assert [line["weight_version"] for line in lines] == list(range(1, STEPS + 1))
    for line in lines:
        assert (line["run"], line["policy"]) == (run_name, "p0")
        assert set(line["metrics"]) == {*STEP_SCALARS, "time/checkpoint_s"}, line["step"]  # it checkpoints
        assert all(isinstance(v, float) and math.isfinite(v) for v in line["metrics"].values()), line
        assert sum(line["staleness_hist"].values()) == line["metrics"]["batch/samples"] == N_GROUPS * N_SAMPLES
        assert 0 <= line["metrics"]["reward/mean"] <= 1 and line["metrics"]["reward/std"] >= 0
        assert line["metrics"]["policy/entropy"] > 0  # a random model is far from deterministic
        assert line["metrics"]["time/weight_publish_s"] > 0 and line["metrics"]["time/update_s"] > 0
        assert line["metrics"]["throughput/samples_per_s"] > 0 and line["metrics"]["throughput/tokens_per_s"] > 0
        assert line["metrics"]["loss/total"] == pytest.approx(
            line["metrics"]["loss/policy_gradient"] + line["metrics"]["loss/entropy"])
    assert len({k for line in lines for k in line["staleness_hist"]}) >= 2

    tb = tensorboard_run(Path(outputs["tensorboard"]))
    assert set(STEP_SCALARS) <= set(tb.Tags()["scalars"])
    for name in STEP_SCALARS:
        events = tb.Scalars(name)
        assert [e.step for e in events] == list(range(1, STEPS + 1)), name
        assert [e.value for e in events] == pytest.approx([line["metrics"][name] for line in lines]), name
    (text,) = tb.Tensors("config/text_summary")
    config_text = text.tensor_proto.string_val[0].decode()
    assert '"policy": "p0"' in config_text and SECRET not in config_text
    histograms = tb.Histograms(STALENESS_HISTOGRAM)
    assert [h.step for h in histograms] == list(range(1, STEPS + 1))
    for h, line in zip(histograms, lines, strict=True):
        assert h.histogram_value.num == sum(line["staleness_hist"].values())
        assert h.histogram_value.max == max(int(k) for k in line["staleness_hist"])


def test_the_wandb_offline_run_directory_holds_every_metric_of_every_step(
        tmp_path: Path, model_path: str, keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'rollout-bus[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    outputs = run(tmp_path, model_path, keys, "wandb")
    run_dir = Path(outputs["wandb"])
    assert run_dir.is_dir() and run_dir.name.startswith("offline-run-") and run_dir.name.endswith("-exp-p0")
    assert output_paths(tmp_path / "metrics", "exp-p0", ["wandb"])["wandb"] == run_dir
    info, rows = wandb_history(run_dir)
    assert (info["name"], info["project"], info["group"], info["id"]) == ("exp-p0", "rollout-bus", "exp", "exp-p0")
    assert SECRET.encode() not in next(run_dir.glob("*.wandb")).read_bytes()  # the config went in without it
    lines = jsonl_steps(Path(outputs["jsonl"]))
    assert [row["_step"] for row in rows] == [line["step"] for line in lines] == list(range(1, STEPS + 1))
    for row, line in zip(rows, lines, strict=True):
        assert {name: row[name] for name in line["metrics"]} == pytest.approx(line["metrics"])
        assert row["weight_version"] == line["weight_version"]
        assert row[STALENESS_HISTOGRAM]["_type"] == "histogram"
        assert sum(row[STALENESS_HISTOGRAM]["values"]) == sum(line["staleness_hist"].values())


def test_a_restarted_trainer_appends_to_the_same_logs_and_logs_the_step_a_crash_cut_off(
        tmp_path: Path, model_path: str, keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    cfg = config(tmp_path, model_path, keys, "tensorboard")
    jsonl = tmp_path / "metrics" / "exp-p0.jsonl"

    def crash(state: TrainerState) -> None:
        if state.step == 2:
            del state.last_metrics["entropy"]  # as a checkpoint written before the entropy was measured
            assert first.store is not None and first.model is not None and first.learner is not None
            first.store.save(state, first.model, first.learner.optimizer)
            raise RuntimeError("crashed after the checkpoint of step 2, before it was published and logged")

    with FakeRollouts(client, keys, policies=("p0",)):
        first = Trainer(cfg, client, keys)
        first.after_checkpoint.append(crash)
        first.start()
        with pytest.raises(RuntimeError, match="crashed after the checkpoint"):
            first.run()
        first.stop()
        assert [line["step"] for line in jsonl_steps(jsonl)] == [1]  # the fault: step 2 is trained, not logged
        with jsonl.open("a") as f:
            f.write('{"run": "exp-p0", "step": 2, "metr')  # and the crash cut a line short
        outputs = train(client, cfg, keys)
    raw = jsonl.read_text().splitlines()
    assert raw[1] == '{"run": "exp-p0", "step": 2, "metr'  # left on a line of its own
    lines = [json.loads(line) for i, line in enumerate(raw) if i != 1]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    recovered = lines[1]["metrics"]
    assert recovered["reward/mean"] is not None and recovered["time/update_s"] > 0  # from the checkpoint
    assert recovered["time/weight_publish_s"] is None and recovered["throughput/samples_per_s"] is None  # unknown
    assert recovered["policy/entropy"] is None  # not in that checkpoint
    assert all(v is not None for line in lines[2:] for v in line["metrics"].values())
    steps = [e.step for e in tensorboard_run(Path(outputs["tensorboard"])).Scalars("reward/mean")]
    assert steps == list(range(1, STEPS + 1))


def test_without_a_log_directory_nothing_is_written(tmp_path: Path, model_path: str, keys: Keys) -> None:
    cfg = config(tmp_path, model_path, keys, "tensorboard")
    cfg.log.dir = ""
    logger = StepLogger(cfg)
    assert logger.loggers == [] and logger.outputs == {}
    assert logger.step(1, 1, {}) is None  # nothing to write, nothing asked of the metrics
    assert not (tmp_path / "metrics").exists()


def test_log_to_always_writes_jsonl_and_rejects_unknown_backends() -> None:
    assert parse_log_to("tensorboard,wandb") == ["jsonl", "tensorboard", "wandb"]
    assert parse_log_to("jsonl") == parse_log_to("") == ["jsonl"]
    assert parse_log_to(" tensorboard , jsonl,tensorboard") == ["jsonl", "tensorboard"]
    cfg = TrainerConfig(publish=PublishConfig(weights_root="/w"), log=LogConfig(to=parse_log_to("tensorbored")))
    with pytest.raises(ConfigError, match="log backend 'tensorbored' is not one of"):
        cfg.validate()
    cfg = TrainerConfig(publish=PublishConfig(weights_root="/w"), log=LogConfig(run_name="a/b"))
    with pytest.raises(ConfigError, match="run name"):
        cfg.validate()


def test_a_missing_backend_package_is_named_with_the_extra_that_installs_it(
        tmp_path: Path, model_path: str, keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "wandb") else real_find_spec(name, *a))
    cfg = config(tmp_path, model_path, keys, "tensorboard,wandb")
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert "pip install 'rollout-bus[tensorboard]'" in str(err.value)
    assert "pip install 'rollout-bus[wandb]'" in str(err.value)

    # past the check (a package that imports badly): opening the backend says the same
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"pip install 'rollout-bus\[tensorboard\]'"):
        StepLogger(cfg)
    assert not (tmp_path / "metrics" / "tensorboard").exists()


def test_a_step_record_turns_milliseconds_into_seconds_and_counts_per_second_of_the_step() -> None:
    metrics = {"reward_mean": 0.5, "reward_std": 0.1, "loss": 0.2, "pg_loss": 0.25, "entropy_loss": -0.05,
               "entropy": 1.5, "is_truncated_frac": 0.1, "is_masked_frac": 0.0, "ppo_clipped_frac": 0.0, "is_weight_mean": 1.0,
               "rollout_kl": 0.01, "grad_norm": 2.0, "skipped_no_signal": 0.0, "staleness_mean": 0.5, "staleness_max": 1.0,
               "n_samples": 8.0, "response_tokens": 40.0, "wait_ms": 300.0, "train_ms": 50.0,
               "serving_wait_ms": 0.0, "weights_save_ms": 15.0, "publish_ms": 5.0,
               f"{STALENESS_PREFIX}0": 4.0, f"{STALENESS_PREFIX}1": 4.0}
    record = step_record(3, 3, metrics, interval_s=2.0, time_s=100.0)
    assert record.scalars["time/batch_wait_s"] == pytest.approx(0.3)
    assert record.scalars["time/weight_publish_s"] == pytest.approx(0.02)
    assert record.scalars["throughput/samples_per_s"] == 4.0 and record.scalars["throughput/tokens_per_s"] == 20.0
    assert record.staleness == {0: 4, 1: 4} and list(record.scalars) == list(STEP_SCALARS)
    del metrics["entropy"]
    with pytest.raises(KeyError, match="entropy"):
        step_record(3, 3, metrics, interval_s=2.0)
