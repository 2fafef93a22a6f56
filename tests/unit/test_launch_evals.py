"""``rollout-bus run``'s eval options: --eval-every parsing and scheduling, defaults, dynamic sampling."""

from __future__ import annotations

import pytest

from rollout_bus.launch.cli import build_parser, config_from_args
from rollout_bus.launch.config import MODEL_EVAL_GROUPS, RunConfig, due_steps, parse_eval_every
from rollout_bus.launch.job import _filter_args, _trainer_args
from rollout_bus.tasks.math_words import MathWordsSource, problem, restates_answer


def config(*argv: str) -> RunConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_eval_every_takes_a_whole_number_of_steps() -> None:
    assert parse_eval_every("3") == 3 and parse_eval_every("0") == 0
    with pytest.raises(ValueError, match="whole number of trainer steps"):
        parse_eval_every("2.5")
    with pytest.raises(ValueError, match=">= 0"):
        parse_eval_every("-1")
    with pytest.raises(SystemExit):  # argparse reports the same message
        build_parser().parse_args(["--eval-every", "x"])


def test_evals_during_the_run_fall_on_every_nth_step_before_the_last() -> None:
    assert due_steps(2, 8) == [2, 4, 6]  # step 8 is the eval after training
    assert due_steps(3, 10) == [3, 6, 9]
    assert due_steps(0, 10) == [] and due_steps(5, 5) == []


def test_eval_every_needs_problems_and_fewer_steps_than_the_run() -> None:
    c = config("--eval-every", "2", "--steps", "6")
    assert c.eval_every == 2 and c.eval_problems() == 16 * 4 and c.eval_samples == 1
    assert config("--steps", "6").eval_problems() == 0  # the tiny LM evaluates only when asked
    with pytest.raises(SystemExit, match="needs held-out problems"):
        config("--eval-every", "2", "--eval-groups", "0")
    with pytest.raises(SystemExit, match="not below --steps"):
        config("--eval-every", "6", "--steps", "6")


def test_a_model_run_evaluates_enough_problems_and_filters_groups_by_default() -> None:
    c = RunConfig(model="smollm2", n_groups=4)
    assert c.eval_problems() == MODEL_EVAL_GROUPS == 200
    assert c.filters_groups() and c.over_sample_groups() == 6
    assert _filter_args(c) == ["--filter", "rollout_bus.executor.filters.nonzero_reward_std"]
    off = RunConfig(model="smollm2", dynamic_sampling=False)
    assert not off.filters_groups() and _filter_args(off) == []
    assert not RunConfig().filters_groups()  # the tiny LM keeps every group unless asked
    assert config("--model", "smollm2", "--no-dynamic-sampling").dynamic_sampling is False
    model, tiny = config("--model", "smollm2"), config()
    assert (model.rollout_timeout_s, model.timeout_s) == (600.0, 3600.0)  # a real model's rollouts and evals on CPU
    assert (tiny.rollout_timeout_s, tiny.timeout_s) == (120.0, 900.0)


def test_the_trainers_ask_for_extra_groups_only_when_the_filter_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    def args(c: RunConfig) -> list[str]:
        return _trainer_args(c, "p0", "redis://x", "ns", tmp_path, tmp_path, tmp_path, tmp_path, {})

    on = args(RunConfig(n_groups=4, dynamic_sampling=True))
    assert on[on.index("--over-sample-groups") + 1] == "6"
    assert "--over-sample-groups" not in args(RunConfig(n_groups=4))


def test_the_eval_split_leaves_out_problems_that_only_restate_their_answer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.support.tiny_hf import byte_tokenizer

    tokenizer = tmp_path / "tok"
    byte_tokenizer().save_pretrained(tokenizer)
    options = {"tokenizer": str(tokenizer), "min_steps": 1, "max_steps": 2}
    raw = [problem("eval", i, min_steps=1, max_steps=2) for i in range(200)]
    assert sum(map(restates_answer, raw)) > 20  # a fair share of one-step problems only say the answer
    evals = MathWordsSource(**options, split="eval", size=100)
    questions = [evals.question(i) for i in range(100)]
    assert not any(map(restates_answer, questions))
    assert [q.text for q in questions] == [p.text for p in raw if not restates_answer(p)][:100]
    assert evals.question(100) == questions[0]  # size still wraps
    kept = MathWordsSource(**options, split="eval", restated="keep")
    assert [kept.question(i) for i in range(200)] == raw
    train = MathWordsSource(**options, split="train")
    assert any(restates_answer(train.question(i)) for i in range(100))  # training keeps them


