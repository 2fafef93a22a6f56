"""deploy/users.acl and deploy/redis.conf in a real redis-server: each role can do its job and no more.

The ACL file is rendered as compose renders it (``deploy/render-acl.sh``, passwords from the
environment). Each role's real process runs under its user with nothing refused; then every
operation the role must not do gets ``NOPERM``."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
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
from rollout_bus.events import acl
from rollout_bus.events import schema as s
from rollout_bus.events.batches import BatchChannel
from rollout_bus.events.connection import connect
from rollout_bus.events.consume import Consumer, ConsumerConfig
from rollout_bus.events.embedded import find_redis_server, free_port
from rollout_bus.events.errors import RedisCommandError
from rollout_bus.events.janitor import Janitor, JanitorConfig
from rollout_bus.events.metrics import bus_snapshot
from rollout_bus.events.names import Keys, publication_key
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import EngineRecord, EngineState, PolicyRecord, Registry
from rollout_bus.events.rollouts import RolloutRequest
from rollout_bus.events.submit import RolloutSubmitter, SubmitConfig
from rollout_bus.replay.exporter import export_log
from rollout_bus.replay.importer import import_log
from rollout_bus.replay.payloads import payload_store
from rollout_bus.trainer.lease import PolicyLease
from tests.support.procs import wait_for

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
POLICY = acl.TRAINER_POLICY  # the trainer user's own policy
OTHER = "p1"
PASSWORDS = {f"{user.upper()}_PASSWORD": f"{user}-test-password" for user in ("controller", "executor", "trainer",
                                                                               "status", "admin", "gateway")}


def render_acl(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """deploy/render-acl.sh, as the compose redis service runs it, with only ``env`` set."""
    return subprocess.run(["sh", str(ROOT / "deploy" / "render-acl.sh"), str(ROOT / "deploy" / "users.acl"), str(path)],
                          env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, timeout=30)


class AclServer:
    """redis-server started from deploy/redis.conf with the deploy ACL file, stopped by pid."""

    def __init__(self) -> None:
        binary = find_redis_server()
        if binary is None:
            pytest.skip("redis-server is not installed")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="rollout-bus-acl-")
        rendered = render_acl(Path(self.dir, "users.acl"), PASSWORDS)
        assert rendered.returncode == 0, rendered.stderr
        self._stderr = Path(self.dir, "stderr").open("wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [binary, str(ROOT / "deploy" / "redis.conf"), "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", self.dir, "--aclfile", f"{self.dir}/users.acl", "--daemonize", "no",
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
        return f"redis://{user}:{user}-test-password@127.0.0.1:{self.port}/0"

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
    assert "no permissions" in str(info.value) or "can't access" in str(info.value), info.value


def producer(role: str) -> s.Producer:
    return s.Producer(role, f"{role}-0")


def test_the_config_runs_with_append_only_persistence(acl_server: AclServer) -> None:
    admin = acl_server.client("admin")
    assert admin.config_get("appendonly") == {"appendonly": "yes"}
    assert admin.config_get("appendfsync") == {"appendfsync": "everysec"}
    assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    assert admin.config_get("protected-mode") == {"protected-mode": "yes"}
    assert "nopass" not in admin.acl_getuser("default")["flags"]  # so protected mode lets only users with a password in
    with socket.create_connection(("127.0.0.1", acl_server.port), timeout=2) as sock:  # the default user is off
        sock.sendall(b"PING\r\n")
        assert sock.recv(64).startswith(b"-NOAUTH")


def test_the_controller_owns_engines_weight_outcomes_and_the_registry(acl_server: AclServer) -> None:
    keys = Keys("ctl")
    ctl = acl_server.client("controller")
    Publisher(acl_server.client("trainer"), keys, producer("trainer")).publish(keys.weight_stream(POLICY), s.WeightsPublished(
        producer=producer("trainer"), policy=POLICY, version=1, uri="file:///w/1", sha256="ab"),
        idempotency_key=f"weights.{POLICY}.1")
    pub = Publisher(ctl, keys, producer("controller"))
    pub.publish(keys.engine_stream, s.EngineReady(producer=producer("controller"), engine_id="e0", url="u"))
    weights = Consumer(ctl, keys, keys.weight_stream(POLICY), "controller", "c-0", ConsumerConfig(block_ms=1))
    applied: list[int] = []

    def apply(msg: Any) -> None:
        if isinstance(msg.event, s.WeightsPublished):
            pub.publish(keys.weight_stream(POLICY), s.WeightsApplied(producer=producer("controller"), policy=POLICY,
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
    exe, admin = acl_server.client("executor"), acl_server.client("admin")
    exe_pub = Publisher(exe, keys, producer("executor"))
    admin.sadd(keys.registered_groups(keys.batch_stream(POLICY)), "left")
    BatchChannel(exe, keys, publisher=exe_pub).publish(POLICY, "b0", {"x": torch.zeros(3)}, request_id="r0")
    admin.zadd(keys.group_beats(keys.batch_stream(POLICY)), {"left": 0})  # a reader that left long ago
    report = Janitor(ctl, keys, pub, JanitorConfig(max_len=0, payload_max_age_s=3600)).run_once()
    assert [e.group for e in report.expired] == ["left"] and report.trimmed.get(f"batches/{POLICY}") == 1
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
    exe.xrange(keys.weight_stream(POLICY))
    pub = Publisher(exe, keys, producer("executor"))
    pub.publish(keys.rollout_stream, s.RolloutStarted(producer=producer("executor"), policy=POLICY, rollout_id=1,
                                                      request_id="req-1", executor="x", attempt=1))
    channel = BatchChannel(exe, keys, publisher=pub)
    entry = channel.publish(POLICY, "batch-1", {"tokens": torch.arange(6, dtype=torch.int32)}, {"k": 1},
                            rollout_id=1, request_id="req-1")
    assert channel.publish(POLICY, "batch-1", {"tokens": torch.arange(6, dtype=torch.int32)}) == entry
    exe.hset(keys.data_cursor(POLICY, "arith"), "offset", 2)

    weights = s.WeightsPublished(producer=producer("executor"), policy=POLICY, version=9, uri="u", sha256="x")
    refused(lambda: pub.publish(keys.weight_stream(POLICY), weights))
    refused(lambda: exe.xadd(keys.weight_stream(POLICY), {"e": b"x"}))
    refused(lambda: exe.hset(keys.engine_registry, "e0", b"x"))
    refused(lambda: exe.xadd(keys.trainer_stream, {"e": b"x"}))


def test_the_gateway_serves_sessions_and_touches_nothing_else(acl_server: AclServer, tmp_path: Path) -> None:
    """The real gateway under its own user: a whole session (open, two turns, an edit refused, close, an offer
    claimed), with a real engine behind it; then what it must not do."""
    from rollout_bus.events.sessions import SessionStore, new_state
    from tests.engine_proc import EngineProcess, call, make_weights_dir
    from tests.support.gateway import GatewayThread

    keys = Keys("gw")
    engine = EngineProcess(make_weights_dir(tmp_path / "tiny", seed=0))
    try:
        Registry(acl_server.client("controller"), keys).put_engine(
            EngineRecord("e0", engine.url, EngineState.SERVING, versions={POLICY: 0}, base_policy=POLICY))
        with GatewayThread(acl_server.url("gateway"), keys, None) as gw:
            assert call(gw.url + "/sessions", "POST", {"session_id": "acl", "policy": POLICY})[0] == 200
            messages = [{"role": "user", "content": "hi"}]
            status, reply = call(gw.session_url("acl") + "/chat/completions", "POST",
                                 {"messages": messages, "max_tokens": 3})
            assert status == 200, reply
            messages += [reply["choices"][0]["message"], {"role": "user", "content": "more"}]
            assert call(gw.session_url("acl") + "/chat/completions", "POST",
                        {"messages": messages, "max_tokens": 3})[0] == 200
            assert call(gw.session_url("acl") + "/chat/completions", "POST",
                        {"messages": [{"role": "user", "content": "edited"}, *messages[1:]]})[0] == 409
            assert call(gw.url + "/sessions/acl/close", "POST", {"reward": 1.0})[0] == 200
            SessionStore(acl_server.client("executor"), keys).create(
                new_state("offered", POLICY, max_context=64))
            SessionStore(acl_server.client("executor"), keys).offer(POLICY, ["offered"])
            status, claimed = call(gw.url + "/sessions/claim", "POST", {"policy": POLICY})
            assert status == 200 and claimed["session"]["id"] == "offered"
    finally:
        engine.stop()
    gateway = acl_server.client("gateway")
    assert len(gateway.xrange(keys.session_stream)) >= 4
    refused(lambda: gateway.xadd(keys.weight_stream(POLICY), {"e": b"x"}))
    refused(lambda: gateway.xadd(keys.batch_stream(POLICY), {"e": b"x"}))
    refused(lambda: gateway.hset(keys.engine_registry, "e0", b"x"))
    refused(lambda: gateway.rpush(f"rq:queue:{keys.rollout_queue}", b"x"))


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
    pub.publish(keys.weight_stream(POLICY), s.WeightsPublished(producer=producer("trainer"), policy=POLICY, version=1,
                                                       uri="file:///w/1", sha256="ab"), idempotency_key=f"weights.{POLICY}.1")
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
    Consumer(acl_server.client("admin"), keys, keys.engine_stream, "watch", "w-0",
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


def test_the_acl_file_is_the_one_events_acl_derives() -> None:
    assert (ROOT / "deploy" / "users.acl").read_text() == acl.render()
    users = {line.split()[1]: line for line in acl.render(POLICY, OTHER).splitlines()}
    assert f"~rb:{{*}}:stream:batches:{OTHER} " in users[f"trainer-{OTHER}"]
    assert f":batches:{POLICY} " not in users[f"trainer-{OTHER}"] and f"#${{TRAINER_{OTHER.upper()}_PASSWORD}}" in users[
        f"trainer-{OTHER}"]


def test_the_acl_file_needs_every_role_password_and_leaves_admin_off_without_one(tmp_path: Path) -> None:
    roles = {k: v for k, v in PASSWORDS.items() if k not in ("ADMIN_PASSWORD", "GATEWAY_PASSWORD")}  # optional
    for missing in roles:
        done = render_acl(tmp_path / "users.acl", {k: v for k, v in roles.items() if k != missing})
        assert done.returncode != 0 and f"set {missing}" in done.stderr
        assert not (tmp_path / "users.acl").exists()
    secret = tmp_path / "trainer-secret"
    secret.write_text("from-a-file")
    env = {**{k: v for k, v in roles.items() if k != "TRAINER_PASSWORD"}, "TRAINER_PASSWORD_FILE": str(secret)}
    assert render_acl(tmp_path / "users.acl", env).returncode == 0
    users = {line.split()[1]: line for line in (tmp_path / "users.acl").read_text().splitlines()}
    for user in ("admin", "replication", "sentinel", "default"):
        assert " off resetpass " in users[user] and "#" not in users[user].split("-@all")[0], users[user]
    for user in ("controller", "executor", "trainer", "status"):
        assert " on #" in users[user] and "${" not in users[user]
    assert hashlib.sha256(b"from-a-file").hexdigest() in users["trainer"]


def acl_log(admin: redis.Redis) -> list[dict[str, Any]]:
    return [e for e in admin.acl_log(count=1000)]


@pytest.mark.timeout(300)
def test_each_role_runs_as_its_own_user_with_nothing_refused(acl_server: AclServer, tmp_path: Path) -> None:
    from rollout_bus.events.paging import page
    from rollout_bus.launch.procs import ProcessSet
    from rollout_bus.tasks.warmstart import WarmStartConfig, warm_start_cached
    from tests.support.fake_rollouts import shared_init_dir

    keys, ns = Keys("run"), "run"
    admin = acl_server.client("admin")
    admin.acl_log_reset()
    batches = keys.batch_stream(POLICY)
    Consumer(admin, keys, batches, "left", "l-0", ConsumerConfig(block_ms=1)).ensure_group()
    admin.zadd(keys.group_beats(batches), {"left": 0})  # a reader that left long ago: the janitor expires it
    init = warm_start_cached(shared_init_dir(), WarmStartConfig())
    procs = ProcessSet(tmp_path / "logs", env={"ROLLOUT_BUS_NAMESPACE": ns})
    role = ["-m", "rollout_bus"]
    try:
        procs.start("controller", [*role, "controller", "--redis-url", acl_server.url("controller"), "--namespace", ns,
                                   "--num-engines", "1", "--model-path", str(init), "--weights-root",
                                   str(tmp_path / "weights"), "--base-policy", POLICY, "--log-dir", str(tmp_path / "logs"),
                                   "--janitor-interval-s", "1", "--retention-max-len", "4"])
        procs.start("executor", [*role, "executor", "--redis-url", acl_server.url("executor"), "--namespace", ns,
                                 "--data-source-args", json.dumps({"digits": 1})])
        trainer = procs.start("trainer", [
            *role, "trainer", "train", "--redis-url", acl_server.url("trainer"), "--namespace", ns, "--policy", POLICY,
            "--trainer-id", "trainer-0", "--mode", "async", "--in-flight", "2", "--steps", "3", "--model-path",
            str(init), "--weights-root", str(tmp_path / "weights"), "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--n-groups", "4", "--n-samples", "4", "--log-dir", str(tmp_path / "metrics")])
        wait_for("the trainer's group", lambda: admin.exists(batches) and "trainer-0" in {
            g["name"].decode() for g in admin.xinfo_groups(batches)}, 120)
        admin.xadd(batches, {b"e": b"garbage"})  # the trainer dead-letters it
        assert trainer.proc.wait(240) == 0, trainer.tail(40)
        admin.xadd(keys.weight_stream(POLICY), {b"e": b"garbage"})  # the controller dead-letters it
        admin.xadd(keys.legacy_weight_stream, {b"e": b"garbage"})  # and on the legacy stream it still reads
        doomed = RolloutRequest.create("ghost", 0, 1, 1, timeout_s=60)  # unknown to the executor: it fails the job
        RolloutSubmitter(acl_server.client("trainer"), keys, SubmitConfig(known_policies=("ghost",))).submit(doomed)

        def failure_paths() -> tuple[set[str], bool]:
            dead = {f[b"group"].decode() for _, f in admin.xrange(keys.dead_letters)}
            failed = [e for _, f in admin.xrange(keys.rollout_stream) if isinstance(e := s.decode(f), s.RolloutFailed)]
            return dead, any(e.request_id == doomed.request_id for e in failed)
        try:
            wait_for("the failure paths", lambda: failure_paths() == ({"controller", "trainer-0"}, True), 60)
        except TimeoutError:
            raise AssertionError(f"dead letters by group, request failed: {failure_paths()}") from None
        def trimmed() -> list[s.Event]:
            return [e for _, f in admin.xrange(keys.housekeeping_stream) if isinstance(e := s.decode(f), s.StreamsTrimmed)]
        wait_for("the janitor's trim (every second, as the controller user)", lambda: bool(trimmed()), 30)
        steps = [e for e in (s.decode(f) for _, f in page(admin, keys.trainer_stream)) if isinstance(e, s.TrainStepDone)]
        assert max(e.step for e in steps) == 3
        served = Registry(admin, keys).policies()[POLICY]
        assert served.serving is not None and served.serving >= 1  # the controller applied the trainer's weights
        assert "left" not in {g["name"].decode() for g in admin.xinfo_groups(batches)}  # the janitor expired it
        shown = subprocess.run([sys.executable, "-m", "rollout_bus", "status", "--redis-url", acl_server.url("status"),
                                "--namespace", ns], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0 and "engine" in shown.stdout.lower(), shown.stderr
        for child in procs.children:
            assert child.alive() or child is trainer, child.tail(40)
    finally:
        procs.stop_all()
    refusals = acl_log(admin)
    assert refusals == [], "\n".join(f"{e.get('username')}: {e.get('reason')} {e.get('object')} ({e.get('context')})"
                                      for e in refusals)


def test_a_trainer_may_add_to_its_own_policys_weight_stream_and_to_no_other(acl_server: AclServer) -> None:
    """Trainer users of two policies, both as ``events/acl.py`` derives them: each publishes its weights on its own
    policy's stream; another policy's stream, and the legacy stream of every policy, refuse it."""
    keys = Keys("wst")
    admin = acl_server.client("admin")
    line = next(u for u in acl.render(POLICY, OTHER).splitlines() if u.split()[1] == f"trainer-{OTHER}")
    password = f"{OTHER}-test-password"
    rules = [f"#{hashlib.sha256(password.encode()).hexdigest()}" if r.startswith("#${") else r
             for r in re.findall(r"\([^)]*\)|\S+", line)[2:]]
    admin.execute_command("ACL", "SETUSER", f"trainer-{OTHER}", "reset", *rules)
    mine, theirs = acl_server.client("trainer"), connect(f"redis://trainer-{OTHER}:{password}@127.0.0.1:{acl_server.port}/0")

    def announce(client: redis.Redis, policy: str, stream: str, version: int = 1) -> str:
        event = s.WeightsPublished(producer=producer("trainer"), policy=policy, version=version, uri="u", sha256="ab")
        return Publisher(client, keys, producer("trainer")).publish(stream, event,
                                                                    idempotency_key=publication_key(policy, version))

    assert announce(mine, POLICY, keys.weight_stream(POLICY))
    assert announce(theirs, OTHER, keys.weight_stream(OTHER))
    refused(lambda: announce(mine, OTHER, keys.weight_stream(OTHER), 2))  # another policy's publication
    refused(lambda: announce(mine, POLICY, keys.weight_stream(OTHER), 2))  # its own, on another policy's stream
    refused(lambda: mine.xadd(keys.weight_stream(OTHER), {"e": b"x"}))
    refused(lambda: theirs.xadd(keys.weight_stream(POLICY), {"e": b"x"}))
    for client in (mine, theirs):  # the one stream every policy shared before: nobody's to write now
        refused(lambda c=client: c.xadd(keys.legacy_weight_stream, {"e": b"x"}))  # type: ignore[misc]
    assert [s.decode(f).policy for _, f in admin.xrange(keys.weight_stream(OTHER))] == [OTHER]  # type: ignore[attr-defined]
    assert [s.decode(f).policy for _, f in admin.xrange(keys.weight_stream(POLICY))] == [POLICY]  # type: ignore[attr-defined]
    assert not admin.exists(keys.legacy_weight_stream)
    admin.execute_command("ACL", "DELUSER", f"trainer-{OTHER}")


_DEL_SCRIPT = "return redis.call('DEL', KEYS[1])"


def forbidden(client: redis.Redis, keys: Keys) -> dict[str, Callable[[], Any]]:
    """Operations no role but the owner of the key may do (each one named in a refusal message)."""
    batches, weights = keys.batch_stream(POLICY), keys.weight_stream(POLICY)
    sha = hashlib.sha1(_DEL_SCRIPT.encode()).hexdigest()  # loaded by the admin
    return {
        "DEL dead letters": lambda: client.delete(keys.dead_letters),
        "XTRIM dead letters": lambda: client.xtrim(keys.dead_letters, maxlen=0),
        "DEL a batch stream": lambda: client.delete(batches),
        "XTRIM a batch stream": lambda: client.xtrim(batches, maxlen=0),
        "DEL the rollout stream": lambda: client.delete(keys.rollout_stream),
        "XTRIM the rollout stream": lambda: client.xtrim(keys.rollout_stream, maxlen=0),
        "DEL the weights stream": lambda: client.delete(weights),
        "XTRIM the weights stream": lambda: client.xtrim(weights, maxlen=0),
        "DEL a stream from a script": lambda: client.evalsha(sha, 1, batches),
        "XACK the controller's weights entries": lambda: client.xack(weights, "controller", "1-0"),
        "XAUTOCLAIM the controller's weights entries": lambda: client.xautoclaim(weights, "controller", "x", 0),
        "XREADGROUP as the controller": lambda: client.xreadgroup("controller", "x", {weights: ">"}),
        "XGROUP DESTROY the controller's group": lambda: client.xgroup_destroy(weights, "controller"),
        "forge the controller's group beat": lambda: client.zadd(keys.group_beats(weights), {"controller": 0}),
        "unregister the controller's group": lambda: client.srem(keys.registered_groups(weights), "controller"),
        "HSET the engine registry": lambda: client.hset(keys.engine_registry, "e0", b"x"),
        "SET the controller lease": lambda: client.set(keys.controller_lease, "me"),
        "INCR the fencing counter": lambda: client.incr(keys.controller_fence),
        "XADD the engine stream": lambda: client.xadd(keys.engine_stream, {"e": b"x"}),
        "XADD the command stream": lambda: client.xadd(keys.command_stream, {"e": b"x"}),
        "stop an executor (rq command)": lambda: client.publish("rq:pubsub:host-executor-0", '{"command": "shutdown"}'),
        "FLUSHALL": lambda: client.flushall(),
        "CONFIG SET": lambda: client.config_set("appendonly", "no"),
        "CLIENT LIST": lambda: client.client_list(),
        "KEYS": lambda: client.keys("*"),
    }


def _check_refused(user: str, client: redis.Redis, ops: dict[str, Callable[[], Any]]) -> None:
    allowed = []
    for name, op in ops.items():
        try:
            op()
        except (redis.exceptions.NoPermissionError, RedisCommandError) as exc:
            text = str(exc)
            assert "no permissions" in text or "can't access" in text, f"{name}: {text}"
            continue
        except redis.exceptions.ResponseError as exc:
            if "NOPERM" in str(exc) or "no permissions" in str(exc) or "can't access" in str(exc):
                continue
            allowed.append(f"{name} ({exc})")
            continue
        allowed.append(name)
    assert allowed == [], f"{user} may still: {allowed}"


def test_what_each_role_must_not_do_gets_noperm(acl_server: AclServer) -> None:
    keys = Keys("deny")
    admin = acl_server.client("admin")
    for stream in (keys.weight_stream(POLICY), keys.command_stream):
        Consumer(admin, keys, stream, "controller", "c-0", ConsumerConfig(block_ms=1)).ensure_group()
    admin.xadd(keys.dead_letters, {"e": b"x"})
    admin.script_load(_DEL_SCRIPT)
    admin.acl_log_reset()
    other, other_batches = keys.trainer_lease(OTHER), keys.batch_stream(OTHER)
    payload_of_other = keys.payload(f"{OTHER}:b0:00")

    executor = acl_server.client("executor")
    _check_refused("executor", executor, {
        **forbidden(executor, keys),
        "XADD dead letters": lambda: executor.xadd(keys.dead_letters, {"e": b"x"}),
        "XADD the weights stream": lambda: executor.xadd(keys.weight_stream(POLICY), {"e": b"x"}),
        "XADD the trainer stream": lambda: executor.xadd(keys.trainer_stream, {"e": b"x"}),
        "forge a batch group's beat": lambda: executor.zadd(keys.group_beats(other_batches), {"trainer-p1": 0}),
        "register a batch group": lambda: executor.sadd(keys.registered_groups(other_batches), "ghost"),
        "XGROUP DESTROY a trainer's group": lambda: executor.xgroup_destroy(other_batches, "trainer-p1"),
        "XREADGROUP a trainer's batches": lambda: executor.xreadgroup("trainer-p1", "x", {other_batches: ">"}),
        "SET a trainer lease": lambda: executor.hset(other, "0", "x"),
        "XADD an rq result into the bus": lambda: executor.xadd(keys.housekeeping_stream, {"e": b"x"}),
    })
    trainer = acl_server.client("trainer")
    _check_refused("trainer", trainer, {
        **{name: op for name, op in forbidden(trainer, keys).items()
           if name != "XADD the command stream"},  # a colocated trainer offloads and onloads its engines
        "take another policy's lease": lambda: trainer.hset(other, "0", "trainer-x"),
        "drop another policy's lease": lambda: trainer.delete(other),
        "expire another policy's lease": lambda: trainer.pexpire(other, 1),
        "read another policy's batches as a group": lambda: trainer.xreadgroup("g", "x", {other_batches: ">"}),
        "ack another policy's batches": lambda: trainer.xack(other_batches, "trainer-p1", "1-0"),
        "beat for another policy's group": lambda: trainer.zadd(keys.group_beats(other_batches), {"trainer-p1": 0}),
        "delete another policy's payload": lambda: trainer.delete(payload_of_other),
        "XADD another policy's weight stream": lambda: trainer.xadd(keys.weight_stream(OTHER), {"e": b"x"}),
        "XADD the legacy weights stream": lambda: trainer.xadd(keys.legacy_weight_stream, {"e": b"x"}),
        "claim another policy's publication": lambda: trainer.set(keys.dedupe(keys.weight_stream(OTHER),
                                                                             f"weights.{OTHER}.7"), "1-0"),
        "XADD a batch": lambda: trainer.xadd(keys.batch_stream(POLICY), {"e": b"x"}),
        "write a payload": lambda: trainer.set(keys.payload(f"{POLICY}:b0:00"), b"x"),
        "write a data cursor": lambda: trainer.hset(keys.data_cursor(POLICY, "arith"), "state", b"x"),
        "write a policy record": lambda: trainer.hset(keys.policy_registry, POLICY, b"x"),
        "mark a job started (rq)": lambda: trainer.zadd(f"rq:wip:{keys.rollout_queue}", {"job": 0}),
        "delete the rq queue": lambda: trainer.delete(f"rq:queue:{keys.rollout_queue}"),
        "register an rq worker": lambda: trainer.sadd("rq:workers", "rq:worker:x"),
    })
    controller = acl_server.client("controller")
    _check_refused("controller", controller, {
        "write a trainer lease": lambda: controller.hset(keys.trainer_lease(POLICY), "0", "ctl"),
        "delete a trainer lease": lambda: controller.delete(keys.trainer_lease(POLICY)),
        "extend a trainer lease": lambda: controller.pexpire(keys.trainer_lease(POLICY), 60_000),
        "XADD a batch": lambda: controller.xadd(keys.batch_stream(POLICY), {"e": b"x"}),
        "write a payload": lambda: controller.set(keys.payload(f"{POLICY}:b0:00"), b"x"),
        "XADD the rollout stream": lambda: controller.xadd(keys.rollout_stream, {"e": b"x"}),
        "XADD the trainer stream": lambda: controller.xadd(keys.trainer_stream, {"e": b"x"}),
        "queue an rq job": lambda: controller.hset("rq:job:x", "data", b"x"),
        "stop an executor (rq command)": lambda: controller.publish("rq:pubsub:host-executor-0", "x"),
        "FLUSHALL": lambda: controller.flushall(),
        "CONFIG SET": lambda: controller.config_set("appendonly", "no"),
    })
    status = acl_server.client("status")
    _check_refused("status", status, {**forbidden(status, keys), "XADD anything": lambda: status.xadd(keys.engine_stream, {"e": 1})})
    refused_users = {e["username"] for e in acl_log(admin)}
    assert {"executor", "trainer", "controller", "status"} <= refused_users  # Redis logged each refusal


def test_the_controller_creates_the_bus_epoch_every_role_reads_it_and_writers_record_degraded_writes(
        acl_server: AclServer) -> None:
    from rollout_bus.events.epoch import BusEpoch

    keys = Keys("epoch")
    executor = BusEpoch(acl_server.client("executor"), keys)
    assert executor.join() is None  # not its to create (NOPERM is not an error): it adopts the first it sees
    created = BusEpoch(acl_server.client("controller"), keys, create=True).join()
    assert created
    for role in ("executor", "trainer", "status"):
        assert BusEpoch(acl_server.client(role), keys).join() == created
    executor.check()
    assert executor.value == created
    for role in ("controller", "executor", "trainer"):  # a degraded durable write says so in the status hash
        acl_server.client(role).hset(keys.durability_status, role, "{}")
    assert set(bus_snapshot(acl_server.client("status"), keys).degraded) == {"controller", "executor", "trainer"}


def test_a_colocated_trainer_may_send_offload_and_onload_commands_under_its_user(acl_server: AclServer) -> None:
    """``trainer/colocate.py`` sends its pool's offload and onload on the commands stream as the trainer user."""
    keys = Keys("colocate")
    admin = acl_server.client("admin")
    admin.acl_log_reset()
    trainer = acl_server.client("trainer")
    producer = s.Producer("trainer", "host-0")
    for command in (s.OffloadEngines, s.OnloadEngines):
        Publisher(trainer, keys, producer).publish(keys.command_stream, command(
            producer=producer, tags=["weights"], policy=POLICY, request_id="colocate-1"))
    sent = [s.decode(f) for _, f in admin.xrange(keys.command_stream)]
    assert [type(e).__name__ for e in sent] == ["OffloadEngines", "OnloadEngines"]
    assert acl_log(admin) == []
