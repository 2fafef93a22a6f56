"""Payload stores against a real redis-server and across processes."""

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

from rollout_bus.events.batch import decode, encode
from rollout_bus.events.connection import connect
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.errors import ChecksumMismatch, PayloadMissing, RedisCommandError
from rollout_bus.events.names import Keys
from rollout_bus.events.payload import PayloadStore, RedisStore, ShmStore, make_store

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
import torch
from rollout_bus.events.batch import decode
from rollout_bus.events.connection import connect
from rollout_bus.events.names import Keys
from rollout_bus.events.payload import make_store
url, namespace, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
client = connect(url)
out = []
for spec, reference in jobs:
    batch = decode(make_store(spec, client, Keys(namespace)).get(reference))
    out.append({"sums": {k: float(v.double().sum()) for k, v in batch.tensors.items()}, "meta": batch.meta})
print(json.dumps(out))
"""


def fields(seed: int, n: int = 300_000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, 50_000, (n,), dtype=torch.int32, generator=g),
            "ids": torch.arange(n // 3, dtype=torch.int64),
            "logp": torch.randn(n // 2, generator=g),
            "adv": torch.randn(n // 5, generator=g).to(torch.bfloat16)}


def sums(t: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float(v.double().sum()) for k, v in t.items()}


def run_child(url: str, namespace: str, jobs: list[tuple[str, dict[str, object]]]) -> list[dict[str, object]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", CHILD, url, namespace, json.dumps(jobs)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


@pytest.fixture()
def stores(redis_client: redis.Redis, keys: Keys, tmp_path: Path) -> Iterator[dict[str, PayloadStore]]:
    made = {"redis?chunk_kib=256": make_store("redis?chunk_kib=256", redis_client, keys),
            "shm": make_store("shm", redis_client, keys),
            f"file:{tmp_path}": make_store(f"file:{tmp_path}", redis_client, keys)}
    yield made
    shm = made["shm"]
    assert isinstance(shm, ShmStore)
    shm.clear_pool()
    shutil.rmtree(shm.root, ignore_errors=True)
    for store in made.values():
        store.close()


def test_every_store_hands_a_batch_to_another_process(redis_server: RedisServer, keys: Keys,
                                                      stores: dict[str, PayloadStore]) -> None:
    jobs = []
    expected = []
    for i, (spec, store) in enumerate(stores.items()):
        t = fields(i)
        jobs.append((spec, store.put(f"pol:b{i}", encode(t, {"spec": spec}), ttl_s=60)))
        expected.append({"sums": sums(t), "meta": {"spec": spec}})
    assert run_child(redis_server.url, keys.namespace, jobs) == expected


def test_the_raw_redis_store_round_trips_payloads_of_many_chunks(redis_client: redis.Redis, keys: Keys) -> None:
    store = RedisStore(redis_client, keys, chunk_bytes=1 << 20, window=3)
    for n in (10, 262_144, 3_000_001):  # one chunk, exactly one chunk of data, many chunks
        t = {"x": torch.arange(n, dtype=torch.int32)}
        reference = store.put(f"pol:n{n}", encode(t), ttl_s=30)
        assert torch.equal(decode(store.get(reference)).tensors["x"], t["x"])
        assert 0 < int(redis_client.ttl(keys.payload_chunk(f"pol:n{n}", 0))) <= 30
    store.close()


def test_a_corrupted_chunk_of_the_raw_redis_store_is_a_checksum_mismatch(redis_client: redis.Redis,
                                                                         keys: Keys) -> None:
    store = RedisStore(redis_client, keys, chunk_bytes=1 << 18, window=4)
    t = fields(4, n=2_000_000)  # about 13 MiB: several hash pieces over many chunks, lines read in place
    reference = store.put("pol:b1", encode(t, {"k": 1}), ttl_s=30)
    batch = decode(store.get(reference))
    assert sums(batch.tensors) == sums(t) and batch.meta == {"k": 1}
    key = keys.payload_chunk("pol:b1", 7)
    chunk = bytearray(redis_client.get(key))
    chunk[1000] ^= 0x01
    redis_client.set(key, bytes(chunk))
    with pytest.raises(ChecksumMismatch):
        decode(store.get(reference))
    again = store.put("pol:b2", encode(t), ttl_s=30)  # the connection is still in step
    assert sums(decode(store.get(again)).tensors) == sums(t)
    store.close()


def test_a_missing_chunk_is_payload_missing_and_the_connection_stays_usable(redis_client: redis.Redis,
                                                                            keys: Keys) -> None:
    store = RedisStore(redis_client, keys, chunk_bytes=1 << 16)
    t = fields(1, n=100_000)
    reference = store.put("pol:b1", encode(t), ttl_s=30)
    redis_client.delete(keys.payload_chunk("pol:b1", 2))
    with pytest.raises(PayloadMissing, match="pol:b1"):
        store.get(reference)
    again = store.put("pol:b2", encode(t), ttl_s=30)
    assert sums(decode(store.get(again)).tensors) == sums(t)


def test_the_raw_redis_store_reconnects_after_its_connection_is_killed(redis_client: redis.Redis,
                                                                       keys: Keys) -> None:
    store = RedisStore(redis_client, keys)
    t = fields(2, n=1000)
    reference = store.put("pol:b1", encode(t), ttl_s=30)
    redis_client.client_kill_filter(_type="normal", skipme=True)
    assert sums(decode(store.get(reference)).tensors) == sums(t)


def test_the_raw_connection_authenticates_and_selects_the_database_of_the_url(keys: Keys) -> None:
    with RedisServer() as server:
        connect(server.url).config_set("requirepass", "s3cret")  # set late: the readiness probe sends no AUTH
        url = f"redis://:s3cret@127.0.0.1:{server.port}/3"
        client = connect(url)
        store = RedisStore(client, keys)
        reference = store.put("pol:b1", encode({"x": torch.ones(4)}), ttl_s=30)
        assert client.exists(keys.payload_chunk("pol:b1", 0))  # db 3, where the client looks
        assert not connect(url.replace("/3", "/0")).exists(keys.payload_chunk("pol:b1", 0))
        assert torch.equal(decode(store.get(reference)).tensors["x"], torch.ones(4))

        client.acl_setuser("trainer", enabled=True, passwords=["+pw2"], keys=["*"], commands=["+@all"])
        user_client = connect(f"redis://trainer:pw2@127.0.0.1:{server.port}/3")
        assert torch.equal(decode(RedisStore(user_client, keys).get(reference)).tensors["x"], torch.ones(4))

        wrong = RedisStore(connect(f"redis://:nope@127.0.0.1:{server.port}/3"), keys)
        with pytest.raises(RedisCommandError):
            wrong.get(reference)
        for s in (store, wrong):
            s.close()
