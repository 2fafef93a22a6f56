"""The memfd store: sealed segments handed over by descriptor, and nothing left behind by a crash.

Segments are found where the kernel keeps them: ``/proc/<pid>/fd`` links and ``/proc/<pid>/maps``
lines naming ``memfd:rollout-bus:<server>:...`` (every segment of one store carries its server's
name), in every process on the machine, so a leak shows up whoever holds it.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch

from rollout_bus.events.batch import RaggedSpec, decode, encode, layout
from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.errors import ChecksumMismatch, InvalidRequest, PayloadMissing
from rollout_bus.events.names import Keys
from rollout_bus.events.payload import MemfdStore, make_store
from rollout_bus.events.payload.memfd import is_sealed, new_segment
from rollout_bus.events.payload.segment_server import MAX_MESSAGE, address
from rollout_bus.events.schema import BatchReady, decode_as

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
POLICY = "pol"

# A producer or reader in a process of its own: prints one JSON line when it is where the test
# wants to kill it, then waits to be killed.
CHILD = """
import json, sys, time
import torch
from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.connection import connect
from rollout_bus.events.names import Keys
from rollout_bus.events.payload import make_store
from rollout_bus.events.schema import BatchReady, decode_as
url, namespace, step = sys.argv[1], sys.argv[2], sys.argv[3]
client = connect(url)
keys = Keys(namespace)
channel = BatchChannel(client, keys, make_store("memfd", client, keys))
if step == "read":
    event = decode_as(BatchReady, client.xrevrange(keys.batch_stream("pol"), count=1)[0][1])
    batch = channel.fetch(event)
    print(json.dumps({"sum": float(batch.tensors["x"].double().sum())}), flush=True)
elif step == "loop":
    print(json.dumps({"server": channel.store.locator()["root"]}), flush=True)
    i = 0
    while True:
        draft = channel.allocate("pol", {"x": ((1 << 16,), torch.float32)}, {"i": i})
        draft["x"].fill_(float(i))
        channel.publish("pol", f"b{i}", draft)
        i += 1
else:
    draft = channel.allocate("pol", {"x": ((1 << 18,), torch.float32)}, {"step": step})
    draft["x"].fill_(2.0)
    server = channel.store.server_name
    if step == "publish":
        channel.publish("pol", "b1", draft)
    print(json.dumps({"server": server}), flush=True)
while True:
    time.sleep(1)
"""


def holders(marker: str) -> dict[int, list[str]]:
    """Processes holding a descriptor or a mapping of a memfd whose name contains ``marker``."""
    found: dict[int, list[str]] = {}
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        seen: list[str] = []
        try:
            for fd in (pid_dir / "fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if "memfd:rollout-bus:" in target and marker in target:
                    seen.append(f"fd {target}")
            seen += [f"map {line.split()[-2]}" for line in (pid_dir / "maps").read_text().splitlines()
                     if "memfd:rollout-bus:" in line and marker in line]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if seen:
            found[int(pid_dir.name)] = seen
    return found


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def server_pid(name: str) -> int | None:
    for pid_dir in Path("/proc").iterdir():
        if pid_dir.name.isdigit():
            try:
                cmd = (pid_dir / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(c.endswith(b"segment_server.py") for c in cmd) and name.encode() in cmd:
                return int(pid_dir.name)
    return None


@pytest.fixture()
def channel(redis_client: redis.Redis, keys: Keys) -> Iterator[BatchChannel]:
    ch = BatchChannel(redis_client, keys, make_store("memfd", redis_client, keys))
    yield ch
    ch.delete_expired(0)
    ch.close()


@pytest.fixture()
def child(redis_server: object, keys: Keys) -> Iterator[Callable[[str], tuple[subprocess.Popen[str], dict[str, object]]]]:
    started: list[subprocess.Popen[str]] = []

    def start(step: str) -> tuple[subprocess.Popen[str], dict[str, object]]:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        proc = subprocess.Popen([sys.executable, "-c", CHILD, redis_server.url, keys.namespace, step],  # type: ignore[attr-defined]
                                stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        started.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"child {step} exited with {proc.wait()}"
        return proc, json.loads(line)

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def latest(channel: BatchChannel) -> BatchReady:
    return decode_as(BatchReady, channel.client.xrevrange(channel.keys.batch_stream(POLICY), count=1)[0][1])


def publish_draft(channel: BatchChannel, batch_id: str = "b1", n: int = 1 << 16) -> BatchReady:
    draft = channel.allocate(POLICY, {"x": ((n,), torch.float32), "ids": ((n // 4,), torch.int64)}, {"k": batch_id})
    draft["x"].fill_(1.5)
    torch.arange(n // 4, out=draft["ids"])
    channel.publish(POLICY, batch_id, draft)
    return latest(channel)


def get_fd(reference: dict[str, object]) -> int:
    """The segment's descriptor as a reader receives it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(address(str(reference["server"])))
        s.send(f"GET {reference['ref']}".encode())
        _, fds, _, _ = socket.recv_fds(s, MAX_MESSAGE, 1)
    assert len(fds) == 1
    return fds[0]


