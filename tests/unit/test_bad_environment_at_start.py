"""A bad setting in the environment stops a role before it starts anything, with the variable named."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rollout_bus.launch.config import RunConfig, RunFailed


def test_the_engine_refuses_a_bad_health_limit_before_loading_any_weights(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    from rollout_bus.engine import server

    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "soon")
    loaded: list[object] = []
    monkeypatch.setattr("rollout_bus.engine.runtime.Engine.__init__", lambda self, args: loaded.append(args))
    with caplog.at_level(logging.ERROR):
        assert server.main(["--model-path", str(tmp_path / "no-model")]) == 2
    assert loaded == []  # refused before the engine (and its weights) was built
    assert "cannot start: SGLANG_HEALTH_CHECK_TIMEOUT must be a number of seconds > 0, got 'soon'" in caplog.text


def test_the_executor_refuses_a_bad_epoch_interval_before_it_starts_working(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from rollout_bus.executor import cli

    monkeypatch.setenv("ROLLOUT_BUS_EPOCH_CHECK_S", "-1")
    started: list[object] = []
    monkeypatch.setattr("rollout_bus.executor.service.ExecutorService.__init__",
                        lambda self, config: started.append(config))
    with caplog.at_level(logging.ERROR):
        assert cli.main(["--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert started == []
    assert "cannot start: ROLLOUT_BUS_EPOCH_CHECK_S must be a finite number of seconds > 0, got '-1'" in caplog.text


@pytest.mark.parametrize(("name", "raw", "says"), [
    ("ROLLOUT_BUS_EPOCH_CHECK_S", "0", "ROLLOUT_BUS_EPOCH_CHECK_S must be a finite number of seconds > 0"),
    ("ROLLOUT_BUS_DEDUPE_TTL_S", "60", "ROLLOUT_BUS_DEDUPE_TTL_S must be a whole number >= 600, got '60'"),
])
def test_a_run_with_a_bad_setting_fails_before_it_starts_anything(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, raw: str, says: str) -> None:
    from rollout_bus.launch.job import run_job

    monkeypatch.setenv(name, raw)
    out = tmp_path / "run"
    with pytest.raises(RunFailed, match=f"bad environment: {says}"):
        run_job(RunConfig(out=str(out), redis_url="redis://127.0.0.1:1/0", progress=False, plot=False))
    assert not out.exists()  # nothing made, no redis-server, no role


def test_a_degraded_wait_may_be_forever_but_not_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    import fakeredis

    from rollout_bus.events.connection import durability
    from rollout_bus.events.errors import InvalidRequest

    client = fakeredis.FakeRedis()
    monkeypatch.setenv("ROLLOUT_BUS_WAIT_DEGRADED_S", "inf")
    assert durability(client).wait_s == float("inf")
    monkeypatch.setenv("ROLLOUT_BUS_WAIT_DEGRADED_S", "nan")
    with pytest.raises(InvalidRequest, match="ROLLOUT_BUS_WAIT_DEGRADED_S must be a number of seconds >= 0, or inf"):
        durability(client)
