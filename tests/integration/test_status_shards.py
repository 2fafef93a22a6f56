"""``rollout-bus status --redis-url A,B,C``: each shard's Redis (real servers), one that does not answer named."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from rollout_bus import status
from rollout_bus.events.connection import connect
from rollout_bus.events.embedded import RedisServer, free_port
from rollout_bus.events.names import Keys
from rollout_bus.events.registry import EngineRecord, EngineState, Registry

pytestmark = pytest.mark.integration


@pytest.fixture()
def servers() -> Iterator[list[RedisServer]]:
    started = [RedisServer().start() for _ in range(2)]
    yield started
    for s in started:
        s.stop()


def test_status_shows_each_shard_and_names_the_one_that_does_not_answer(
        servers: list[RedisServer], keys: Keys, capsys: pytest.CaptureFixture[str]) -> None:
    for i, server in enumerate(servers):
        client = connect(server.url)
        Registry(client, keys).put_engine(EngineRecord(engine_id=f"engine-s{i}", url=f"http://127.0.0.1:{9000 + i}",
                                                       state=EngineState.SERVING, versions={"p0": i}))
        client.close()
    gone = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there: a lost shard

    code = status.main(["--redis-url", f"{servers[0].url},{servers[1].url},{gone}", "--namespace", keys.namespace,
                        "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 2  # one shard could not be read
    shards = doc["shards"]
    assert [s["shard"] for s in shards] == [0, 1, 2]
    assert [list(s["snapshot"]["engines"]) for s in shards[:2]] == [["engine-s0"], ["engine-s1"]]
    assert "snapshot" not in shards[2] and shards[2]["error"]

    bare = [s.url.removesuffix("/0") for s in servers]  # redis://host:port, no db: split at the comma, not in a port
    code = status.main(["--redis-url", ",".join(bare), "--namespace", keys.namespace])
    text = capsys.readouterr().out
    assert code == 0
    assert "== shard 0" in text and "== shard 1" in text and "engine-s0" in text and "engine-s1" in text


def test_status_refuses_what_reads_one_redis_over_shards(servers: list[RedisServer]) -> None:
    with pytest.raises(SystemExit) as refused:
        status.parse_args(["--redis-url", f"{servers[0].url},{servers[1].url}", "--check-weights"])
    assert refused.value.code == 2
    with pytest.raises(SystemExit):
        status.parse_args(["--redis-url", f"{servers[0].url},{servers[0].url}"])  # the same Redis twice
