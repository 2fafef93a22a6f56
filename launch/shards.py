"""The main job over several Redis primaries (``rollout-bus run --shards N``, or ``--redis-url A,B,C``).

Each shard is a whole bus: its Redis, a controller with its own engines, its executors. Shard 0 also
carries what the run follows and asks for itself (the trainers' progress, evals, the recorder); the
trainers spread their rollouts over every shard (``trainer.redis_shards``). ``ShardWatch`` reads each
shard's Redis every second from the launcher: a shard unreachable for ``lost_after_s`` is lost, and the
roles the run started for it (controller, executors) are retired, so their failing reconnects neither
count against the run's restart budget nor fail the run; the trainers go on with the shards left. A
lost shard's roles are not started again by the run (a shard brought back by hand, with its roles,
rejoins the trainers on its own).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

SHARD_INCOMPATIBLE = {
    "colocate": "colocation (each shard's engines would be offloaded by its own controller while one trainer steps)",
    "broadcast": "--weight-sync broadcast (the trainer is rank 0 of one engine group; shards load versions by disk)",
    "autoscale": "--executors auto (the backlog is read on one Redis)",
    "log_events": "--log-events (the export reads one Redis)",
    "recorder": "--recorder (it reads one shard's batches)",
}


SHARD_SEPARATOR = re.compile(r",\s*(?=(?:redis|rediss|unix|redis\+sentinel)://)")
"""A comma that starts another url: a Sentinel url's own commas (between its sentinels) are not followed by a
scheme."""


def split_urls(spec: str) -> list[str]:
    """``A,B,C`` -> the shards' urls (one url: one Redis; a ``redis+sentinel://h1,h2,h3/name`` url is one shard);
    ``ValueError`` for an empty or repeated one."""
    urls = [u.strip() for u in SHARD_SEPARATOR.split(spec)]
    if any(not u or u.endswith(",") or ",," in u for u in urls):
        raise ValueError(f"Redis urls {spec!r}: an empty url between commas")
    if len(set(urls)) != len(urls):
        raise ValueError(f"Redis urls {spec!r}: the same Redis twice (each shard is a Redis primary of its own)")
    return urls


def shard_problems(config: Any, shards: int) -> list[str]:
    """What a run of ``config`` cannot do over ``shards`` Redis primaries."""
    if shards <= 1:
        return []
    used = {"colocate": config.colocate, "broadcast": config.weight_sync == "broadcast",
            "autoscale": config.autoscale is not None, "log_events": bool(config.log_events),
            "recorder": config.recorder}
    return [f"--shards {shards} does not go with {why}" for name, why in SHARD_INCOMPATIBLE.items() if used[name]]


@dataclass
class ShardWatch:
    """The launcher's view of each shard's Redis; retires the roles of a lost one."""

    urls: list[str]
    procs: Any
    children: dict[int, list[Any]] = field(default_factory=dict)
    """The roles the run started per shard (retired when their shard is lost)."""
    lost_after_s: float = 5.0
    lost: dict[int, str] = field(default_factory=dict)
    _clients: dict[int, Any] = field(default_factory=dict)
    _down_since: dict[int, float] = field(default_factory=dict)
    _last: float = 0.0

    def add(self, shard: int, child: Any) -> Any:
        self.children.setdefault(shard, []).append(child)
        return child

    def client(self, shard: int) -> Any:
        """A client of the shard's Redis with short timeouts (a lost shard must not hold the launcher)."""
        from rollout_bus.events.connection import probe_client

        if shard not in self._clients:
            self._clients[shard] = probe_client(self.urls[shard], timeout_s=0.5)
        return self._clients[shard]

    def tick(self, now: float | None = None) -> list[int]:
        """Probe every shard (at most once a second); the shards found lost by this call."""
        from rollout_bus.events.connection import answers

        now = time.monotonic() if now is None else now
        if now - self._last < 1.0:
            return []
        self._last = now
        found = []
        for shard in range(len(self.urls)):
            if shard in self.lost:
                continue
            if answers(self.client(shard)):
                self._down_since.pop(shard, None)
                continue
            since = self._down_since.setdefault(shard, now)
            if now - since >= self.lost_after_s:
                self._lose(shard, f"unreachable for {now - since:.1f}s")
                found.append(shard)
        return found

    def reachable(self, shard: int) -> bool:
        """Whether the last probe reached the shard (a lost one never is)."""
        return shard not in self.lost and shard not in self._down_since

    def _lose(self, shard: int, reason: str) -> None:
        self.lost[shard] = reason
        names = []
        for child in self.children.get(shard, []):
            self.procs.retire(child)
            names.append(child.name)
        log.error("Redis shard %d lost (%s): its roles retired (%s); the trainers go on with the other shards",
                  shard, reason, ", ".join(names) or "none")
        print(f"Redis shard {shard} lost ({reason}): {', '.join(names) or 'no roles'} retired; training goes on "
              f"with shards {[i for i in range(len(self.urls)) if i not in self.lost]}", flush=True)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
