"""The engine's health-check limit is read from SGLang's own variable, ``SGLANG_HEALTH_CHECK_TIMEOUT``."""

from __future__ import annotations

import pytest

from rollout_bus.engine.routes import HEALTH_TIMEOUT_S, health_timeout_s
from rollout_bus.events.errors import InvalidRequest


@pytest.mark.parametrize(("raw", "expected"), [("5", 5.0), ("0.5", 0.5), ("120", 120.0), (" 7 ", 7.0)])
def test_a_positive_number_sets_the_limit(monkeypatch: pytest.MonkeyPatch, raw: str, expected: float) -> None:
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", raw)
    assert health_timeout_s() == expected


@pytest.mark.parametrize("raw", ["abc", "0", "-3", "nan", "inf"])
def test_a_bad_value_is_an_error_that_names_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", raw)
    with pytest.raises(InvalidRequest, match=f"SGLANG_HEALTH_CHECK_TIMEOUT must be a .*number of seconds > 0, "
                                             f"got '{raw}'"):
        health_timeout_s()


@pytest.mark.parametrize("raw", [None, ""])
def test_unset_or_empty_is_sglangs_default(monkeypatch: pytest.MonkeyPatch, raw: str | None) -> None:
    if raw is None:
        monkeypatch.delenv("SGLANG_HEALTH_CHECK_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", raw)
    assert health_timeout_s() == HEALTH_TIMEOUT_S == 20.0
