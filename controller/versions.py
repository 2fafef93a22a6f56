"""Weight versions per policy: ordering, supersession, and what an engine reports it runs.

Policies and engines: each engine pool has a base policy, whose full weights the engines of the
pool run (``/update_weights_from_disk``; the version is ``/model_info``'s ``weight_version``). Any
other policy is a PEFT LoRA adapter served on top of the controller's base pool: loaded with
``/load_lora_adapter`` under ``<policy>@v<version>`` (``events.registry.adapter_name``) and picked per
request with that name as ``lora_path``. SGLang keeps no version per adapter; the name carries it,
and ``/v1/models`` lists the loaded names, which is how an adopted engine's adapters are read back.

Ordering: versions of a policy only go up. A published version that is not newer
than the newest accepted one is ignored (with a reason). A newer version accepted
while an older one is being applied supersedes it: the older one is not applied to
any engine that has not started it, and never after the newer one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rollout_bus.engine.http_client import parse_version
from rollout_bus.events.registry import parse_adapter_name


def base_version(model_info: Mapping[str, Any]) -> int | None:
    """The base weights' version an engine reports in ``/model_info`` (None for a placeholder)."""
    return parse_version(model_info.get("weight_version"))


def loaded_adapters(models: Mapping[str, Any]) -> dict[str, list[tuple[int, str]]]:
    """Adapter versions an engine lists in ``/v1/models``: policy -> [(version, name)], newest first.

    Only names made by ``adapter_name`` count; anything else loaded there is not the controller's."""
    out: dict[str, list[tuple[int, str]]] = {}
    data = models.get("data")
    for card in data if isinstance(data, list) else []:
        name = card.get("id") if isinstance(card, dict) else None
        parsed = parse_adapter_name(name) if isinstance(name, str) and card.get("parent") else None
        if parsed is not None:
            out.setdefault(parsed[0], []).append((parsed[1], str(name)))
    for versions in out.values():
        versions.sort(reverse=True)
    return out


@dataclass(frozen=True)
class Target:
    """Verified weights of one policy version, ready to push to engines."""

    policy: str
    version: int
    uri: str
    sha256: str
    engine_path: str
    kind: Literal["full", "adapter"] = "full"
    digest: str = ""
    """``lm.files.tensors_digest`` of the directory, taken when it was verified (what engines must report)."""
    group_address: str = ""
    """Where the trainer offers this version by collective (``host:port`` of its rendezvous store); "": disk only."""
    group_backend: str = ""
    buckets: tuple[tuple[str, ...], ...] = ()
    """The trainer's bucket plan: tensor names per ``/update_weights_from_distributed`` call, in order."""


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
