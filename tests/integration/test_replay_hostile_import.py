"""Importing hostile logs into a real redis-server: an id that would stop every later publish is
remapped, and a malformed log is a one-line exit 2 before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys, stream_key
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import EngineServing
from rollout_bus.replay import cli as replay_cli
from tests.unit.test_replay_hostile_logs import END, HEADER, PRODUCER, entry, event_fields, write

pytestmark = pytest.mark.integration

TOP = "18446744073709551615-18446744073709551615"


def test_the_greatest_entry_id_is_remapped_and_later_publishes_on_the_stream_work(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "top.rblog", HEADER, entry("1000-0"), entry(TOP, fields=event_fields(1)), END)
    argv = ["import", str(path), "--namespace", keys.namespace, "--redis-url", redis_server.url, "--no-payloads"]
    assert replay_cli.main(argv) == 0
    assert '"engines": false' in capsys.readouterr().out  # ids_preserved: the stream was remapped
    target = stream_key(keys, "engines")
    ids = [i.decode() for i, _ in redis_client.xrange(target)]
    assert len(ids) == 2 and ids[0] == "1000-0" and ids[1] != TOP
    Publisher(redis_client, keys, PRODUCER).publish(target, EngineServing(
        producer=PRODUCER, engine_id="e9", url="http://e", versions={"p": 1}))
    redis_client.xadd(target, {"x": "1"})  # and a plain XADD with an automatic id
    assert redis_client.xlen(target) == 4


def test_a_malformed_log_is_not_imported(redis_server: RedisServer, redis_client: redis.Redis, keys: Keys,
                                         tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "bad.rblog", HEADER, entry("1000-0"), {"kind": "entry", "stream": "engines"}, END)
    argv = ["import", str(path), "--namespace", keys.namespace, "--redis-url", redis_server.url, "--no-payloads"]
    assert replay_cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "entry has no 'id'" in err
