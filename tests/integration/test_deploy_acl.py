"""deploy/users.acl and deploy/redis.conf in a real redis-server: each role can do its job and no more."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from rq import Queue, Retry, SimpleWorker
from rq.serializers import JSONSerializer

from rollout_bus import status
from rollout_bus.controller.lease import Lease
from rollout_bus.events import schema as s
from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.connection import connect
from rollout_bus.events.consume import Consumer, ConsumerConfig
from rollout_bus.events.embedded import find_redis_server, free_port
from rollout_bus.events.errors import RedisCommandError
from rollout_bus.events.janitor import Janitor, JanitorConfig
from rollout_bus.events.metrics import bus_snapshot
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import EngineRecord, EngineState, PolicyRecord, Registry
from rollout_bus.replay.exporter import export_log
from rollout_bus.replay.importer import import_log
from rollout_bus.replay.payloads import payload_store
from rollout_bus.trainer.lease import PolicyLease

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
POLICY = "p0"


class AclServer:
    """redis-server started from deploy/redis.conf with the deploy ACL file, stopped by pid."""

    def __init__(self) -> None:
        binary = find_redis_server()
        if binary is None:
            pytest.skip("redis-server is not installed")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="rollout-bus-acl-")
        self._stderr = Path(self.dir, "stderr").open("wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [binary, str(ROOT / "deploy" / "redis.conf"), "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", self.dir, "--aclfile", str(ROOT / "deploy" / "users.acl"), "--daemonize", "no",
             "--logfile", f"{self.dir}/redis.log"], stdout=subprocess.DEVNULL,
            stderr=self._stderr)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client("status").ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {Path(self.dir, 'stderr').read_text()}") from None
                time.sleep(0.02)

    def url(self, user: str) -> str:
        return f"redis://{user}:{user}-dev-password@127.0.0.1:{self.port}/0"

    def client(self, user: str) -> redis.Redis:
        return connect(self.url(user))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self._stderr.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def acl_server() -> Iterator[AclServer]:
    server = AclServer()
    yield server
    server.stop()


def refused(fn: Callable[[], Any]) -> None:
    """``fn`` fails on an ACL check (redis-py drops the NOPERM prefix; the Guard drops the class)."""
    with pytest.raises((redis.exceptions.NoPermissionError, RedisCommandError)) as info:
        fn()
    assert "no permissions" in str(info.value), info.value


def producer(role: str) -> s.Producer:
    return s.Producer(role, f"{role}-0")


def test_the_config_runs_with_append_only_persistence(acl_server: AclServer) -> None:
    admin = acl_server.client("admin")
    assert admin.config_get("appendonly") == {"appendonly": "yes"}
    assert admin.config_get("appendfsync") == {"appendfsync": "everysec"}
    assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    with socket.create_connection(("127.0.0.1", acl_server.port), timeout=2) as sock:  # the default user is off
        sock.sendall(b"PING\r\n")
        assert sock.recv(64).startswith(b"-NOAUTH")


def test_the_controller_owns_engines_weight_outcomes_and_the_registry(acl_server: AclServer) -> None:
    keys = Keys("ctl")
    ctl = acl_server.client("controller")
    Publisher(acl_server.client("trainer"), keys, producer("trainer")).publish(keys.weight_stream, s.WeightsPublished(
        producer=producer("trainer"), policy=POLICY, version=1, uri="file:///w/1", sha256="ab"))
    pub = Publisher(ctl, keys, producer("controller"))
    pub.publish(keys.engine_stream, s.EngineReady(producer=producer("controller"), engine_id="e0", url="u"))
    weights = Consumer(ctl, keys, keys.weight_stream, "controller", "c-0", ConsumerConfig(block_ms=1))
    applied: list[int] = []

    def apply(msg: Any) -> None:
        if isinstance(msg.event, s.WeightsPublished):
            pub.publish(keys.weight_stream, s.WeightsApplied(producer=producer("controller"), policy=POLICY,
                                                             version=msg.event.version, engine_id="e0", duration_ms=1))
            applied.append(msg.event.version)
    weights.run_until_idle(apply)
    assert applied == [1]
    reg = Registry(ctl, keys)
    reg.put_engine(EngineRecord("e0", "u", EngineState.SERVING, versions={POLICY: 1}))
    reg.put_policy(PolicyRecord(POLICY, published=1, serving=1))
    assert ctl.set(keys.controller_lease, "me", nx=True, px=5000)
    Consumer(ctl, keys, keys.command_stream, "controller", "c-0", ConsumerConfig(block_ms=1)).read()

    lease = Lease(ctl, keys.controller_lease, "fenced", 5)
    ctl.delete(keys.controller_lease)
    assert lease.try_acquire() and lease.token is not None  # the fencing counter and fenced registry writes
    Registry(ctl, keys, fence=lease.token).put_engine(EngineRecord("e0", "u", EngineState.SERVING))
    exe = acl_server.client("executor")
    exe_pub = Publisher(exe, keys, producer("executor"))
    exe.sadd(keys.registered_groups(keys.batch_stream(POLICY)), "left")
    BatchChannel(exe, keys, publisher=exe_pub).publish(POLICY, "b0", {"x": torch.zeros(3)}, request_id="r0")
    exe.zadd(keys.group_beats(keys.batch_stream(POLICY)), {"left": 0})  # a reader that left long ago
    report = Janitor(ctl, keys, pub, JanitorConfig(max_len=0, payload_max_age_s=3600)).run_once()
    assert [e.group for e in report.expired] == ["left"] and report.trimmed.get("batches/p0") == 1
    assert not list(ctl.scan_iter(match=keys.payload("*")))  # the janitor deleted the payload it held

    refused(lambda: ctl.xadd(keys.batch_stream(POLICY), {"e": b"x"}))
    refused(lambda: ctl.set(keys.payload("b"), b"x"))
    refused(lambda: Queue(keys.rollout_queue, connection=ctl, serializer=JSONSerializer).enqueue("builtins.len", [1]))


def test_the_executor_runs_rq_jobs_and_writes_rollouts_and_batches_but_never_weights(acl_server: AclServer) -> None:
    keys = Keys("exe")
    trainer, exe = acl_server.client("trainer"), acl_server.client("executor")
    Registry(acl_server.client("controller"), keys).put_engine(EngineRecord("e0", "u", EngineState.SERVING))
    queue = Queue(keys.rollout_queue, connection=trainer, serializer=JSONSerializer)
    job = queue.enqueue_call("builtins.len", args=[[1, 2, 3]], job_id="req-1", unique=True, retry=Retry(max=2))
    Publisher(trainer, keys, producer("trainer")).publish(keys.rollout_stream, s.RolloutRequested(
        producer=producer("trainer"), policy=POLICY, rollout_id=1, request_id="req-1", n_groups=1,
        n_samples_per_group=2))

    worker = SimpleWorker([Queue(keys.rollout_queue, connection=exe, serializer=JSONSerializer)],
                          connection=exe, serializer=JSONSerializer, name="exe-host-executor-0")
    assert worker.work(burst=True)
    job.refresh()
    assert job.get_status() == "finished" and job.return_value() == 3

    assert Registry(exe, keys).engines()["e0"].state == EngineState.SERVING
    exe.xrange(keys.weight_stream)
    pub = Publisher(exe, keys, producer("executor"))
    pub.publish(keys.rollout_stream, s.RolloutStarted(producer=producer("executor"), policy=POLICY, rollout_id=1,
                                                      request_id="req-1", executor="x", attempt=1))
    channel = BatchChannel(exe, keys, publisher=pub)
    entry = channel.publish(POLICY, "batch-1", {"tokens": torch.arange(6, dtype=torch.int32)}, {"k": 1},
                            rollout_id=1, request_id="req-1")
    assert channel.publish(POLICY, "batch-1", {"tokens": torch.arange(6, dtype=torch.int32)}) == entry
    exe.hset(keys.data_cursor(POLICY, "arith"), "offset", 2)
    Consumer(exe, keys, keys.weight_stream, "executor-x", "x-0", ConsumerConfig(block_ms=1)).run_until_idle(
        lambda m: None)

    weights = s.WeightsPublished(producer=producer("executor"), policy=POLICY, version=9, uri="u", sha256="x")
    refused(lambda: pub.publish(keys.weight_stream, weights))
    refused(lambda: exe.xadd(keys.weight_stream, {"e": b"x"}))
    refused(lambda: exe.hset(keys.engine_registry, "e0", b"x"))
    refused(lambda: exe.xadd(keys.trainer_stream, {"e": b"x"}))


def test_the_trainer_consumes_batches_and_publishes_weights_but_never_touches_engines(acl_server: AclServer) -> None:
    keys = Keys("trn")
    exe, trainer = acl_server.client("executor"), acl_server.client("trainer")
    group = Consumer(trainer, keys, keys.batch_stream(POLICY), "trainer-p0", "t-0", ConsumerConfig(block_ms=1))
    group.ensure_group()
    producing = BatchChannel(exe, keys, publisher=Publisher(exe, keys, producer("executor")))
    for i in range(2):
        producing.publish(POLICY, f"b{i}", {"x": torch.full((3,), i, dtype=torch.int64)}, rollout_id=i,
                          request_id=f"r{i}")
    exe.xadd(keys.batch_stream(POLICY), {b"e": b"garbage"})
    pub = Publisher(trainer, keys, producer("trainer"))
    channel = BatchChannel(trainer, keys, publisher=pub)

    def train(msg: Any) -> None:
        assert channel.fetch(msg.event).tensor("x").tolist() == [int(msg.event.batch_id[1])] * 3
        assert channel.release(msg.event, "trainer-p0")  # the last reader: the payload is deleted
        pub.publish(keys.trainer_stream, s.BatchConsumed(producer=producer("trainer"), policy=POLICY,
                                                         batch_id=msg.event.batch_id, trainer_id="t0", staleness=0,
                                                         accepted=True))
    assert group.run_until_idle(train) == 2 and group.dead_lettered == 1
    assert not [k for k in trainer.scan_iter(match=keys.payload("*"))]
    pub.publish(keys.weight_stream, s.WeightsPublished(producer=producer("trainer"), policy=POLICY, version=1,
                                                       uri="file:///w/1", sha256="ab"))
    pub.publish(keys.command_stream, s.OffloadEngines(producer=producer("trainer"), tags=["kv_cache"]))
    cursor = keys.data_cursor(POLICY, "arith")  # stale prompts go back to the data source (WATCH/MULTI)
    trainer.transaction(lambda pipe: (pipe.hget(cursor, "returned"), pipe.multi(), pipe.hset(cursor, "returned", b"[]")),
                        cursor)
    assert Registry(trainer, keys).engines() == {}

    refused(lambda: Registry(trainer, keys).put_engine(EngineRecord("e0", "u", EngineState.SERVING)))
    refused(lambda: Registry(trainer, keys).put_policy(PolicyRecord(POLICY, published=5)))
    refused(lambda: trainer.xadd(keys.batch_stream(POLICY), {"e": b"x"}))
    refused(lambda: trainer.xadd(keys.engine_stream, {"e": b"x"}))
    refused(lambda: trainer.set(keys.controller_lease, "me"))
    lease = PolicyLease(trainer, keys, POLICY, "trainer-p0", ttl_s=5)
    lease.acquire()  # one trainer per policy
    lease.release()


def test_the_status_user_reads_everything_and_writes_nothing(acl_server: AclServer, tmp_path: Path) -> None:
    keys = Keys("sts")
    Publisher(acl_server.client("controller"), keys, producer("controller")).publish(
        keys.engine_stream, s.EngineReady(producer=producer("controller"), engine_id="e0", url="u"))
    Consumer(acl_server.client("controller"), keys, keys.engine_stream, "watch", "w-0",
             ConsumerConfig(block_ms=1)).ensure_group()
    Registry(acl_server.client("controller"), keys).put_engine(EngineRecord("e0", "u", EngineState.SERVING))
    ro = acl_server.client("status")
    text = status.render(bus_snapshot(ro, keys))
    assert "e0" in text and "watch" in text
    stats = export_log(ro, keys, tmp_path / "ro.rblog", payloads=payload_store(ro, keys))
    assert stats.entries == {"engines": 1}

    refused(lambda: ro.xadd(keys.engine_stream, {"e": b"x"}))
    refused(lambda: ro.set("anything", 1))
    refused(lambda: ro.xreadgroup("watch", "w-1", {keys.engine_stream: ">"}))
    refused(lambda: ro.keys("*"))
    refused(lambda: ro.flushall())

    admin = acl_server.client("admin")
    imported = import_log(admin, Keys("sts-copy"), tmp_path / "ro.rblog")
    assert imported.entries == {"engines": 1}


def test_the_controller_creates_the_bus_epoch_every_role_reads_it_and_writers_record_degraded_writes(
        acl_server: AclServer) -> None:
    from rollout_bus.events.epoch import BusEpoch

    keys = Keys("epoch")
    executor = BusEpoch(acl_server.client("executor"), keys)
    assert executor.join() is None  # not its to create (NOPERM is not an error): it adopts the first it sees
    created = BusEpoch(acl_server.client("controller"), keys).join()
    assert created
    for role in ("executor", "trainer", "status"):
        assert BusEpoch(acl_server.client(role), keys).join() == created
    executor.check()
    assert executor.value == created
    for role in ("controller", "executor", "trainer"):  # a degraded durable write says so in the status hash
        acl_server.client(role).hset(keys.durability_status, role, "{}")
    assert set(bus_snapshot(acl_server.client("status"), keys).degraded) == {"controller", "executor", "trainer"}
