"""LoRA adapter names: every name the controller makes (``events.registry.adapter_name``) passes the check
engines apply (``events.names.adapter_name_problem``), and a name that does not is refused naming its
first wrong character."""

from __future__ import annotations

import pytest

from rollout_bus.events.names import NAME_MAX, adapter_name_problem
from rollout_bus.events.registry import adapter_name, parse_adapter_name

POLICIES = ["p", "default", "_p", "0", "P-1_x", "a" * NAME_MAX, "policy_v2", "policy-v2", "v2"]
"""Policy names at the edges of the grammar (the controller takes no other: its config checks them)."""
VERSIONS = [0, 1, 9, 10, 12345, 10 ** 19 - 1]
CONTROLLER_NAMES = [adapter_name(p, v) for p in POLICIES for v in VERSIONS]


@pytest.mark.parametrize("name", CONTROLLER_NAMES)
def test_every_name_the_controller_makes_is_one_engines_take(name: str) -> None:
    assert adapter_name_problem(name) is None
    parsed = parse_adapter_name(name)
    assert parsed is not None and adapter_name(*parsed) == name


@pytest.mark.parametrize(("name", "fragment"), [
    ("policy.v2@v3", "character '.' at position 7"),
    ("a:b", "character ':' at position 2"),
    ("p@x", "character '@' at position 2"),
    ("p@v", "character '@' at position 2"),
    ("-p@v1", "character '-' at position 1"),
    ("@v1", "must not be empty"),
    ("p/../x@v1", "character '/' at position 2"),
    ("p@v" + "1" * 20, "character '@' at position 2"),
    ("", "must not be empty"),
    ("x" * (NAME_MAX + 1), f"more than {NAME_MAX}"),
])
def test_a_name_engines_refuse_says_which_character(name: str, fragment: str) -> None:
    problem = adapter_name_problem(name)
    assert problem is not None and fragment in problem and "<policy>@v<version>" in problem


@pytest.mark.parametrize(("policy", "version"), [("policy.v2", 3), ("a:b", 1), ("p", -1), ("p", 10 ** 19)])
def test_the_controller_never_makes_a_name_engines_refuse(policy: str, version: int) -> None:
    with pytest.raises(ValueError):
        adapter_name(policy, version)