def test_a_batch_built_in_place_round_trips_sealed_and_its_tensors_are_the_readers_own(
        channel: BatchChannel) -> None:
    event = publish_draft(channel)
    buffer, sealed = channel.store.get_sealed(event.payload)
    assert sealed
    del buffer
    batch = channel.fetch(event)
    assert batch.meta == {"k": "b1"} and float(batch.tensors["x"].sum()) == 1.5 * (1 << 16)
    assert torch.equal(batch.tensors["ids"], torch.arange(1 << 14))
    batch.tensors["x"][0] = 7.0  # copy-on-write: the segment and other readers keep the sealed bytes
    assert float(channel.fetch(event).tensors["x"][0]) == 1.5


def test_a_sealed_segment_refuses_writes_through_a_new_mapping_write_and_resizing(channel: BatchChannel) -> None:
    event = publish_draft(channel)
    fd = get_fd(event.payload)
    try:
        assert is_sealed(fd)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1 << 20)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # a fresh writable descriptor is no way around it
        try:
            with pytest.raises(PermissionError):
                os.write(rw, b"x")
        finally:
            os.close(rw)
    finally:
        os.close(fd)
    assert float(channel.fetch(event).tensors["x"].sum()) == 1.5 * (1 << 16)


def test_a_reader_skips_the_checksum_only_for_a_sealed_segment(channel: BatchChannel) -> None:
    store = channel.store
    assert isinstance(store, MemfdStore)
    server = store.server_name or store.locator()["root"]
    encoded = encode({"x": torch.ones(4096)}, {"k": 1})
    raw = bytearray(encoded.tobytes())
    raw[-1] ^= 0xFF  # a corrupted byte: the checksum no longer matches
    plan = layout({"x": ((4096,), torch.float32)}, {"k": 2})  # built in place: no checksum at all

    def hand_over(ref: str, data: bytes, sealed: bool) -> dict[str, object]:
        fd, mm = new_segment(f"{server}:test", len(data))
        try:
            mm[:] = data
            mm.close()
            if sealed:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            return store._add(str(server), ref, fd, len(data), 60)
        finally:
            os.close(fd)

    def event(batch_id: str, reference: dict[str, object]) -> BatchReady:
        return BatchReady(producer=channel.publisher.producer, policy=POLICY, batch_id=batch_id, rollout_id=0,
                          request_id="", n_samples=1, min_weight_version=0, max_weight_version=0,
                          bytes=int(str(reference["nbytes"])), payload=reference)

    unsealed_corrupt = hand_over(f"{POLICY}:c1:01", bytes(raw), sealed=False)
    assert store.get_sealed(unsealed_corrupt)[1] is False
    with pytest.raises(ChecksumMismatch):
        channel.fetch(event("c1", unsealed_corrupt))
    unsealed_unhashed = hand_over(f"{POLICY}:c2:02", plan.head + bytes(plan.nbytes - len(plan.head)), sealed=False)
    with pytest.raises(ChecksumMismatch, match="no checksum"):
        channel.fetch(event("c2", unsealed_unhashed))
    sealed_corrupt = hand_over(f"{POLICY}:c3:03", bytes(raw), sealed=True)
    assert store.get_sealed(sealed_corrupt)[1] is True
    assert channel.fetch(event("c3", sealed_corrupt)).meta == {"k": 1}  # no checksum pass: the kernel vouches
    with pytest.raises(ChecksumMismatch):  # which the checksum would have caught
        decode(store.get(sealed_corrupt))


