"""Version ordering per policy: never backwards, newer supersedes older, refused versions roll back."""

from __future__ import annotations

import pytest

from rollout_bus.controller.versions import Target, VersionBook, engine_versions, lora_name_for


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


def test_policy_mapping_base_is_the_base_weights_others_are_named_sets() -> None:
    assert lora_name_for("default", "default") is None
    assert lora_name_for("math", "default") == "math"
    info = {"weight_version": "5", "weight_versions": {"base": "5", "math": "2", "bad": "default"}}
    assert engine_versions(info, "default") == {"default": 5, "math": 2}
    assert engine_versions({"weight_version": "default"}, "default") == {}
