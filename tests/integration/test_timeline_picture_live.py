"""The timeline picture of a live namespace and of its export are the same picture.

On a real redis-server: the timeline scenario (an engine relaunched, three versions, four
rollouts) published with the real Publisher, a trainer that joins again, and two malformed
entries on the rollout stream that a real consumer group dead-letters half way through.
``rollout-bus replay timeline --live --html --png`` and ``rollout-bus replay timeline FILE
--html`` of its export draw the same data, and the planted restarts and dead letters are in it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from rollout_bus.events import schema as s
from rollout_bus.events.consume import Consumer, ConsumerConfig
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.replay import cli as replay
from rollout_bus.replay.exporter import export_log, read_live
from rollout_bus.replay.logfile import LogReader
from rollout_bus.replay.picture import picture
from tests.unit.test_timeline import POLICY, TRAIN, publish_scenario, scenario
from tests.unit.test_timeline_picture import embedded

pytestmark = pytest.mark.integration


def plant(client: redis.Redis, keys: Keys) -> None:
    steps = scenario()
    half = len(steps) // 2
    publish_scenario(client, keys, steps[:half])
    for raw in (b"\xc1 not msgpack", s.encode_bytes(s.RolloutRequested(
            producer=TRAIN, policy=POLICY, rollout_id=9, request_id="req-9", n_groups=1, n_samples_per_group=1))[:-3]):
        client.xadd(keys.rollout_stream, {b"e": raw})
    consumer = Consumer(client, keys, keys.rollout_stream, "executors", "x-0", ConsumerConfig(block_ms=0))
    consumer.run_until_idle(lambda msg: None)
    assert consumer.dead_lettered == 2  # the fault happened: both are in the dead-letter stream now
    rejoin = ("trainers", s.TrainerJoined(producer=TRAIN, policy=POLICY, trainer_id="t0", group="trainer-p0"))
    publish_scenario(client, keys, [*steps[half:], rejoin])


def test_the_live_namespace_and_its_export_give_the_same_picture_with_the_planted_restarts_and_dead_letters(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    plant(redis_client, keys)
    live = picture(read_live(redis_client, keys))
    assert [(m.kind, m.subject) for m in live.restarts] == [("engine", "e1"), ("trainer", "t0")]
    assert len(live.dead_letters) == 2
    assert all(m.kind == keys.rollout_stream and "group executors" in m.detail for m in live.dead_letters)
    assert live.start_ms < live.dead_letters[0].ms < live.end_ms  # half way through, not at an end
    assert [b.batch_id for b in live.batches] == ["batch-0", "batch-1", "batch-2"]
    assert [lane.engine_id for lane in live.lanes] == ["e0", "e1"]

    path = tmp_path / "run.rblog"
    export_log(redis_client, keys, path)
    with LogReader(path) as reader:
        assert picture(reader.entries()).to_dict() == live.to_dict()

    source = ["--redis-url", redis_server.url, "--namespace", keys.namespace]
    capsys.readouterr()
    assert replay.main(["timeline", "--live", *source, "--html", str(tmp_path / "live.html"),
                        "--png", str(tmp_path / "live.png")]) == 0
    said = json.loads(capsys.readouterr().out)
    assert (said["restarts"], said["dead_letters"], said["batches"], said["engines"]) == (2, 2, 3, 2)
    assert replay.main(["timeline", str(path), "--html", str(tmp_path / "file.html")]) == 0
    from_live = embedded((tmp_path / "live.html").read_text())
    assert from_live == embedded((tmp_path / "file.html").read_text()) == json.loads(json.dumps(live.to_dict()))
    assert (tmp_path / "live.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="--at-ms"):
        replay.main(["timeline", str(path), "--html", str(tmp_path / "x.html"), "--at-ms", "5"])
