"""The memfd store's pool of segments prepared ahead of need: its bounds, the fallback to a fresh segment,
its release on close, and sealed bytes that still cannot change when the segment came from the pool.

Pooled segments are found where the kernel keeps them: ``/proc/self/fd`` links and ``/proc/self/maps``
lines naming ``memfd:rollout-bus:<server>:pool``.
"""

from __future__ import annotations

import mmap
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.errors import InvalidRequest
from rollout_bus.events.names import Keys
from rollout_bus.events.payload import MemfdStore
from rollout_bus.events.payload.memfd import is_sealed
from rollout_bus.events.payload.memfd_segments import MemfdSettings, huge_page_bytes, huge_pages_free
from rollout_bus.events.payload.segment_server import MAX_MESSAGE, address
from rollout_bus.events.schema import BatchReady, decode_as

pytestmark = pytest.mark.integration

POLICY = "pol"
N = 1 << 16  # float32 elements of a test batch: 256 KiB
WAIT_S = 30.0


def make_channel(client: redis.Redis, keys: Keys, **settings: int) -> BatchChannel:
    return BatchChannel(client, keys, MemfdStore(keys, settings=MemfdSettings(**settings)))  # type: ignore[arg-type]


@pytest.fixture()
def channels(redis_client: redis.Redis, keys: Keys) -> Iterator[list[BatchChannel]]:
    made: list[BatchChannel] = []
    yield made
    for ch in made:
        ch.delete_expired(0)
        ch.close()


def store_of(channel: BatchChannel) -> MemfdStore:
    assert isinstance(channel.store, MemfdStore)
    return channel.store


def draft_of(channel: BatchChannel, value: float, n: int = N) -> object:
    draft = channel.allocate(POLICY, {"x": ((n,), torch.float32)}, {"v": value})
    draft["x"].fill_(value)  # type: ignore[index]
    return draft


def publish(channel: BatchChannel, batch_id: str, value: float, n: int = N) -> BatchReady:
    channel.publish(POLICY, batch_id, draft_of(channel, value, n))  # type: ignore[arg-type]
    return latest(channel)


def latest(channel: BatchChannel) -> BatchReady:
    return decode_as(BatchReady, channel.client.xrevrange(channel.keys.batch_stream(POLICY), count=1)[0][1])


def pooled_here(server: str) -> tuple[set[int], set[int]]:
    """Inodes of this process's descriptors and of its shared writable mappings of pooled segments of ``server``."""
    name = f"memfd:rollout-bus:{server}:pool"
    fds = set()
    for link in Path("/proc/self/fd").iterdir():
        try:
            if name in os.readlink(link):
                fds.add(os.stat(link).st_ino)
        except OSError:
            continue
    maps = {int(words[4]) for words in map(str.split, Path("/proc/self/maps").read_text().splitlines())
            if name in " ".join(words[5:]) and words[1].startswith("rw") and words[1].endswith("s")}
    return fds, maps


