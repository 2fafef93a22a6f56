"""Numbers from environment variables: defaults when unset, an error naming the variable when bad."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_bus.events.epoch import DEFAULT_CHECK_S, check_interval_s
from rollout_bus.events.errors import InvalidRequest
from rollout_bus.events.settings import env_int, env_seconds

NAME = "ROLLOUT_BUS_TEST_SETTING"


def test_unset_and_empty_give_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert env_int(NAME, 3, minimum=1) == 3 and env_seconds(NAME, 2.5) == 2.5
    monkeypatch.setenv(NAME, "  ")
    assert env_int(NAME, 3, minimum=1) == 3 and env_seconds(NAME, 2.5) == 2.5


@pytest.mark.parametrize(("raw", "minimum", "expected"), [("0", 0, 0), ("42", 1, 42), (" 7", 7, 7)])
def test_a_whole_number_in_range_is_read(monkeypatch: pytest.MonkeyPatch, raw: str, minimum: int,
                                         expected: int) -> None:
    monkeypatch.setenv(NAME, raw)
    assert env_int(NAME, -1, minimum=minimum) == expected


@pytest.mark.parametrize("raw", ["1.5", "ten", "0x10", "-1"])
def test_anything_else_is_an_error_saying_what_to_fix(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(NAME, raw)
    with pytest.raises(InvalidRequest, match=f"{NAME} must be a whole number >= 0, got '{raw}'"):
        env_int(NAME, 1, minimum=0)


@pytest.mark.parametrize(("raw", "zero", "ok"), [("0", True, True), ("0", False, False), ("0.25", False, True),
                                                 ("-0.1", True, False), ("inf", True, False), ("nan", True, False),
                                                 ("1e3", False, True), ("soon", True, False)])
def test_seconds_are_finite_and_positive_or_zero_when_allowed(monkeypatch: pytest.MonkeyPatch, raw: str,
                                                              zero: bool, ok: bool) -> None:
    monkeypatch.setenv(NAME, raw)
    if ok:
        assert env_seconds(NAME, 9.0, zero=zero) == float(raw)
    else:
        with pytest.raises(InvalidRequest, match=f"{NAME} must be a .*number of seconds {'>=' if zero else '>'} 0"):
            env_seconds(NAME, 9.0, zero=zero)


@given(st.text(max_size=20))
def test_any_value_is_read_or_refused_never_anything_else(raw: str) -> None:
    import os

    if "\0" in raw:
        return  # an environment value cannot hold a NUL
    os.environ[NAME] = raw
    try:
        for read in (lambda: env_int(NAME, 1, minimum=0), lambda: env_seconds(NAME, 1.0)):
            try:
                value = read()
            except InvalidRequest as exc:
                assert NAME in str(exc)
            else:
                assert value >= 0
    finally:
        del os.environ[NAME]


def test_the_epoch_check_interval_refuses_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUT_BUS_EPOCH_CHECK_S", raising=False)
    assert check_interval_s() == DEFAULT_CHECK_S
    monkeypatch.setenv("ROLLOUT_BUS_EPOCH_CHECK_S", "0.5")
    assert check_interval_s() == 0.5
    monkeypatch.setenv("ROLLOUT_BUS_EPOCH_CHECK_S", "0")
    with pytest.raises(InvalidRequest, match="ROLLOUT_BUS_EPOCH_CHECK_S must be a finite number of seconds > 0"):
        check_interval_s()
