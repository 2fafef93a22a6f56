"""A consumer process killed while holding entries: the other one in its group reclaims them."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import redis

from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import EngineReady, Producer
from tests.support.procs import spawn, stop, wait_for

pytestmark = pytest.mark.integration
PRODUCER = Producer("test", "0")


def held_by(client: redis.Redis, stream: str, group: str, name: str) -> list[str]:
    rows = client.xpending_range(stream, group, "-", "+", 1000, consumername=name)
    return [r["message_id"].decode() for r in rows]


def test_entries_held_by_a_killed_consumer_are_reclaimed_and_none_is_lost(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    stream, group, record = keys.rollout_stream, "workers", keys.prefix + ":test:processed"
    common = ["--url", redis_server.url, "--namespace", keys.namespace, "--stream", stream, "--group", group,
              "--record", record, "--sleep-ms", "40", "--count", "4", "--claim-idle-ms", "600",
              "--claim-every-ms", "100"]
    procs = {name: spawn("consumer_proc.py", *common, "--name", name, log_path=tmp_path / f"{name}.log")
             for name in ("victim", "survivor")}
    try:
        wait_for("both consumers to create the group", lambda: redis_client.sismember(
            keys.registered_groups(stream), group))
        pub = Publisher(redis_client, keys, PRODUCER)
        ids = [pub.publish(stream, EngineReady(producer=PRODUCER, engine_id=f"e{i}", url="u")) for i in range(40)]

        wait_for("the victim to handle an entry while holding others", lambda: any(
            line.startswith(b"victim ") for line in redis_client.lrange(record + ":log", 0, -1))
            and len(held_by(redis_client, stream, group, "victim")) >= 2)
        stop(procs["victim"], signal.SIGKILL)
        held = held_by(redis_client, stream, group, "victim")
        assert held, "the victim died holding nothing: the test proved nothing"

        wait_for("every entry to be handled and acked", lambda: redis_client.scard(record) == len(ids)
                 and int(redis_client.xpending(stream, group)["pending"]) == 0)
        assert {m.decode() for m in redis_client.smembers(record)} == set(ids)
        log = [line.decode().split() for line in redis_client.lrange(record + ":log", 0, -1)]
        by_survivor = {entry for who, entry in log if who == "survivor"}
        assert set(held) <= by_survivor
        assert held_by(redis_client, stream, group, "victim") == []
        assert redis_client.xlen(keys.dead_letters) == 0
        assert procs["survivor"].poll() is None
    finally:
        for proc in procs.values():
            stop(proc)
    assert procs["survivor"].returncode == 0, (tmp_path / "survivor.log").read_text()
