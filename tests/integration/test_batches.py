"""BatchChannel on a real redis-server with consumer groups, a consumer in another process, each store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from rollout_bus.events.batch import Ragged
from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.consume import Consumer, ConsumerConfig
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.errors import PayloadMissing
from rollout_bus.events.names import Keys
from rollout_bus.events.payload import PayloadStore, ShmStore, make_store
from rollout_bus.events.publish import Publisher
from rollout_bus.events.schema import BatchReady, Producer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
POLICY = "pol"

CHILD = """
import json, sys
from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.connection import connect
from rollout_bus.events.consume import Consumer, ConsumerConfig
from rollout_bus.events.names import Keys
from rollout_bus.events.payload import make_store
url, jobs = sys.argv[1], json.loads(sys.argv[2])
client = connect(url)
out = []
for spec, namespace in jobs:
    keys = Keys(namespace)
    channel = BatchChannel(client, keys, make_store(spec, client, keys))
    consumer = Consumer(client, keys, keys.batch_stream("pol"), "group-a", "child-0", ConsumerConfig(block_ms=2000))
    (msg,) = consumer.read()
    batch = channel.fetch(msg.event)
    out.append({"tokens": [r.tolist() for r in batch.ragged["tokens"].to_list()],
                "rewards": batch.tensors["rewards"].tolist(), "meta": batch.meta})
    consumer.ack(msg.id)
    out[-1]["last"] = channel.release(msg.event, "group-a")
print(json.dumps(out))
"""


def tensors() -> dict[str, torch.Tensor | Ragged]:
    return {"tokens": Ragged.from_list([torch.arange(9, dtype=torch.int32), torch.arange(2, dtype=torch.int32)]),
            "rewards": torch.tensor([0.5, -0.25])}


@pytest.fixture(params=["redis", "shm", "file"])
def spec(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield request.param if request.param != "file" else f"file:{tmp_path}"


def channel(client: redis.Redis, keys: Keys, spec: str) -> BatchChannel:
    return BatchChannel(client, keys, make_store(spec, client, keys),
                        Publisher(client, keys, Producer("executor", "e0")), payload_ttl_s=600)


def group(client: redis.Redis, keys: Keys, name: str) -> Consumer:
    consumer = Consumer(client, keys, keys.batch_stream(POLICY), name, f"{name}-0", ConsumerConfig(block_ms=500))
    consumer.ensure_group()
    return consumer


def cleanup(store: PayloadStore) -> None:
    if isinstance(store, ShmStore):
        store.clear_pool()
        shutil.rmtree(store.root, ignore_errors=True)
    store.close()


def gone(ch: BatchChannel, event: BatchReady) -> bool:
    try:
        ch.fetch(event)
    except PayloadMissing:
        return True
    return False


def test_two_groups_one_in_another_process_read_the_batch_and_the_last_release_deletes_it(
        redis_server: RedisServer, redis_client: redis.Redis, keys: Keys, spec: str) -> None:
    ch = channel(redis_client, keys, spec)
    group(redis_client, keys, "group-a")
    b = group(redis_client, keys, "group-b")
    ch.publish(POLICY, "b1", tensors(), {"rollout": 1})
    proc = subprocess.run([sys.executable, "-c", CHILD, redis_server.url, json.dumps([[spec, keys.namespace]])],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    (seen,) = json.loads(proc.stdout)
    assert seen == {"tokens": [list(range(9)), [0, 1]], "rewards": [0.5, -0.25], "meta": {"rollout": 1},
                    "last": False}
    (msg,) = b.read()
    assert ch.readers(msg.event.payload["ref"]) == {"group-b"}
    assert isinstance(msg.event, BatchReady)
    batch = ch.fetch(msg.event)
    b.ack(msg.id)
    assert ch.release(msg.event, "group-b") is True
    assert batch.tensors["rewards"].tolist() == [0.5, -0.25]  # what was fetched stays valid
    assert gone(ch, msg.event)
    assert redis_client.zcard(keys.payload_index) == 0
    cleanup(ch.store)


def test_a_retried_publish_leaves_one_entry_and_one_payload_even_after_release(
        redis_client: redis.Redis, keys: Keys, spec: str) -> None:
    ch = channel(redis_client, keys, spec)
    a = group(redis_client, keys, "group-a")
    first = ch.publish(POLICY, "b1", tensors())
    assert ch.publish(POLICY, "b1", tensors()) == first
    assert redis_client.xlen(keys.batch_stream(POLICY)) == 1
    (msg,) = a.read()
    assert isinstance(msg.event, BatchReady)
    assert ch.release(msg.event, "group-a") is True
    assert ch.publish(POLICY, "b1", tensors()) == first
    assert gone(ch, msg.event)
    assert redis_client.keys(f"{keys.prefix}:payload:*") == []
    cleanup(ch.store)


def test_delete_expired_deletes_a_payload_a_dead_group_never_released(redis_client: redis.Redis, keys: Keys,
                                                             spec: str) -> None:
    ch = channel(redis_client, keys, spec)
    group(redis_client, keys, "dead")
    live = group(redis_client, keys, "live")
    ch.publish(POLICY, "b1", tensors())
    (msg,) = live.read()
    assert isinstance(msg.event, BatchReady)
    assert ch.release(msg.event, "live") is False
    assert ch.delete_expired(max_age_s=3600) == 0 and not gone(ch, msg.event)
    ref = msg.event.payload["ref"]
    if spec == "redis":
        assert 0 < int(redis_client.ttl(keys.payload_chunk(ref, 0))) <= 600  # TTL backstop
    assert ch.delete_expired(max_age_s=0) >= 1
    assert gone(ch, msg.event)
    assert redis_client.zcard(keys.payload_index) == 0
    assert not redis_client.exists(keys.payload_readers(ref))
    cleanup(ch.store)


def test_a_publish_run_again_after_its_wait_fell_short_keeps_the_payload_its_entry_points_to(
        redis_client: redis.Redis, keys: Keys, spec: str) -> None:
    """With a replica asked for and none there, each ``WAIT`` falls short and the same publish (same
    ref) runs again: the repeat finds its own entry and must not delete the bytes that entry names."""
    from rollout_bus.events.connection import Durability
    from rollout_bus.events.errors import ReplicationTimeout

    ch = channel(redis_client, keys, spec)
    consumer = group(redis_client, keys, "trainer")
    ch.publisher.durability = Durability(replicas=1, timeout_ms=20, attempts=3)
    with pytest.raises(ReplicationTimeout):
        ch.publish(POLICY, "b1", tensors(), {"rollout": 1})
    assert redis_client.xlen(keys.batch_stream(POLICY)) == 1  # the first try appended it; the repeats did not
    ch.publisher.durability = Durability()  # the writer tries again without replicas: the existing entry
    entry = ch.publish(POLICY, "b1", tensors(), {"rollout": 1})
    msgs = consumer.read()
    assert [m.id for m in msgs] == [entry]
    batch = ch.fetch(msgs[0].event)  # type: ignore[arg-type]
    assert torch.equal(batch.tensor("rewards"), torch.tensor([0.5, -0.25]))
    cleanup(ch.store)