def test_the_last_readers_release_frees_the_segment(channel: BatchChannel, keys: Keys) -> None:
    stream = keys.batch_stream(POLICY)
    channel.client.sadd(keys.registered_groups(stream), "g1", "g2")
    event = publish_draft(channel)
    marker = str(event.payload["server"])  # its one segment (a draft's name is its server's, not its ref's)
    batch = channel.fetch(event)
    assert os.getpid() in holders(marker) and len(holders(marker)) == 2  # this reader's mapping, the server's fd
    del batch
    assert channel.release(event, "g1") is False
    assert holders(marker), "freed before the last reader released it"
    assert channel.release(event, "g2") is True
    wait_for(lambda: not holders(marker), "the segment to be freed")
    with pytest.raises(PayloadMissing):
        channel.fetch(event)


def test_a_producer_killed_before_sealing_leaves_no_segment_and_its_server_exits(child: Callable[..., tuple[
        subprocess.Popen[str], dict[str, object]]]) -> None:
    proc, info = child("draft")
    server = str(info["server"])
    assert proc.pid in holders(server)  # the draft's segment, mapped and open in the producer
    assert server_pid(server) is not None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    wait_for(lambda: not holders(server), "the killed producer's draft to be freed")
    wait_for(lambda: server_pid(server) is None, "the segment server to exit")


def test_a_producer_killed_after_publishing_leaves_the_batch_readable_until_released(
        child: Callable[..., tuple[subprocess.Popen[str], dict[str, object]]], channel: BatchChannel,
        keys: Keys) -> None:
    channel.client.sadd(keys.registered_groups(keys.batch_stream(POLICY)), "g1")
    proc, info = child("publish")
    server = str(info["server"])
    pid = server_pid(server)
    assert pid is not None and set(holders(server)) == {pid}  # sealed: only the server holds it now
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    event = latest(channel)
    batch = channel.fetch(event)  # served after its producer died
    assert float(batch.tensors["x"].sum()) == 2.0 * (1 << 18)
    del batch
    assert channel.release(event, "g1") is True
    wait_for(lambda: not holders(server), "the released segment to be freed")
    wait_for(lambda: server_pid(server) is None, "the orphaned segment server to exit")


def test_a_producer_killed_anywhere_in_a_publishing_loop_leaves_nothing_the_janitors_sweep_does_not_free(
        child: Callable[..., tuple[subprocess.Popen[str], dict[str, object]]], channel: BatchChannel,
        keys: Keys) -> None:
    proc, info = child("loop")
    server = str(info["server"])
    stream = keys.batch_stream(POLICY)
    wait_for(lambda: channel.client.xlen(stream) >= 5, "the producer to publish a few batches")
    proc.send_signal(signal.SIGKILL)  # wherever it is: allocating, filling, sealing, handing over, appending
    proc.wait()
    assert holders(server), "nothing was held when the producer died"
    swept = channel.sweep(0)
    assert swept.payloads.get("memfd", 0) >= 5 and swept.unreachable == 0
    wait_for(lambda: not holders(server), "every segment of the killed producer to be freed")
    wait_for(lambda: server_pid(server) is None, "its segment server to exit")


def test_a_reader_killed_while_mapping_a_batch_leaks_nothing_once_its_group_releases(
        child: Callable[..., tuple[subprocess.Popen[str], dict[str, object]]], channel: BatchChannel,
        keys: Keys) -> None:
    channel.client.sadd(keys.registered_groups(keys.batch_stream(POLICY)), "g1")
    event = publish_draft(channel)
    marker = str(event.payload["server"])  # its one segment (a draft's name is its server's, not its ref's)
    proc, info = child("read")
    assert info["sum"] == 1.5 * (1 << 16)
    assert proc.pid in holders(marker)  # the reader maps it
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    wait_for(lambda: proc.pid not in holders(marker), "the killed reader's mapping to go")
    assert holders(marker), "the segment went before its group released it"
    assert channel.release(event, "g1") is True  # as the group's next consumer does after reclaiming the entry
    wait_for(lambda: not holders(marker), "the segment to be freed")


def test_a_killed_segment_server_takes_its_segments_with_it_and_the_next_publish_starts_another(
        channel: BatchChannel) -> None:
    event = publish_draft(channel, "b1")
    server = str(event.payload["server"])
    pid = server_pid(server)
    assert pid is not None and holders(server)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not holders(server), "the killed server's segments to be freed")
    with pytest.raises(PayloadMissing):
        channel.fetch(event)
    second = publish_draft(channel, "b2")
    assert second.payload["server"] != server
    assert float(channel.fetch(second).tensors["x"][0]) == 1.5