def get_fd(reference: dict[str, object]) -> int:
    """The segment's descriptor as a reader receives it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(address(str(reference["server"])))
        s.send(f"GET {reference['ref']}".encode())
        _, fds, _, _ = socket.recv_fds(s, MAX_MESSAGE, 1)
    assert len(fds) == 1
    return fds[0]


def test_the_pool_keeps_at_most_its_segment_count_and_its_memory_bound(redis_client: redis.Redis, keys: Keys,
                                                                        channels: list[BatchChannel]) -> None:
    by_count = make_channel(redis_client, keys, pool_segments=2, pool_max_bytes=64 << 20)
    segment = 4 * N + mmap.PAGESIZE  # one batch, page-rounded: 256 KiB and its header's page
    by_bytes = make_channel(redis_client, keys, pool_segments=8, pool_max_bytes=3 * segment + segment // 2)
    channels += [by_count, by_bytes]
    for k, ch in enumerate(channels):
        for i in range(4):
            publish(ch, f"c{k}b{i}", float(i))  # batch ids of their own: a repeated one is not written again
        pool = store_of(ch).pool
        assert pool.wait_idle(WAIT_S)
        fds, _ = pooled_here(str(store_of(ch).server_name))
        assert len(fds) == pool.ready  # what the pool counts is what this process holds
    assert store_of(by_count).pool.ready == 2
    assert store_of(by_bytes).pool.ready == 3 and store_of(by_bytes).pool.held_bytes == 3 * segment


def test_a_batch_larger_than_the_pools_bound_is_never_prepared(redis_client: redis.Redis, keys: Keys,
                                                               channels: list[BatchChannel]) -> None:
    ch = make_channel(redis_client, keys, pool_segments=2, pool_max_bytes=N)  # a quarter of one batch
    channels.append(ch)
    for i in range(3):
        event = publish(ch, f"b{i}", float(i))
        assert float(ch.fetch(event).tensors["x"][0]) == float(i)
    pool = store_of(ch).pool
    assert pool.wait_idle(WAIT_S)
    assert pool.ready == 0 and pool.held_bytes == 0 and pool.stats.hits == 0 and pool.stats.misses == 3
    assert pooled_here(str(store_of(ch).server_name)) == (set(), set())


def test_an_empty_pool_falls_back_to_a_fresh_segment(redis_client: redis.Redis, keys: Keys,
                                                     channels: list[BatchChannel]) -> None:
    ch = make_channel(redis_client, keys, pool_segments=1, pool_after=1)
    channels.append(ch)
    pool = store_of(ch).pool
    publish(ch, "b0", 0.0)  # nothing prepared yet: a fresh segment; the pool starts preparing
    assert pool.stats.misses == 1 and pool.wait_idle(WAIT_S) and pool.ready == 1
    pooled = draft_of(ch, 1.0)  # takes the one prepared segment; the pool refills once it is published
    assert pool.stats.hits == 1 and pool.ready == 0
    unpooled = draft_of(ch, 2.0)  # the pool is empty: a fresh segment
    assert pool.stats.misses == 2 and pool.stats.hits == 1
    names = [os.readlink(f"/proc/self/fd/{d._segment[0]}") for d in (pooled, unpooled)]  # type: ignore[attr-defined]
    assert names[0].endswith(":pool (deleted)") and names[1].endswith(":draft (deleted)")
    ch.publish(POLICY, "b1", pooled)  # type: ignore[arg-type]
    first = latest(ch)
    ch.publish(POLICY, "b2", unpooled)  # type: ignore[arg-type]
    second = latest(ch)
    for event, value in ((first, 1.0), (second, 2.0)):
        assert ch.store.get_sealed(event.payload)[1]
        assert float(ch.fetch(event).tensors["x"].sum()) == value * N


def test_closing_the_store_frees_every_prepared_segment_and_stops_its_thread(redis_client: redis.Redis, keys: Keys,
                                                                            channels: list[BatchChannel]) -> None:
    ch = make_channel(redis_client, keys, pool_segments=3)
    channels.append(ch)
    for i in range(3):
        publish(ch, f"b{i}", float(i))
    store = store_of(ch)
    pool, server = store.pool, str(store.server_name)
    assert pool.wait_idle(WAIT_S) and pool.ready == 3
    fds, maps = pooled_here(server)
    assert len(fds) == 3 and len(maps) == 3
    thread = pool._thread
    assert thread is not None and thread.is_alive()
    store.close()
    assert not thread.is_alive()
    assert pool.ready == 0 and pool.held_bytes == 0
    assert pooled_here(server) == (set(), set())
    event = publish(ch, "b9", 9.0)  # the store writes again after close, with a pool of its own
    assert float(ch.fetch(event).tensors["x"][0]) == 9.0


def test_a_pooled_segment_is_trimmed_to_its_batch_and_sealed_so_that_no_one_can_change_its_bytes(
        redis_client: redis.Redis, keys: Keys, channels: list[BatchChannel]) -> None:
    ch = make_channel(redis_client, keys, pool_segments=1)
    channels.append(ch)
    pool = store_of(ch).pool
    publish(ch, "b0", 0.0)
    publish(ch, "b1", 1.0)
    assert pool.wait_idle(WAIT_S) and pool.ready == 1
    event = publish(ch, "b2", 2.0, n=N - 1024)  # smaller than the prepared segment, which it takes
    assert pool.stats.hits == 1
    batch = ch.fetch(event)
    fd = get_fd(event.payload)
    try:
        st = os.fstat(fd)
        assert os.readlink(f"/proc/self/fd/{fd}").endswith(":pool (deleted)")  # it came from the pool
        assert st.st_size == event.payload["nbytes"]
        assert st.st_ino not in pooled_here(str(store_of(ch).server_name))[1]  # no writable mapping is left
        assert is_sealed(fd)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # a fresh writable descriptor is no way around it
        try:
            with pytest.raises(PermissionError):
                os.pwrite(rw, b"\xff" * 64, 0)
        finally:
            os.close(rw)
    finally:
        os.close(fd)
    assert float(batch.tensors["x"].sum()) == 2.0 * (N - 1024)  # the reader's bytes did not change
    assert float(ch.fetch(event).tensors["x"].sum()) == 2.0 * (N - 1024)


def test_a_published_mapping_of_tensors_goes_through_a_pooled_segment_sealed(
        redis_client: redis.Redis, keys: Keys, channels: list[BatchChannel]) -> None:
    ch = make_channel(redis_client, keys, pool_segments=1)
    channels.append(ch)
    pool = store_of(ch).pool
    tensors = {"x": torch.randn(N), "ids": torch.arange(77)}
    for i in range(2):
        ch.publish(POLICY, f"b{i}", tensors, {"m": i})
    assert pool.wait_idle(WAIT_S) and pool.ready == 1
    ch.publish(POLICY, "b2", tensors, {"m": 2})
    assert pool.stats.hits == 1
    event = latest(ch)
    assert ch.store.get_sealed(event.payload)[1]
    batch = ch.fetch(event)
    assert batch.meta == {"m": 2} and all(torch.equal(batch.tensors[k], v) for k, v in tensors.items())


def test_settings_out_of_range_are_refused() -> None:
    with pytest.raises(InvalidRequest):
        MemfdSettings(pool_segments=-1)
    with pytest.raises(InvalidRequest):
        MemfdSettings(pool_history=0)
    with pytest.raises(InvalidRequest):
        MemfdSettings(huge_pages="always")  # type: ignore[arg-type]


def test_huge_pages_are_used_only_when_reserved_ones_are_free(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("HugePages_Total:       0\nHugePages_Free:        0\nHugePages_Rsvd:        0\n"
                       "Hugepagesize:       2048 kB\n")
    assert huge_pages_free(str(meminfo)) == (0, "no huge pages are reserved (HugePages_Total is 0: vm.nr_hugepages)")
    meminfo.write_text("HugePages_Total:      16\nHugePages_Free:       10\nHugePages_Rsvd:        4\n"
                       "Hugepagesize:       2048 kB\n")
    assert huge_pages_free(str(meminfo)) == (6 * (2 << 20), "")
    meminfo.write_text("HugePages_Total:      16\nHugePages_Free:        2\nHugePages_Rsvd:        2\n"
                       "Hugepagesize:       2048 kB\n")
    assert huge_pages_free(str(meminfo)) == (0, "all 16 reserved huge pages are in use")


def test_a_batch_in_huge_pages_round_trips_sealed(redis_client: redis.Redis, keys: Keys,
                                                  channels: list[BatchChannel]) -> None:
    free, reason = huge_pages_free()
    if free < 4 * huge_page_bytes():  # the segment, and a reader's copy-on-write mapping reserves as many
        pytest.skip(f"huge pages: {reason or f'{free} bytes free, 4 huge pages needed'}")
    ch = make_channel(redis_client, keys, pool_segments=0)
    channels.append(ch)
    event = publish(ch, "b0", 3.0)
    fd = get_fd(event.payload)
    try:
        assert os.fstat(fd).st_blksize == huge_page_bytes() and is_sealed(fd)
    finally:
        os.close(fd)
    assert float(ch.fetch(event).tensors["x"].sum()) == 3.0 * N
