"""Hostile values in what the consumers write for the janitor (their group TTLs) and in the durability status."""

from __future__ import annotations

import json

import redis

from rollout_bus.events.groups import owner_alive
from rollout_bus.events.metrics import bus_snapshot
from rollout_bus.events.names import Keys


def test_a_malformed_group_ttl_is_no_ttl_and_never_stops_the_janitor(fake_client: redis.Redis, keys: Keys) -> None:
    stream = keys.batch_stream("p0")
    fake_client.xgroup_create(stream, "g", id="0", mkstream=True)
    for raw in ("x", "-5", "0"):
        fake_client.hset(keys.group_ttls(stream), "g", raw)
        assert owner_alive(fake_client, keys, stream, "g") is None  # taken as dead, not a ValueError


def test_a_durability_status_with_garbage_is_shown_not_trusted(fake_client: redis.Redis, keys: Keys) -> None:
    fake_client.hset(keys.durability_status, mapping={
        "executor/a": json.dumps({"what": "publish", "since_ms": "soon"}), "trainer/b": "not json"})
    degraded = bus_snapshot(fake_client, keys).degraded
    assert degraded["executor/a"]["since_ms"] is None and "not json" in degraded["trainer/b"]["what"]
