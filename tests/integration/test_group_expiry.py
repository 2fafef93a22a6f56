"""Group expiry against real consumer processes: a busy consumer keeps its group, and one paused past the
group's TTL whose group the janitor expired resumes without silent loss (entries delivered, or reported)."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis

from rollout_bus.events.consume import Consumer, ConsumerConfig
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.groups import parse_id
from rollout_bus.events.janitor import Janitor, JanitorConfig
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import EngineReady, GroupExpired, Producer, decode
from tests.support.procs import spawn, stop, wait_for

pytestmark = pytest.mark.integration
PRODUCER = Producer("test", "0")
TTL_S = 1.0


def handled(client: redis.Redis, record: str) -> list[str]:
    return [line.decode().split()[1] for line in client.lrange(record + ":log", 0, -1)]


def groups(client: redis.Redis, stream: str) -> list[str]:
    return [g["name"].decode() for g in client.xinfo_groups(stream)]


def consumer(url: str, keys: Keys, stream: str, record: str, log_path: Path, sleep_ms: float) -> subprocess.Popen[bytes]:
    return spawn("consumer_proc.py", "--url", url, "--namespace", keys.namespace, "--stream", stream,
                 "--group", "trainer", "--name", "c0", "--record", record, "--sleep-ms", str(sleep_ms),
                 "--group-ttl-s", str(TTL_S), "--start-id", "$", "--block-ms", "100", log_path=log_path)


def test_a_consumer_busy_longer_than_the_group_ttl_keeps_its_group(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    stream, record = keys.rollout_stream, keys.prefix + ":test:handled"
    proc = consumer(redis_server.url, keys, stream, record, tmp_path / "c0.log", sleep_ms=4 * TTL_S * 1000)
    try:
        wait_for("the group", lambda: redis_client.sismember(keys.registered_groups(stream), "trainer"))
        pub = Publisher(redis_client, keys, PRODUCER)
        janitor = Janitor(redis_client, keys, pub, JanitorConfig(max_len=None))
        b1 = pub.publish(stream, EngineReady(producer=PRODUCER, engine_id="b1", url="u"))
        wait_for("the consumer to be busy with b1", lambda: handled(redis_client, record) == [b1])
        busy_until = time.monotonic() + 3 * TTL_S
        while time.monotonic() < busy_until:  # it reads nothing for three TTLs: only its heartbeat speaks for it
            assert janitor.run_once().expired == []
            assert int(redis_client.xpending(stream, "trainer")["pending"]) == 1  # still inside its handler
            time.sleep(0.1)
        assert groups(redis_client, stream) == ["trainer"]
        b2 = pub.publish(stream, EngineReady(producer=PRODUCER, engine_id="b2", url="u"))
        wait_for("b2 handled by the same group", lambda: handled(redis_client, record) == [b1, b2], 15)
    finally:
        stop(proc)


@pytest.mark.parametrize("trimmed", [False, True], ids=["entries-kept", "entry-trimmed"])
def test_a_consumer_paused_past_the_ttl_whose_group_expired_resumes_without_silent_loss(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys, tmp_path: Path, trimmed: bool) -> None:
    stream, record = keys.rollout_stream, keys.prefix + ":test:handled"
    proc = consumer(redis_server.url, keys, stream, record, tmp_path / "c0.log", sleep_ms=0)
    try:
        wait_for("the group", lambda: redis_client.sismember(keys.registered_groups(stream), "trainer"))
        pub = Publisher(redis_client, keys, PRODUCER)
        janitor = Janitor(redis_client, keys, pub, JanitorConfig(max_len=None))
        b1 = pub.publish(stream, EngineReady(producer=PRODUCER, engine_id="b1", url="u"))
        wait_for("b1 handled and acked", lambda: handled(redis_client, record) == [b1]
                 and int(redis_client.xpending(stream, "trainer")["pending"]) == 0)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            expired: list[GroupExpired] = []
            wait_for("the janitor to expire the paused consumer's group",
                     lambda: bool(expired.extend(janitor.run_once().expired) or expired), 10 * TTL_S, 0.1)
            assert [(e.group, e.stream) for e in expired] == [("trainer", "rollouts")]
            assert groups(redis_client, stream) == []  # the fault landed: the group is gone
            b2 = pub.publish(stream, EngineReady(producer=PRODUCER, engine_id="b2", url="u"))
            b3 = pub.publish(stream, EngineReady(producer=PRODUCER, engine_id="b3", url="u"))
            if trimmed:  # retention moved on while nobody held the stream: b2 cannot come back
                redis_client.xtrim(stream, maxlen=1, approximate=False)
                assert [e[0].decode() for e in redis_client.xrange(stream)] == [b3]
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        if not trimmed:
            wait_for("b2 and b3 delivered after the pause", lambda: handled(redis_client, record) == [b1, b2, b3], 15)
            assert redis_client.xlen(keys.dead_letters) == 0
        else:
            wait_for("b3 delivered after the pause", lambda: handled(redis_client, record) == [b1, b3], 15)
            (note,) = redis_client.xrange(keys.dead_letters)
            reason = note[1][b"reason"].decode()
            assert "up to " in reason and "not delivered" in reason, reason
            assert "1 entry up to" in reason, reason  # counted: b2 alone
            lost_to = reason.split("up to ")[1].split()[0]
            assert parse_id(b1) < parse_id(b2) <= parse_id(lost_to) < parse_id(b3)  # b2 is named lost, b3 not
            assert note[1][b"group"] == b"trainer" and note[1][b"entry_id"].decode() == b1
        assert groups(redis_client, stream) == ["trainer"]
        assert decode(redis_client.xrange(keys.housekeeping_stream)[0][1]).group == "trainer"  # type: ignore[attr-defined]
    finally:
        stop(proc)
    assert "recreated after" in (tmp_path / "c0.log").read_text()


def test_a_consumer_dropped_without_close_stops_beating(redis_client: redis.Redis, keys: Keys) -> None:
    """The heartbeat thread holds its consumer weakly: dropping the consumer ends it, so its group can lapse."""
    consumer = Consumer(redis_client, keys, keys.weight_stream("default"), "dropped", "c0",
                        ConsumerConfig(block_ms=1, group_ttl_s=0.2))
    consumer.ensure_group()
    consumer.read()
    heartbeat = consumer._heartbeat
    assert heartbeat is not None and heartbeat.alive
    del consumer
    gc.collect()
    wait_for("the heartbeat thread to end", lambda: not heartbeat.alive, 3)


def test_a_restarted_consumer_whose_group_expired_resumes_where_the_janitor_found_it_not_at_the_tail(
        redis_client: redis.Redis, keys: Keys) -> None:
    """A process that left (closed), came back after its group expired, and starts with ``$``: it still gets
    the entries published while its group was gone, from where the janitor recorded the group stood."""
    stream = keys.weight_stream("default")
    cfg = ConsumerConfig(block_ms=1, group_ttl_s=0.2, start_id="$")
    pub = Publisher(redis_client, keys, PRODUCER)
    first = Consumer(redis_client, keys, stream, "trainer", "c0", cfg)
    first.ensure_group()
    b1 = pub.publish(stream, EngineReady(producer=PRODUCER, engine_id="b1", url="u"))
    assert [m.id for m in first.read()] == [b1]
    first.ack(b1)
    first.close()
    janitor = Janitor(redis_client, keys, pub, JanitorConfig(max_len=None))
    expired: list[GroupExpired] = []
    wait_for("the group to expire", lambda: bool(expired.extend(janitor.run_once().expired) or expired), 5, 0.05)
    assert groups(redis_client, stream) == []
    b2 = pub.publish(stream, EngineReady(producer=PRODUCER, engine_id="b2", url="u"))
    again = Consumer(redis_client, keys, stream, "trainer", "c0", cfg)  # a new process: nothing in memory
    again.ensure_group()
    assert [m.id for m in again.read()] == [b2]
    assert again.recreated == 1 and not redis_client.hexists(keys.expired_groups(stream), "trainer")
    again.close()