def test_the_summary_counts_the_groups_the_filter_left_out_per_step(tmp_path, keys) -> None:  # type: ignore[no-untyped-def]
    import fakeredis

    from rollout_bus.events.schema import TrainStepDone
    from rollout_bus.launch.report import RunLog, format_summary
    from rollout_bus.lm.model import ModelConfig, build_model, save_weights
    from rollout_bus.trainer.service import Trainer
    from tests.support.fake_rollouts import FakeRollouts
    from tests.unit.test_trainer_service import events_of, make_config

    save_weights(build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=32), seed=0),
                 tmp_path / "init")

    def filtered(n: int):  # type: ignore[no-untyped-def]
        def mark(data):  # type: ignore[no-untyped-def]
            data.metadata["metrics"] = {"groups_filtered": float(n), "groups_drawn": float(n + 2)}
        return mark

    client = fakeredis.FakeRedis()
    with FakeRollouts(client, keys, poison={0: filtered(3), 1: filtered(1), 2: filtered(0)}):
        trainer = Trainer(make_config(tmp_path, str(tmp_path / "init"), keys, "sync", 3), client, keys)
        trainer.start()
        trainer.run()
        trainer.stop()
    steps = events_of(client, keys.trainer_stream, TrainStepDone)
    assert [s.metrics["groups_filtered"] for s in steps] == [3.0, 1.0, 0.0]  # the executors' count, per step
    runlog = RunLog()
    runlog.add_all(steps)
    summary = runlog.policy("default")
    assert summary.groups_filtered == [3.0, 1.0, 0.0] and summary.to_dict()["groups_filtered_total"] == 4.0
    assert "4 prompt groups left out (all rewards equal)" in format_summary([summary], mode="sync", wall_s=1.0)
    unfiltered = RunLog()
    unfiltered.add_all([TrainStepDone(producer=steps[0].producer, policy="q", trainer_id="t", step=1,
                                      weight_version=1, metrics={"reward_mean": 0.5})])
    assert "groups_filtered" not in unfiltered.policy("q").to_dict()


def test_an_eval_of_the_base_policy_starts_every_policys_eval_log(tmp_path, keys) -> None:  # type: ignore[no-untyped-def]
    import fakeredis

    from rollout_bus.events.publish import Publisher
    from rollout_bus.events.schema import EvalCompleted, Producer
    from rollout_bus.launch.evals import EvalLog, EvalTracker
    from tests.support.metric_logs import jsonl_steps

    client = fakeredis.FakeRedis()
    asked: list[str] = []
    logs = {p: EvalLog(tmp_path, f"run-{p}", p, ["jsonl"], group="run") for p in ("p0", "p1")}
    tracker = EvalTracker(client, keys, lambda policy, rid: asked.append(rid), "run", logs=logs)
    base = tracker.ask("base", "before", 0)
    own = tracker.ask("p1", "during", 2)
    producer = Publisher(client, keys, Producer("executor", "e0"))
    for point, version in ((base, 0), (own, 2)):
        producer.publish(keys.eval_stream, EvalCompleted(
            producer=producer.producer, policy=point.policy, request_id=point.request_id, split="eval",
            min_weight_version=version, max_weight_version=version, n_problems=2, n_samples=2,
            metrics={"accuracy": 0.5, "accuracy_lo": 0.1, "accuracy_hi": 0.9}, problems=[[0, 1, 1], [1, 0, 1]]))
    assert tracker.poll() == [base, own] and asked == [base.request_id, own.request_id]
    tracker.close()
    assert [(line["phase"], line["step"]) for line in jsonl_steps(logs["p0"].path)] == [("before", 0)]
    assert [(line["phase"], line["step"]) for line in jsonl_steps(logs["p1"].path)] == [("before", 0), ("during", 2)]


def test_each_eval_goes_to_tensorboard_and_wandb_beside_the_trainers_run(tmp_path, keys,  # type: ignore[no-untyped-def]
                                                                         monkeypatch) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'rollout-bus[wandb]')")
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    from pathlib import Path

    from rollout_bus.events.schema import EvalCompleted, Producer
    from rollout_bus.launch.evals import EvalLog, EvalPoint
    from tests.support.metric_logs import tensorboard_run, wandb_history

    eval_log = EvalLog(tmp_path, "exp-p0", "p0", ["jsonl", "tensorboard", "wandb"], group="exp")
    for step, accuracy in ((0, 0.25), (2, 0.5)):
        point = EvalPoint("p0", "before" if step == 0 else "during", step, f"r{step}")
        point.event = EvalCompleted(producer=Producer("executor", "e"), policy="p0", request_id=f"r{step}",
                                    split="eval", min_weight_version=step, max_weight_version=step, n_problems=4,
                                    n_samples=4, metrics={"accuracy": accuracy, "accuracy_lo": 0.1,
                                                          "accuracy_hi": 0.9, "reward_mean": accuracy})
        eval_log.write(point)
    eval_log.close()
    outputs = eval_log.outputs
    assert outputs["tensorboard"] == tmp_path / "tensorboard" / "exp-p0" / "eval"  # the run's eval sub-run
    tb = tensorboard_run(Path(outputs["tensorboard"]))
    assert [(e.step, e.value) for e in tb.Scalars("eval/accuracy")] == [(0, 0.25), (2, 0.5)]
    assert [e.value for e in tb.Scalars("eval/accuracy_hi")] == pytest.approx([0.9, 0.9])
    info, rows = wandb_history(Path(outputs["wandb"]))
    assert (info["name"], info["group"]) == ("exp-p0-eval", "exp")
    assert [(row["_step"], row["eval/accuracy"]) for row in rows] == [(0, 0.25), (2, 0.5)]
