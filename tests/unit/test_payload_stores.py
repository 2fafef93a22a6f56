"""Payload stores without a server: redis (through fakeredis), file and shm (in temp dirs); specs; RESP framing."""

from __future__ import annotations

import fcntl
import gc
import os
import time
from pathlib import Path

import pytest
import redis
import torch

from rollout_bus.events.batch import decode, encode
from rollout_bus.events.errors import DecodeError, InvalidRequest, PayloadMissing
from rollout_bus.events.names import Keys
from rollout_bus.events.payload import (
    FileStore,
    PayloadStore,
    RedisStore,
    ShmStore,
    StoreSpec,
    make_ref,
    make_store,
)
from rollout_bus.events.payload.redis import split_chunks
from rollout_bus.events.payload.resp import BIG_ARG, Address, pack_command
from rollout_bus.events.payload.shm import capacity_for


def fields(seed: int = 0, n: int = 5000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randint(0, 1 << 30, (n,), dtype=torch.int32, generator=g),
            "b": torch.randn(n // 2, generator=g).to(torch.bfloat16)}


@pytest.fixture(params=["redis", "file", "shm"])
def store(request: pytest.FixtureRequest, fake_client: redis.Redis, keys: Keys, tmp_path: Path) -> PayloadStore:
    if request.param == "redis":
        return RedisStore(fake_client, keys, chunk_bytes=4096)
    if request.param == "file":
        return FileStore(tmp_path, keys)
    return ShmStore(keys, tmp_path)


def test_every_store_round_trips_a_batch_and_forgets_it_on_delete(store: PayloadStore) -> None:
    ref = make_ref("pol", "b1")
    t = fields()
    reference = store.put(ref, encode(t, {"m": 1}), ttl_s=60)
    assert reference["store"] == store.name and reference["ref"] == ref
    batch = decode(store.get(reference))
    assert batch.meta == {"m": 1} and all(torch.equal(batch.tensors[k], v) for k, v in t.items())
    store.delete(reference)
    store.delete(reference)  # deleting twice is fine
    with pytest.raises(PayloadMissing, match="pol:b1"):
        store.get(reference)


def test_a_second_put_of_the_same_ref_replaces_the_payload(store: PayloadStore) -> None:
    ref = make_ref("pol", "b1")
    store.put(ref, encode(fields(1)), ttl_s=60)
    reference = store.put(ref, encode(fields(2)), ttl_s=60)
    assert torch.equal(decode(store.get(reference)).tensors["a"], fields(2)["a"])


@pytest.mark.parametrize("reference", [
    {"store": "redis", "ref": "../../etc/passwd"},
    {"store": "redis", "ref": "no-colon"},
    {"store": "redis", "ref": 5},
    {"store": "shm", "ref": "pol:b1"},
])
def test_a_reference_that_is_not_for_this_store_or_not_a_ref_is_a_decode_error(
        fake_client: redis.Redis, keys: Keys, reference: dict[str, object]) -> None:
    with pytest.raises(DecodeError):
        RedisStore(fake_client, keys).get(reference)


def test_the_redis_store_splits_a_payload_into_chunk_keys_each_with_a_ttl(fake_client: redis.Redis,
                                                                          keys: Keys) -> None:
    store = RedisStore(fake_client, keys, chunk_bytes=4096)
    enc = encode(fields())
    reference = store.put("pol:b1", enc, ttl_s=77)
    assert reference["chunks"] == (enc.nbytes + 4095) // 4096 > 1
    names = store.redis_keys(reference)
    assert names == [keys.payload_chunk("pol:b1", i) for i in range(reference["chunks"])]
    assert all(0 < int(fake_client.ttl(n)) <= 77 for n in names)
    assert b"".join(fake_client.mget(names)) == enc.tobytes()
    fake_client.delete(names[1])
    with pytest.raises(PayloadMissing):
        store.get(reference)


def test_the_redis_store_deletes_chunks_of_a_rebuilt_reference_by_probing(fake_client: redis.Redis,
                                                                          keys: Keys) -> None:
    store = RedisStore(fake_client, keys, chunk_bytes=4096)
    store.put("pol:b1", encode(fields(n=100_000)), ttl_s=60)
    assert len(fake_client.keys("*payload*")) > 64
    store.delete(store.locate("pol:b1"))
    assert fake_client.keys("*payload*") == []


def test_split_chunks_cuts_at_every_boundary_without_copying() -> None:
    a, b = bytearray(b"abcdefg"), bytearray(b"hij")
    chunks = split_chunks([a, b], 4)
    assert [b"".join(bytes(p) for p in c) for c in chunks] == [b"abcd", b"efgh", b"ij"]
    a[0] = ord("z")
    assert bytes(chunks[0][0])[:1] == b"z"
    assert split_chunks([], 4) == [[]]


def test_file_store_writes_atomically_and_deletes_old_files(keys: Keys, tmp_path: Path) -> None:
    store = FileStore(tmp_path, keys)
    ref = store.put("pol:b1", encode(fields()), ttl_s=60)
    store.put("pol:b2", encode(fields()), ttl_s=60)
    assert sorted(os.listdir(store.root)) == ["pol:b1", "pol:b2"]  # no temp files left behind
    old = time.time() - 3600
    os.utime(store.path("pol:b1"), (old, old))
    assert store.delete_expired(older_than_s=600) == 1
    with pytest.raises(PayloadMissing):
        store.get(ref)
    assert store.path("pol:b2").exists()


def test_shm_store_recycles_a_released_segment_for_the_next_batch(keys: Keys, tmp_path: Path) -> None:
    store = ShmStore(keys, tmp_path)
    r1 = store.put("pol:b1", encode(fields(1)), ttl_s=60)
    inode = os.stat(store.path("pol:b1")).st_ino
    store.delete(r1)
    assert len(os.listdir(store.free_dir)) == 1
    r2 = store.put("pol:b2", encode(fields(2)), ttl_s=60)
    assert os.stat(store.path("pol:b2")).st_ino == inode
    assert os.listdir(store.free_dir) == []
    assert torch.equal(decode(store.get(r2)).tensors["a"], fields(2)["a"])


def test_a_batch_verified_with_hash_helpers_and_released_at_once_recycles_its_segment(
        keys: Keys, tmp_path: Path) -> None:
    # 32 MiB: verifying it starts hash helper threads, whose views of the mapping must be gone by then
    store = ShmStore(keys, tmp_path)
    big = {"a": torch.arange(8 << 20, dtype=torch.int32)}
    first = store.put("pol:b0", encode(big), ttl_s=60)
    inode = os.stat(store.path("pol:b0")).st_ino
    reference = first
    for i in range(1, 7):
        batch = decode(store.get(reference))  # verify=True
        assert int(batch.tensors["a"][-1]) == (8 << 20) - 1
        del batch
        store.delete(reference)
        assert len(os.listdir(store.free_dir)) == 1, f"round {i}: the segment was unlinked, not recycled"
        reference = store.put(f"pol:b{i}", encode(big), ttl_s=60)
        assert os.stat(store.path(f"pol:b{i}")).st_ino == inode
    store.clear_pool()


@pytest.mark.parametrize("reads", ["private", "shared"])
def test_shm_store_never_recycles_a_segment_a_reader_still_maps(keys: Keys, tmp_path: Path, reads: str) -> None:
    store = ShmStore(keys, tmp_path, reads=reads)  # type: ignore[arg-type]
    r1 = store.put("pol:b1", encode(fields(1)), ttl_s=60)
    batch = decode(store.get(r1))
    path = store.path("pol:b1")
    fd = os.open(path, os.O_RDONLY)
    store.delete(r1)
    assert not path.exists() and os.listdir(store.free_dir) == []  # unlinked, not pooled
    store.put("pol:b2", encode(fields(2)), ttl_s=60)
    assert torch.equal(batch.tensors["a"], fields(1)["a"])  # the reader's bytes did not change
    with pytest.raises(BlockingIOError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    del batch
    gc.collect()
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the reader's lock went with its last tensor
    os.close(fd)


def test_shm_store_refuses_a_payload_of_another_host(keys: Keys, tmp_path: Path) -> None:
    store = ShmStore(keys, tmp_path)
    reference = dict(store.put("pol:b1", encode(fields()), ttl_s=60), host="elsewhere")
    with pytest.raises(PayloadMissing, match="elsewhere"):
        store.get(reference)


def test_shm_pool_is_bounded_and_idle_segments_are_swept(keys: Keys, tmp_path: Path) -> None:
    store = ShmStore(keys, tmp_path, pool_bytes=1 << 20)
    refs = [store.put(f"pol:b{i}", encode(fields(i)), ttl_s=60) for i in range(3)]
    for r in refs:
        store.delete(r)
    assert len(os.listdir(store.free_dir)) == 1  # 1 MiB segments, 1 MiB pool
    old = time.time() - 3600
    for name in os.listdir(store.free_dir):
        os.utime(store.free_dir / name, (old, old))
    assert store.delete_expired(older_than_s=600) == 1
    assert os.listdir(store.free_dir) == []
    store.close()


def test_capacity_rounds_up_with_bounded_waste() -> None:
    assert capacity_for(1) == 1 << 20
    for n in (3 << 20, 64 << 20, (64 << 20) + 200, 1_000_000_007):
        cap = capacity_for(n)
        assert n <= cap <= n * 1.13 + (1 << 20)


@pytest.mark.parametrize("spec, kind, path, options", [
    ("redis", "redis", None, {}),
    ("redis?chunk_kib=512&window=4", "redis", None, {"chunk_kib": "512", "window": "4"}),
    ("shm", "shm", None, {}),
    ("shm:/dev/shm/x?pool_mib=64", "shm", "/dev/shm/x", {"pool_mib": "64"}),
    ("file:/mnt/shared", "file", "/mnt/shared", {}),
])
def test_store_specs_parse(spec: str, kind: str, path: str | None, options: dict[str, str]) -> None:
    assert StoreSpec.parse(spec) == StoreSpec(kind, path, options)  # type: ignore[arg-type]


@pytest.mark.parametrize("spec, message", [
    ("s3", "unknown"),
    ("redis?chunk=1", r"no option \['chunk'\].*chunk_kib"),
    ("file", "needs a directory"),
    ("redis:/x", "no path"),
    ("redis?chunk_kib=big", "not an integer"),
])
def test_bad_store_specs_are_rejected_with_a_hint(fake_client: redis.Redis, keys: Keys, spec: str,
                                                  message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        make_store(spec, fake_client, keys)


def test_make_store_builds_each_kind(fake_client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    assert isinstance(make_store("redis?chunk_kib=8", fake_client, keys), RedisStore)
    assert isinstance(make_store(f"shm:{tmp_path}", fake_client, keys), ShmStore)
    assert type(make_store(f"file:{tmp_path}", fake_client, keys)) is FileStore


def test_pack_command_keeps_big_arguments_as_their_own_frames() -> None:
    big = memoryview(bytearray(BIG_ARG))
    frames = pack_command(["SET", "k", big, "EX", 5])
    assert frames[1] is not None and isinstance(frames[1], memoryview) and frames[1].nbytes == BIG_ARG
    joined = b"".join(bytes(f) for f in frames)
    assert joined == b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % BIG_ARG + bytes(BIG_ARG) + b"\r\n$2\r\nEX\r\n$1\r\n5\r\n"
    assert pack_command(["PING"]) == [b"*1\r\n$4\r\nPING\r\n"]


def test_addresses_follow_the_redis_url() -> None:
    a = Address.from_url("rediss://user:p%40ss@h:6380/2?ssl_cert_reqs=none")
    assert (a.host, a.port, a.db, a.username, a.password, a.ssl, a.ssl_cert_reqs) == (
        "h", 6380, 2, "user", "p@ss", True, "none")
    u = Address.from_url("unix:///tmp/r.sock?db=3")
    assert (u.path, u.db, u.ssl) == ("/tmp/r.sock", 3, False)
    c = Address.from_client(redis.Redis.from_url("redis://:pw@10.0.0.1:7000/5"))
    assert (c.host, c.port, c.db, c.password, c.path) == ("10.0.0.1", 7000, 5, "pw", None)


def test_private_shm_reads_are_copy_on_write(keys: Keys, tmp_path: Path) -> None:
    store = ShmStore(keys, tmp_path)
    reference = store.put("pol:b1", encode(fields(1)), ttl_s=60)
    mine = decode(store.get(reference))
    mine.tensors["a"][0] = -1
    assert decode(store.get(reference)).tensors["a"][0] == fields(1)["a"][0]


def test_shared_shm_reads_reuse_one_mapping_and_alias_the_segment(keys: Keys, tmp_path: Path) -> None:
    writer = ShmStore(keys, tmp_path)
    reader = ShmStore(keys, tmp_path, reads="shared")
    r1 = writer.put("pol:b1", encode(fields(1)), ttl_s=60)
    first = decode(reader.get(r1))
    second = decode(reader.get(r1))
    assert first.tensors["a"].data_ptr() == second.tensors["a"].data_ptr()  # one mapping, no new faults
    assert torch.equal(first.tensors["b"], fields(1)["b"])
    del first, second
    gc.collect()
    writer.delete(r1)  # no live batch: recycled
    r2 = writer.put("pol:b2", encode(fields(2)), ttl_s=60)
    again = decode(reader.get(r2))  # same segment, same cached mapping, new bytes
    assert torch.equal(again.tensors["a"], fields(2)["a"])
    with pytest.raises(InvalidRequest, match="reads"):
        make_store("shm?reads=sometimes", redis.Redis(), keys)
    reader.close()
    writer.close()
