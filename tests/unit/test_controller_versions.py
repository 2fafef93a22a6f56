"""Version ordering per policy: never backwards, newer supersedes older, refused versions roll back."""

from __future__ import annotations

import pytest

from rollout_bus.controller.versions import Target, VersionBook, base_version, loaded_adapters
from rollout_bus.events.registry import EngineRecord, EngineState, adapter_name, parse_adapter_name


def target(version: int, policy: str = "default") -> Target:
    return Target(policy, version, f"/w/{policy}/{version}", "0" * 64, f"/w/{policy}/{version}")


def test_older_and_equal_versions_are_stale_newer_ones_are_not() -> None:
    book = VersionBook()
    book.seed("default", 0)
    assert book.stale_reason("default", 0) is not None and "equal to" in (book.stale_reason("default", 0) or "")
    book.accept(target(3))
    assert "older than" in (book.stale_reason("default", 2) or "")
    assert book.stale_reason("default", 4) is None
    assert book.stale_reason("other", 1) is None  # policies are ordered independently
    with pytest.raises(ValueError):
        book.accept(target(3))


def test_a_newer_version_supersedes_an_older_one_in_flight() -> None:
    book = VersionBook()
    book.accept(target(1))
    assert not book.superseded("default", 1)
    book.accept(target(2))
    assert book.superseded("default", 1)
    assert book.target("default") == target(2)
    assert not book.superseded("default", 2)


def test_a_refused_version_rolls_back_to_the_last_good_one_but_stays_accepted() -> None:
    book = VersionBook()
    book.accept(target(1))
    book.mark_good(target(1))
    book.accept(target(2))
    assert book.rollback("default", 2) == target(1)
    assert book.target("default") == target(1)
    assert book.accepted("default") == 2  # a re-publication of 2 is still stale
    assert book.stale_reason("default", 2) is not None
    book.accept(target(3))
    assert book.rollback("default", 2) == target(3)  # rolling back an old version changes nothing


def test_rollback_without_any_good_version_leaves_no_target() -> None:
    book = VersionBook()
    book.accept(target(1, "lora-a"))
    assert book.rollback("lora-a", 1) is None
    assert book.target("lora-a") is None


def test_an_engine_reports_only_its_base_version_and_adapter_versions_live_in_adapter_names() -> None:
    """SGLang's /model_info has one weight_version (the base weights') and no per-adapter versions; the
    adapters it lists in /v1/models carry theirs in their names."""
    assert base_version({"weight_version": "5", "weight_versions": {"math": "2"}}) == 5
    assert base_version({"weight_version": "default"}) is None
    models = {"data": [{"id": "/models/m", "parent": None}, {"id": "math@v2", "parent": "/models/m"},
                       {"id": "math@v3", "parent": "/models/m"}, {"id": "hand-loaded", "parent": "/models/m"},
                       {"id": "code@v1", "parent": "/models/m"}]}
    assert loaded_adapters(models) == {"math": [(3, "math@v3"), (2, "math@v2")], "code": [(1, "code@v1")]}
    assert adapter_name("math", 7) == "math@v7" and parse_adapter_name("math@v7") == ("math", 7)
    assert parse_adapter_name("my@vx") is None and parse_adapter_name("plain") is None


def test_a_generate_call_names_the_adapter_of_a_non_base_policy_and_nothing_for_the_base() -> None:
    record = EngineRecord("e", "http://x", EngineState.SERVING, base_policy="default",
                          versions={"default": 3, "math": 2}, adapters={"math": "math@v2"})
    assert record.lora_path("default") is None and record.lora_path("math") == "math@v2"
    assert record.serves("default") and record.serves("math") and not record.serves("code")
    record.versions["code"] = 1  # a version without a loaded adapter is not served
    assert not record.serves("code")
