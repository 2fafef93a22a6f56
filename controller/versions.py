"""Weight versions per policy: ordering, supersession and the policy -> weight-set mapping.

Policy mapping: the controller's ``base_policy`` (``"default"`` unless configured) is
the engine's base weights (``/update_weights_from_disk`` without ``lora_name``; the
version is ``/model_info``'s ``weight_version``). Any other policy is a named weight
set on every engine: ``lora_name=<policy>`` on update, ``lora_path=<policy>`` on
``/generate``, and ``weight_versions[<policy>]`` in ``/model_info``.

Ordering: versions of a policy only go up. A published version that is not newer
than the newest accepted one is ignored (with a reason). A newer version accepted
while an older one is being applied supersedes it: the older one is not applied to
any engine that has not started it, and never after the newer one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollout_bus.engine.http_client import parse_version


def lora_name_for(policy: str, base_policy: str) -> str | None:
    """The engine weight-set name of ``policy``: None for the base weights."""
    return None if policy == base_policy else policy


def engine_versions(model_info: Mapping[str, Any], base_policy: str) -> dict[str, int]:
    """Per-policy versions an engine reports in ``/model_info`` (placeholders dropped)."""
    out: dict[str, int] = {}
    named = model_info.get("weight_versions")
    if isinstance(named, Mapping):
        for name, value in named.items():
            version = parse_version(value)
            if version is not None and isinstance(name, str):
                out[name] = version
    base = parse_version(model_info.get("weight_version"))
    out.pop("base", None)
    if base is not None:
        out[base_policy] = base
    else:
        out.pop(base_policy, None)
    return out


@dataclass(frozen=True)
class Target:
    """Verified weights of one policy version, ready to push to engines."""

    policy: str
    version: int
    uri: str
    sha256: str
    engine_path: str


class VersionBook:
    """The newest accepted version and the weights engines must run, per policy.

    ``target`` is what engines converge to; ``good`` the last target that an engine
    accepted (what a rejected target rolls back to). Neither ever goes backwards in
    version except by that rollback, which returns to a version engines already ran.
    """

    def __init__(self) -> None:
        self._accepted: dict[str, int] = {}
        self._target: dict[str, Target] = {}
        self._good: dict[str, Target] = {}

    def seed(self, policy: str, version: int, target: Target | None = None, *, proven: bool = True) -> None:
        """Start from what is known (initial weights, a registry record); ``proven``: engines ran ``target``."""
        if version > self._accepted.get(policy, -1):
            self._accepted[policy] = version
        if target is not None:
            self._target[policy] = target
            if proven:
                self._good[policy] = target

    def accepted(self, policy: str) -> int | None:
        return self._accepted.get(policy)

    def stale_reason(self, policy: str, version: int) -> str | None:
        """Why ``version`` must be ignored, or None when it is newer than everything accepted."""
        newest = self._accepted.get(policy)
        if newest is None or version > newest:
            return None
        word = "equal to" if version == newest else "older than"
        return f"stale: version {version} is {word} the newest accepted version {newest} of {policy!r}"

    def accept(self, target: Target) -> None:
        reason = self.stale_reason(target.policy, target.version)
        if reason is not None:
            raise ValueError(reason)
        self._accepted[target.policy] = target.version
        self._target[target.policy] = target

    def superseded(self, policy: str, version: int) -> bool:
        """Whether a newer version of ``policy`` was accepted after ``version``."""
        return self._accepted.get(policy, version) > version

    def target(self, policy: str) -> Target | None:
        return self._target.get(policy)

    def targets(self) -> dict[str, Target]:
        return dict(self._target)

    def mark_good(self, target: Target) -> None:
        current = self._good.get(target.policy)
        if current is None or target.version >= current.version:
            self._good[target.policy] = target

    def good(self, policy: str) -> Target | None:
        return self._good.get(policy)

    def rollback(self, policy: str, version: int) -> Target | None:
        """Engines refused ``version``: go back to the last good target (the version stays accepted)."""
        current = self._target.get(policy)
        if current is None or current.version != version:
            return current
        good = self._good.get(policy)
        if good is None:
            del self._target[policy]
        else:
            self._target[policy] = good
        return good
