"""Held-out evals during a real run: ``--eval-every 2`` on the tiny LM (controller, engine, executors and trainer
as processes, a real Redis). Each eval is an ``EvalCompleted`` event on the eval stream, lands in the run's
metric logs, and the summary holds before, after and their paired difference, all with intervals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_bus.events.connection import connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.schema import EvalCompleted, TrainStepDone, decode
from rollout_bus.launch.config import RunConfig
from rollout_bus.launch.job import run_job
from tests.support.fake_rollouts import shared_init_dir
from tests.support.metric_logs import jsonl_steps, tensorboard_run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STEPS = 6
PROBLEMS = 24


def test_a_run_with_eval_every_2_evaluates_during_training_and_sums_up_with_intervals(
        tmp_path: Path, redis_server: RedisServer, keys: Keys) -> None:
    config = RunConfig(mode="one-step", steps=STEPS, seed=0, out=str(tmp_path / "out"), redis_url=redis_server.url,
                       namespace=keys.namespace, init_dir=str(shared_init_dir()), progress=False, n_groups=4,
                       n_samples=4, timeout_s=200.0, eval_every=2, eval_groups=PROBLEMS, eval_samples=2,
                       log_to="tensorboard")
    result = run_job(config)
    client = connect(redis_server.url)
    try:
        evals = [decode(f) for _, f in page(client, keys.eval_stream)]
        steps = {e.step: e for e in (decode(f) for _, f in page(client, keys.trainer_stream))
                 if isinstance(e, TrainStepDone)}
    finally:
        client.close()
    assert all(isinstance(e, EvalCompleted) for e in evals)
    phases = [e.request_id.split(f"{keys.namespace}-")[1].split("-")[1] for e in evals]
    assert phases == ["before0", "during2", "during4", "after6"]
    for e in evals:
        assert e.policy == "p0" and e.split == "eval" and e.n_problems == PROBLEMS and e.n_samples == 2 * PROBLEMS
        assert e.metrics["accuracy_lo"] <= e.metrics["accuracy"] <= e.metrics["accuracy_hi"]
        assert sorted(row[0] for row in e.problems) == list(range(PROBLEMS))  # the same problems every time
    # the evals during the run scored the weights of their step (or newer: training does not wait for them)
    assert evals[0].max_weight_version == 0
    assert evals[1].min_weight_version >= steps[2].weight_version
    assert evals[2].min_weight_version >= steps[4].weight_version
    assert evals[3].min_weight_version == steps[STEPS].weight_version

    summary = json.loads((result.out / "summary.json").read_text())["policies"]["p0"]
    before, after = summary["eval"]["before"], summary["eval"]["after"]
    for m in (before, after):
        assert m["accuracy_lo"] <= m["accuracy"] <= m["accuracy_hi"] and m["samples"] == 2 * PROBLEMS
    diff = summary["eval_difference"]
    assert diff["accuracy_diff"] == pytest.approx(after["accuracy"] - before["accuracy"])
    assert diff["accuracy_diff_lo"] <= diff["accuracy_diff"] <= diff["accuracy_diff_hi"]
    assert diff["paired_problems"] == PROBLEMS
    assert [p["step"] for p in summary["eval_during"]] == [0, 2, 4, STEPS]
    assert "eval change accuracy" in result.text and "eval during step 2" in result.text

    logs = json.loads((result.out / "summary.json").read_text())["metric_logs"]["p0"]
    lines = jsonl_steps(Path(logs["eval-jsonl"]))
    assert [(line["phase"], line["step"]) for line in lines] == [("before", 0), ("during", 2), ("during", 4),
                                                                 ("after", STEPS)]
    assert all(len(line["problems"]) == PROBLEMS for line in lines)  # per problem, for paired comparisons
    tb = tensorboard_run(Path(logs["eval-tensorboard"]))
    assert [e.step for e in tb.Scalars("eval/accuracy")] == [0, 2, 4, STEPS]
    assert [e.step for e in tensorboard_run(Path(logs["tensorboard"])).Scalars("reward/mean")] == \
        list(range(1, STEPS + 1))  # the trainer's own run is untouched by the eval's
    assert (result.out / "reward.png").stat().st_size > 0


def test_eval_engines_serve_the_evals_alone_and_follow_the_newest_weights(
        tmp_path: Path, redis_server: RedisServer, keys: Keys) -> None:
    from rollout_bus.events.registry import Registry
    from rollout_bus.launch.job import RunHandle
    from rollout_bus.trainer.recorder import read_recording

    roles: dict[str, str] = {}

    def look(handle: RunHandle) -> None:
        client = connect(handle.url)
        try:
            roles.update({e.engine_id: e.role for e in Registry(client, handle.keys).engines().values()})
        finally:
            client.close()

    steps = 4
    config = RunConfig(mode="sync", steps=steps, seed=0, out=str(tmp_path / "out"), redis_url=redis_server.url,
                       namespace=keys.namespace, init_dir=str(shared_init_dir()), progress=False, plot=False,
                       n_groups=4, n_samples=4, timeout_s=200.0, eval_every=2, eval_groups=PROBLEMS,
                       eval_engines=1, recorder=True)
    result = run_job(config, on_start=look)
    assert roles == {"engine-0": "train", "engine-eval-0": "eval"}
    client = connect(redis_server.url)
    try:
        evals = [decode(f) for _, f in page(client, keys.eval_stream)]
    finally:
        client.close()
    assert len(evals) == 3 and all(isinstance(e, EvalCompleted) for e in evals)
    assert all(e.engine_ids == ["engine-eval-0"] for e in evals)  # every eval sample on the eval engine
    version = result.summaries["p0"]["version"]
    assert evals[-1].min_weight_version == evals[-1].max_weight_version == version  # kept on the newest weights
    batches = list(read_recording(result.out / "recording"))
    assert len(batches) >= steps
    assert all(data.metadata["engine_ids"] == ["engine-0"] for _, data in batches)  # training never used it
