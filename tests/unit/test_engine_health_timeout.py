"""The engine's health-check limit is read from SGLang's own variable, ``SGLANG_HEALTH_CHECK_TIMEOUT``."""

from __future__ import annotations

import pytest

from rollout_bus.engine.routes import HEALTH_TIMEOUT_S, health_timeout_s


@pytest.mark.parametrize(("raw", "expected"), [("5", 5.0), ("0.5", 0.5), ("120", 120.0)])
def test_a_positive_number_sets_the_limit(monkeypatch: pytest.MonkeyPatch, raw: str, expected: float) -> None:
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", raw)
    assert health_timeout_s() == expected


@pytest.mark.parametrize("raw", ["", "abc", "0", "-3", "nan", "inf"])
def test_anything_else_keeps_sglangs_default(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", raw)
    assert health_timeout_s() == HEALTH_TIMEOUT_S == 20.0


def test_unset_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_HEALTH_CHECK_TIMEOUT", raising=False)
    assert health_timeout_s() == 20.0
