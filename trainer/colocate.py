"""Colocated training (miles' ``train.py`` colocate loop): the engines give their memory back while the trainer steps.

In sync mode with ``--colocate``, each step goes: rollout, then ``offload`` (the pool's weights and KV cache
released), train, publish, then ``onload`` (the weights first, then the KV cache: miles' order), then wait
until the new version is served. Each is a command to the controller (``OffloadEngines`` /
``OnloadEngines`` naming this trainer's policy and a ``request_id``) that the trainer waits on: the
controller's ``CommandDone`` answer comes on the engine stream once every engine of the pool did it. The
time each took is in the step's metrics (``offload_ms``, ``onload_ms``).

Onloading the KV cache is what brings an engine back to serving: the controller then gives it the newest
version (the one just published) before it serves, so the next rollout runs on it.
"""

from __future__ import annotations

import logging
import os
import time

from rollout_bus.events.connection import Redis
from rollout_bus.events.errors import DecodeError
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import Registry
from rollout_bus.events.schema import CommandDone, OffloadEngines, OnloadEngines, Producer, decode

log = logging.getLogger(__name__)

OFFLOAD = ("weights", "kv_cache")
ONLOAD_ORDER = (("weights",), ("kv_cache",))
"""miles' order: the weights come back first, then the KV cache."""


class ColocationFailed(RuntimeError):
    """The controller refused or failed an offload or onload, or did not answer in time."""


class Colocation:
    def __init__(self, client: Redis, keys: Keys, producer: Producer, policy: str, *, timeout_s: float = 300.0) -> None:
        self.client = client
        self.keys = keys
        self.producer = producer
        self.policy = policy
        self.timeout_s = timeout_s
        self.publisher = Publisher(client, keys, producer)

    def offload(self) -> float:
        """Release the pool's weights and KV cache; the seconds it took."""
        return self._ask(OffloadEngines, list(OFFLOAD))

    def onload(self) -> float:
        """Bring the weights back, then the KV cache (the engines serve the newest version again)."""
        return sum(self._ask(OnloadEngines, list(tags)) for tags in ONLOAD_ORDER)

    def any_offloaded(self) -> bool:
        """Whether an engine is offloaded now (a trainer restarted between its offload and its onload)."""
        return any(r.state == "offloaded" for r in Registry(self.client, self.keys).engines().values())

    def _ask(self, command: type[OffloadEngines] | type[OnloadEngines], tags: list[str]) -> float:
        started = time.monotonic()
        request_id = f"colocate-{os.urandom(6).hex()}"
        event = command(producer=self.producer, tags=tags, policy=self.policy, request_id=request_id)
        cursor = self.publisher.publish(self.keys.command_stream, event).split("-")[0] + "-0"
        deadline = started + self.timeout_s
        while time.monotonic() < deadline:
            for entry_id, fields in page(self.client, self.keys.engine_stream, cursor):
                cursor = "(" + entry_id
                try:
                    answer = decode(fields)
                except DecodeError:
                    continue
                if isinstance(answer, CommandDone) and answer.request_id == request_id:
                    if answer.outcome != "ok":
                        raise ColocationFailed(f"{answer.command} {tags} of {self.policy}'s engines: {answer.outcome}: "
                                               f"{answer.reason}")
                    elapsed = time.monotonic() - started
                    log.info("%s %s of %s's engines in %.3f s: %s", answer.command, tags, self.policy, elapsed,
                             answer.results)
                    return elapsed
            time.sleep(0.02)
        raise ColocationFailed(f"no answer to {command.__name__} {tags} within {self.timeout_s:g} s (is a controller "
                               "running?)")
