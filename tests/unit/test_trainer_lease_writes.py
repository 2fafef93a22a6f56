"""A trainer whose policy lease lapsed writes nothing: not its weights, its checkpoint, its events nor its acks.

Trainer A takes the lease and stops renewing it (as a paused process does); once it lapsed, B takes the
policy. Each of A's writes is then refused with ``LeaseLost`` and leaves what B wrote untouched.
"""

from __future__ import annotations

import time
from pathlib import Path

import fakeredis
import pytest
import torch
from safetensors.torch import save_file

from rollout_bus.events.errors import LeaseLost
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import PolicyRecord, Registry
from rollout_bus.events.rollouts import RolloutRequest
from rollout_bus.events.schema import BatchConsumed, Producer, WeightsPublished, decode
from rollout_bus.executor.output import BatchSink
from rollout_bus.launch.procs import exit_text
from rollout_bus.lm.files import read_manifest, rename_noreplace
from rollout_bus.lm.model import ModelConfig, build_model
from rollout_bus.trainer.checkpoint import CheckpointStore, TrainerState
from rollout_bus.trainer.client import ClientConfig, RolloutClient
from rollout_bus.trainer.lease import PolicyLease
from rollout_bus.trainer.weights import WeightPublisher, version_dir
from tests.support.fake_rollouts import fake_batch

TTL_S = 0.3


def pause(lease: PolicyLease) -> None:
    """What SIGSTOP does to a holder: its renewal stops (the process itself comes back later)."""
    lease._stop.set()
    if lease._thread is not None:
        lease._thread.join(5)


