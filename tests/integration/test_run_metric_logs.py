"""The main job passes ``--log-to`` to its trainers, and its summary says where each metric log went.

A short real run (controller, engine, executor and trainer as processes, a real Redis) with
``--log-to tensorboard,wandb`` (wandb only where it is installed; offline): the files the
summary names hold every listed metric of every step, read back with TensorBoard's event
reader and from the W&B run file.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.launch.cli import build_parser, config_from_args
from rollout_bus.launch.config import RunConfig
from rollout_bus.launch.job import run_job
from rollout_bus.trainer.metric_loggers import STALENESS_HISTOGRAM, STEP_SCALARS
from tests.support.fake_rollouts import shared_init_dir
from tests.support.metric_logs import jsonl_steps, tensorboard_run, wandb_history

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STEPS = 4
HAVE_WANDB = importlib.util.find_spec("wandb") is not None


def test_the_run_passes_log_to_through_and_its_summary_names_every_output(
        tmp_path: Path, redis_server: RedisServer, keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")  # the trainers inherit it; this machine has no network
    log_to = "tensorboard,wandb" if HAVE_WANDB else "tensorboard"
    config = RunConfig(mode="one-step", steps=STEPS, seed=0, out=str(tmp_path / "out"), redis_url=redis_server.url,
                       namespace=keys.namespace, init_dir=str(shared_init_dir()), progress=False, plot=False,
                       n_groups=4, n_samples=4, timeout_s=150.0, log_to=log_to)
    result = run_job(config)
    run = f"{keys.namespace}-p0"
    metrics_dir = result.out / "metrics"
    named = json.loads((result.out / "summary.json").read_text())["metric_logs"]["p0"]
    assert set(named) == {"jsonl", "tensorboard", *(["wandb"] if HAVE_WANDB else [])}
    assert named["jsonl"] == str(metrics_dir / f"{run}.jsonl")
    assert named["tensorboard"] == str(metrics_dir / "tensorboard" / run)
    for backend, path in named.items():
        assert f"{backend:<12} {path}" in result.text  # the printed summary says where each went
    assert f"tensorboard --logdir {metrics_dir / 'tensorboard'}" in result.text

    lines = jsonl_steps(Path(named["jsonl"]))
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    for line in lines:
        assert set(line["metrics"]) == {*STEP_SCALARS, "time/checkpoint_s"}  # the run checkpoints
        assert all(math.isfinite(v) for v in line["metrics"].values()), line
        assert sum(line["staleness_hist"].values()) == line["metrics"]["batch/samples"] > 0
    assert [line["staleness_hist"] for line in lines[1:]] == [{"1": 16}] * (STEPS - 1)  # one step ahead

    tb = tensorboard_run(Path(named["tensorboard"]))
    for name in STEP_SCALARS:
        assert [e.step for e in tb.Scalars(name)] == list(range(1, STEPS + 1)), name
    assert [h.step for h in tb.Histograms(STALENESS_HISTOGRAM)] == list(range(1, STEPS + 1))

    if not HAVE_WANDB:
        pytest.skip("wandb is not installed (pip install 'rollout-bus[wandb]'): its run was not checked")
    info, rows = wandb_history(Path(named["wandb"]))
    assert info["name"] == run and info["group"] == keys.namespace
    assert [row["_step"] for row in rows] == list(range(1, STEPS + 1))
    assert all(set(STEP_SCALARS) <= set(row) for row in rows)


def test_the_run_command_checks_its_log_backends_before_it_starts_anything() -> None:
    assert config_from_args(build_parser().parse_args(["--log-to", "tensorboard"])).log_to == "tensorboard"
    with pytest.raises(SystemExit, match="log backend 'mlflow' is not one of"):
        config_from_args(build_parser().parse_args(["--log-to", "jsonl,mlflow"]))
