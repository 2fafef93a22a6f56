"""The CPU engine's step cost model: a fixed part per decode step plus a part per sequence in it."""

from __future__ import annotations

import pytest

from rollout_bus.engine.args import parse_args
from rollout_bus.engine.scheduler import SchedulerConfig, step_delay_s


def test_step_cost_grows_with_the_batch_when_asked() -> None:
    config = SchedulerConfig(token_delay_ms=50, token_delay_per_seq_ms=1.5)
    assert step_delay_s(config, 1) == pytest.approx(0.0515)
    assert step_delay_s(config, 32) == pytest.approx(0.098)
    # a fuller batch costs more per step but less per token
    assert step_delay_s(config, 32) / 32 < step_delay_s(config, 1)


def test_without_a_per_sequence_cost_every_batch_costs_the_same() -> None:
    config = SchedulerConfig(token_delay_ms=40)
    assert step_delay_s(config, 1) == step_delay_s(config, 64) == pytest.approx(0.04)
    assert step_delay_s(SchedulerConfig(), 8) == 0.0


def test_a_negative_per_sequence_cost_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "x", "--token-delay-per-seq-ms", "-1"])
    assert "--token-delay-per-seq-ms must be >= 0" in capsys.readouterr().err
    assert parse_args(["--model-path", "x", "--token-delay-per-seq-ms", "2"]).token_delay_per_seq_ms == 2.0