def wait_lapsed(lease: PolicyLease, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        raw = lease.client.hget(lease.key, f"r{lease.rank}")
        until = int(raw.decode().split("|")[1]) if raw else 0
        if until < time.time_ns() // 1_000_000:
            return
        assert time.monotonic() < deadline, "the lease did not lapse"
        time.sleep(0.02)


def deposed_and_successor(client: fakeredis.FakeRedis, keys: Keys) -> tuple[PolicyLease, PolicyLease]:
    a = PolicyLease(client, keys, "alpha", "trainer-a", ttl_s=TTL_S)
    a.acquire()
    pause(a)
    b = PolicyLease(client, keys, "alpha", "trainer-b", ttl_s=30, wait_s=5)  # a long one: never lapses here
    b.acquire()  # waits for A's lapse
    assert client.hget(keys.trainer_lease("alpha"), "owner") == b"trainer-b/1"  # the takeover landed
    return a, b


def weights(tmp: Path, value: float) -> None:
    save_file({"w": torch.full((2, 2), value)}, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text("{}")


def test_a_lapsed_lease_is_never_taken_back_by_its_renewal(keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    a = PolicyLease(client, keys, "alpha", "trainer-a", ttl_s=TTL_S)
    a.acquire()
    pause(a)
    wait_lapsed(a)
    assert a._try(renew=True)[0] is False  # the renewal a resumed thread makes: refused, although nobody holds it
    assert not client.hexists(keys.trainer_lease("alpha"), "r0")
    with pytest.raises(LeaseLost, match="lapsed"):
        a.verify()
    assert a.lost.is_set()


def test_a_deposed_trainer_neither_replaces_nor_announces_the_successors_version(tmp_path: Path, keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    a, b = deposed_and_successor(client, keys)
    producer = Producer("trainer", "x")
    mine = WeightPublisher(client, keys, "alpha", tmp_path, producer, lease=b)
    _, digest = mine.save_dir(1, lambda tmp: weights(tmp, 1.0))
    published = mine.publish(None, 1)
    stale = WeightPublisher(client, keys, "alpha", tmp_path, producer, lease=a)
    with pytest.raises(LeaseLost):
        stale.save_dir(1, lambda tmp: weights(tmp, 2.0))
    with pytest.raises(LeaseLost):
        stale.save_dir(2, lambda tmp: weights(tmp, 2.0))
    with pytest.raises(LeaseLost):
        stale.publish(None, 1)
    assert read_manifest(version_dir(tmp_path, "alpha", 1))[1] == digest == published.sha256
    assert sorted(p.name for p in (tmp_path / "alpha").iterdir()) == ["v000001"]  # nothing staged left, no v2
    announced = [decode(f) for _, f in page(client, keys.weight_stream("alpha"))]
    assert [(e.version, e.sha256) for e in announced if isinstance(e, WeightsPublished)] == [(1, digest)]


def test_a_published_version_is_immutable_and_saving_it_again_unchanged_is_a_no_op(tmp_path: Path,
                                                                                 keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    lease = PolicyLease(client, keys, "alpha", "t", ttl_s=5)
    lease.acquire()
    publisher = WeightPublisher(client, keys, "alpha", tmp_path, Producer("trainer", "x"), lease=lease)
    directory, digest = publisher.save_dir(1, lambda tmp: weights(tmp, 1.0))
    publisher.publish(None, 1)
    inode = directory.stat().st_ino
    assert publisher.save_dir(1, lambda tmp: weights(tmp, 1.0)) == (directory, digest)  # same bytes: no-op
    with pytest.raises(FileExistsError, match="never rewritten"):
        publisher.save_dir(1, lambda tmp: weights(tmp, 3.0))
    assert directory.stat().st_ino == inode and read_manifest(directory)[1] == digest
    assert sorted(p.name for p in (tmp_path / "alpha").iterdir()) == ["v000001"]
    lease.release()


def test_a_version_written_but_never_announced_is_set_aside_by_the_lease_holder(tmp_path: Path, keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    lease = PolicyLease(client, keys, "alpha", "t", ttl_s=5)
    lease.acquire()
    publisher = WeightPublisher(client, keys, "alpha", tmp_path, Producer("trainer", "x"), lease=lease)
    publisher.save_dir(1, lambda tmp: weights(tmp, 1.0))  # its writer stopped before WeightsPublished
    directory, digest = publisher.save_dir(1, lambda tmp: weights(tmp, 4.0))
    assert read_manifest(directory)[1] == digest
    assert sorted(p.name for p in (tmp_path / "alpha").iterdir()) == ["v000001"]
    Registry(client, keys).put_policy(PolicyRecord("alpha", published=1))  # announced (seen by the controller)
    with pytest.raises(FileExistsError):
        publisher.save_dir(1, lambda tmp: weights(tmp, 5.0))
    lease.release()


def test_a_deposed_trainer_leaves_the_checkpoint_in_place(tmp_path: Path, keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    a, b = deposed_and_successor(client, keys)
    model = build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    store = CheckpointStore(tmp_path / "ckpt")
    store.save(TrainerState(version=1, step=1, run_id="b"), model, optimizer, before_replace=b.verify)
    with pytest.raises(LeaseLost):
        store.save(TrainerState(version=1, step=1, run_id="a"), model, optimizer, before_replace=a.verify)
    loaded = store.load()
    assert loaded is not None and loaded.state.run_id == "b"
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["trainer.pt"]


def test_a_deposed_client_neither_acks_nor_announces_nor_reads_nor_requests(keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    Registry(client, keys).put_policy(PolicyRecord("alpha", serving=0))
    rc = RolloutClient(client, keys, ClientConfig(policy="alpha", trainer_id="trainer-a", group="trainer-a",
                                                  block_ms=10, lease_ttl_s=TTL_S), Producer("trainer", "a"))
    rc.start()
    sink = BatchSink(client, keys, Publisher(client, keys, Producer("executor", "x")))
    sink.publish(RolloutRequest(policy="alpha", rollout_id=0, n_groups=1, n_samples_per_group=2, request_id="a-r0"),
                 fake_batch(1, 2, rollout_id=0, version=0))
    batch = rc.get(0, timeout_s=2.0)
    pause(rc.lease)
    successor = PolicyLease(client, keys, "alpha", "trainer-b", ttl_s=30, wait_s=5)
    successor.acquire()
    stream = keys.batch_stream("alpha")
    readers = keys.payload_readers(batch.event.payload["ref"])
    with pytest.raises(LeaseLost):
        rc.ack(batch, staleness=0, accepted=True)
    assert client.xpending(stream, "trainer-a")["pending"] == 1
    assert b"trainer-a" in client.smembers(readers)
    assert not [e for e in (decode(f) for _, f in page(client, keys.trainer_stream)) if isinstance(e, BatchConsumed)]
    with pytest.raises(LeaseLost):
        rc.poll()
    with pytest.raises(LeaseLost):
        rc.request(1, rc.request_id("run", 1))
    assert client.llen(f"rq:queue:{keys.rollout_queue}") == 0
    rc.stop()
    assert client.hget(keys.trainer_lease("alpha"), "owner") == b"trainer-b/1"  # stopping dropped nothing of B's
    successor.release()


def test_a_no_replace_rename_keeps_even_an_empty_directory_in_place(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_text("x")
    (tmp_path / "dst").mkdir()  # os.rename would replace an empty directory without a word
    with pytest.raises(FileExistsError):
        rename_noreplace(tmp_path / "src", tmp_path / "dst")
    assert (tmp_path / "src" / "f").exists() and not any((tmp_path / "dst").iterdir())
    rename_noreplace(tmp_path / "src", tmp_path / "new")
    assert (tmp_path / "new" / "f").read_text() == "x"


def test_the_run_names_a_deposed_roles_exit_status() -> None:
    assert "deposed" in exit_text(LeaseLost.exit_code) and exit_text(1) == "1"