def test_a_draft_still_referenced_at_publish_is_copied_and_sealed(channel: BatchChannel) -> None:
    draft = channel.allocate(POLICY, {"x": ((1024,), torch.float32)})
    kept = draft["x"]
    kept.fill_(3.0)
    channel.publish(POLICY, "b1", draft)
    kept.fill_(4.0)  # writes to the draft's own memory, not to the published segment
    event = latest(channel)
    assert channel.store.get_sealed(event.payload)[1]
    assert float(channel.fetch(event).tensors["x"].sum()) == 3.0 * 1024


def test_the_segment_server_serves_only_its_own_user(channel: BatchChannel) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run a process as another user")
    event = publish_draft(channel)
    name = str(event.payload["server"])
    other = subprocess.run([sys.executable, "-c", (
        "import os, socket, sys\n"
        "os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        f"s.connect({address(name)!r})\n"
        "try:\n"
        f"    s.send(b'GET {event.payload['ref']}')\n"
        "    print(len(s.recv(512)))\n"
        "except (BrokenPipeError, ConnectionResetError):\n"
        "    print(0)\n")], capture_output=True, text=True, timeout=30)
    assert other.returncode == 0 and other.stdout.strip() == "0", other.stderr  # closed without an answer


def test_an_unknown_server_or_another_hosts_segment_is_missing(channel: BatchChannel) -> None:
    event = publish_draft(channel)
    gone = dict(event.payload, server=uuid.uuid4().hex[:16])
    with pytest.raises(PayloadMissing, match="gone"):
        channel.store.get(gone)
    with pytest.raises(PayloadMissing, match="host"):
        channel.store.get(dict(event.payload, host="elsewhere"))


@pytest.mark.parametrize("spec", ["redis", "shm", "file", "memfd"])
def test_a_draft_publishes_through_every_store_and_a_repeat_uses_the_draft_up_without_a_second_payload(
        redis_client: redis.Redis, keys: Keys, tmp_path: Path, spec: str) -> None:
    full = {"shm": f"shm:{tmp_path / 'shm'}", "file": f"file:{tmp_path / 'files'}"}.get(spec, spec)
    ch = BatchChannel(redis_client, keys, make_store(full, redis_client, keys))
    try:
        def draft(value: float) -> object:
            d = ch.allocate(POLICY, {"x": ((1000,), torch.float32), "r": RaggedSpec(5, 2, torch.int64)}, {"v": value})
            d["x"].fill_(value)
            d["r"].values.copy_(torch.arange(5))
            d["r"].offsets.copy_(torch.tensor([0, 1, 5]))
            return d
        first = ch.publish(POLICY, "b1", draft(1.0))  # type: ignore[arg-type]
        repeat = draft(2.0)
        assert ch.publish(POLICY, "b1", repeat) == first  # type: ignore[arg-type]
        assert repeat.tensors == {}  # type: ignore[attr-defined]
        assert redis_client.xlen(keys.batch_stream(POLICY)) == 1 and redis_client.zcard(keys.payload_index) == 1
        event = latest(ch)
        batch = ch.fetch(event)
        assert event.n_samples == 1000 and batch.meta == {"v": 1.0} and float(batch.tensors["x"].sum()) == 1000.0
        assert [r.tolist() for r in batch.ragged["r"].to_list()] == [[0], [1, 2, 3, 4]]
        with pytest.raises(InvalidRequest, match="meta"):
            ch.publish(POLICY, "b2", draft(3.0), {"v": 3})  # type: ignore[arg-type]
    finally:
        ch.delete_expired(0)
        ch.close()


def test_a_published_mapping_of_tensors_is_written_unhashed_into_a_sealed_segment(channel: BatchChannel) -> None:
    t = {"x": torch.randn(5000), "ids": torch.arange(77)}
    channel.publish(POLICY, "b1", t, {"m": 1})
    event = latest(channel)
    buffer, sealed = channel.store.get_sealed(event.payload)
    assert sealed
    with pytest.raises(ChecksumMismatch, match="no checksum"):  # not hashed: the seals vouch instead
        decode(buffer)
    batch = channel.fetch(event)
    assert batch.meta == {"m": 1} and all(torch.equal(batch.tensors[k], v) for k, v in t.items())
