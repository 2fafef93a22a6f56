"""The recorder: a group of its own, every batch of one policy written to disk and read back once."""

from __future__ import annotations

from pathlib import Path

import fakeredis
import msgpack
import torch

from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.rollouts import RolloutRequest
from rollout_bus.events.schema import Producer
from rollout_bus.executor.output import BatchSink
from rollout_bus.trainer.recorder import Recorder, RecorderConfig, read_recording
from tests.support.fake_rollouts import fake_batch


def publish(client: fakeredis.FakeRedis, keys: Keys, policy: str, rollout_id: int) -> str:
    sink = BatchSink(client, keys, Publisher(client, keys, Producer("executor", "x")))
    request = RolloutRequest(policy=policy, rollout_id=rollout_id, n_groups=2, n_samples_per_group=2,
                             request_id=f"{policy}-r{rollout_id}")
    return sink.publish(request, fake_batch(2, 2, rollout_id=rollout_id, version=rollout_id))


def test_the_recorder_writes_exactly_its_policys_batches(tmp_path: Path, keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    recorder = Recorder(client, keys, RecorderConfig(policy="alpha", out_dir=str(tmp_path / "rec")))
    recorder.start()
    ids = [publish(client, keys, "alpha", r) for r in range(3)]
    publish(client, keys, "beta", 0)
    assert recorder.drain() == 3
    recorder.drain()  # nothing new: nothing recorded twice
    recorded = list(read_recording(tmp_path / "rec"))
    assert [event["batch_id"] for event, _ in recorded] == ids
    for rollout_id, (event, data) in enumerate(recorded):
        original = fake_batch(2, 2, rollout_id=rollout_id, version=rollout_id)
        assert event["policy"] == "alpha" and len(data) == 4
        assert torch.equal(data.tokens.values, original.tokens.values)
        assert data.metadata["data_source"] == "fake-source"


def test_a_recorder_releases_payloads_so_the_last_reader_deletes_them(tmp_path: Path, keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    recorder = Recorder(client, keys, RecorderConfig(policy="alpha", out_dir=str(tmp_path / "rec")))
    recorder.start()
    publish(client, keys, "alpha", 0)
    recorder.drain()
    assert client.zcard(keys.payload_index) == 0  # the recorder was the only registered group


def test_a_forged_batch_id_that_climbs_out_of_the_directory_is_dead_lettered_and_writes_nothing(
        tmp_path: Path, keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    out = tmp_path / "rec"
    recorder = Recorder(client, keys, RecorderConfig(policy="alpha", out_dir=str(out)))
    recorder.start()
    stream = keys.batch_stream("alpha")
    client.sadd(keys.registered_groups(stream), "another-reader")  # the payload outlives the recorder's read
    publish(client, keys, "alpha", 0)
    (_, fields), = client.xrange(stream)
    real = msgpack.unpackb(fields[b"e"], raw=False)  # a real payload reference, a forged id
    forged = real | {"batch_id": "../escaped", "event_id": "f" * 32}
    client.xadd(stream, {b"e": msgpack.packb(forged, use_bin_type=True)})
    recorder.drain()
    assert not (tmp_path / "escaped.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec"]
    (_, letter), = client.xrange(keys.dead_letters)
    assert b"batch_id" in letter[b"reason"] and b"../escaped" in letter[b"reason"]
