"""The trainer's client: deterministic request ids, get(rollout_id) in any arrival order, acks."""

from __future__ import annotations

import time
from typing import Any

import fakeredis
import pytest

from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import PolicyRecord, Registry
from rollout_bus.events.rollouts import RolloutRequest
from rollout_bus.events.schema import BatchConsumed, Producer, RolloutRequested, TrainerJoined, decode
from rollout_bus.executor.output import BatchSink
from rollout_bus.trainer.client import ClientConfig, RolloutClient
from rollout_bus.trainer.lease import PolicyLease, PolicyTaken
from tests.support.fake_rollouts import fake_batch


def make_client(client: fakeredis.FakeRedis, keys: Keys) -> RolloutClient:
    Registry(client, keys).put_policy(PolicyRecord("alpha", serving=0))
    rc = RolloutClient(client, keys, ClientConfig(policy="alpha", trainer_id="t_one", group="t_one", block_ms=10),
                       Producer("trainer", "x"))
    rc.start()
    return rc


def publish(client: fakeredis.FakeRedis, keys: Keys, request_id: str, rollout_id: int) -> None:
    sink = BatchSink(client, keys, Publisher(client, keys, Producer("executor", "x")))
    sink.publish(RolloutRequest(policy="alpha", rollout_id=rollout_id, n_groups=1, n_samples_per_group=2,
                                request_id=request_id), fake_batch(1, 2, rollout_id=rollout_id, version=0))


def test_requests_are_queued_once_under_deterministic_ids(keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    rc = make_client(client, keys)
    rid = rc.request_id("run1", 7)
    assert rid == "t_one-run1-r7" and rc.request_id("run1", 7, attempt=2) == "t_one-run1-r7-a2"
    rc.request(7, rid)
    rc.request(7, rid)  # a repeat after a restart
    events = [decode(f) for _, f in page(client, keys.rollout_stream)]
    assert [e.request_id for e in events if isinstance(e, RolloutRequested)] == [rid]
    assert client.llen(f"rq:queue:{keys.rollout_queue}") == 1
    joined = [decode(f) for _, f in page(client, keys.trainer_stream)]
    assert isinstance(joined[0], TrainerJoined) and joined[0].group == "t_one"


def test_get_hands_over_the_batch_of_the_rollout_asked_for(keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    rc = make_client(client, keys)
    publish(client, keys, "x-r2", 2)
    publish(client, keys, "x-r1", 1)
    first = rc.get(1, timeout_s=2.0)
    assert first.rollout_id == 1 and first.data is not None and len(first.data) == 2
    assert [b.rollout_id for b in rc.buffered()] == [2]
    second = rc.get(2, timeout_s=2.0)
    rc.ack(first, staleness=0, accepted=True)
    rc.ack(first, staleness=0, accepted=True)  # a repeated ack announces nothing new
    rc.ack(second, staleness=1, accepted=False)
    consumed = [decode(f) for _, f in page(client, keys.trainer_stream)]
    consumed = [e for e in consumed if isinstance(e, BatchConsumed)]
    assert [(c.batch_id, c.staleness, c.accepted) for c in consumed] == [
        ("batch-x-r1", 0, True), ("batch-x-r2", 1, False)]
    assert client.xpending(keys.batch_stream("alpha"), "t_one")["pending"] == 0


def test_a_new_client_under_the_same_name_re_reads_its_pending_batches_first(keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    rc = make_client(client, keys)
    publish(client, keys, "x-r0", 0)
    held = rc.get(0, timeout_s=2.0)  # delivered, never acked: the trainer died
    restarted = make_client(client, keys)
    publish(client, keys, "x-r1", 1)
    again = restarted.get(0, timeout_s=2.0)
    assert again.batch_id == held.batch_id and again.deliveries == 2
    assert restarted.get(1, timeout_s=2.0).rollout_id == 1  # and then moves on to new entries


def test_a_second_trainer_of_the_same_policy_is_refused_with_a_message_naming_the_first(keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    first = make_client(client, keys)
    second = RolloutClient(client, keys, ClientConfig(policy="alpha", trainer_id="intruder", group="intruder",
                                                      lease_ttl_s=0.5), Producer("trainer", "y"))
    with pytest.raises(PolicyTaken, match="already trained by 't_one'.*--dp-rank and --dp-size"):
        second.start()
    assert not client.sismember(keys.registered_groups(keys.batch_stream("alpha")), "intruder")
    first.stop()
    second.start()  # once the first is gone, the policy is free
    second.stop()


def test_ranks_of_one_data_parallel_trainer_join_but_a_rank_held_elsewhere_is_refused(keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    Registry(client, keys).put_policy(PolicyRecord("alpha", serving=0))
    leases = [PolicyLease(client, keys, "alpha", "dp", rank=r, dp_size=2, ttl_s=5) for r in range(2)]
    for lease in leases:
        lease.acquire()
    elsewhere = PolicyLease(client, keys, "alpha", "dp", rank=1, dp_size=2, ttl_s=5, wait_s=0.3)
    elsewhere.host = "another-host"  # a process we cannot check: only the lapse frees its rank
    with pytest.raises(PolicyTaken, match=r"rank 1 held by"):
        elsewhere.acquire()
    for lease in leases:
        lease.release()
    assert not client.exists(keys.trainer_lease("alpha"))


def test_a_lease_whose_holder_stopped_renewing_is_taken_once_it_lapsed(keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    gone = PolicyLease(client, keys, "alpha", "old", ttl_s=0.3)
    gone.host = "another-host"
    gone.acquire()
    gone._stop.set()  # it died: no renewal, no release
    newcomer = PolicyLease(client, keys, "alpha", "new", ttl_s=0.3, wait_s=5)
    newcomer.acquire()
    assert client.hget(keys.trainer_lease("alpha"), "owner") == b"new/1"
    newcomer.release()


def test_a_batch_waiting_in_the_buffer_is_neither_reclaimed_nor_dead_lettered(keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    Registry(client, keys).put_policy(PolicyRecord("alpha", serving=0))
    rc = RolloutClient(client, keys, ClientConfig(policy="alpha", trainer_id="t_one", group="t_one", block_ms=10,
                                                  claim_idle_ms=200), Producer("trainer", "x"))
    rc.consumer.config.claim_every_ms = 0  # claims run on every read
    rc.consumer.config.max_deliveries = 2
    rc.start()
    publish(client, keys, "x-r1", 1)
    assert rc.wait_for(1, timeout_s=2.0)  # buffered; the trainer works on something else meanwhile
    stream = keys.batch_stream("alpha")
    deadline = time.monotonic() + 1.5  # over seven times the claim idle
    while time.monotonic() < deadline:
        rc.poll(block_ms=10)
    (row,) = client.xpending_range(stream, "t_one", min="-", max="+", count=10)
    assert row["times_delivered"] == 1
    assert client.xlen(keys.dead_letters) == 0
    assert rc.get(1, timeout_s=0.1).deliveries == 1


@pytest.mark.parametrize("crash_after", [1, 2], ids=["after-first-write", "after-second-write"])
def test_a_crash_in_the_middle_of_an_ack_loses_neither_the_event_nor_the_payload(
        keys: Keys, crash_after: int, monkeypatch: pytest.MonkeyPatch) -> None:
    client = fakeredis.FakeRedis()
    rc = make_client(client, keys)
    publish(client, keys, "x-r0", 0)
    batch = rc.get(0, timeout_s=2.0)
    done: list[str] = []

    class Died(Exception):
        """The trainer process dies here."""

    def step(name: str, real: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            result = real(*args, **kwargs)
            done.append(name)
            if len(done) == crash_after:
                raise Died(f"killed after {done}")
            return result
        return run
    monkeypatch.setattr(rc.consumer, "ack", step("xack", rc.consumer.ack))
    monkeypatch.setattr(rc.publisher, "publish", step("event", rc.publisher.publish))
    monkeypatch.setattr(rc.payloads, "release", step("release", rc.payloads.release))
    with pytest.raises(Died):
        rc.ack(batch, staleness=0, accepted=True)
    assert len(done) == crash_after  # the crash landed between two writes

    restarted = make_client(client, keys)  # the same consumer name: its pending entries come back
    again = restarted.get(0, timeout_s=2.0)
    restarted.ack(again, staleness=0, accepted=True)
    consumed = [e for e in (decode(f) for _, f in page(client, keys.trainer_stream)) if isinstance(e, BatchConsumed)]
    assert [(c.batch_id, c.accepted) for c in consumed] == [("batch-x-r0", True)]
    assert client.zcard(keys.payload_index) == 0  # released: the only group read it
    assert not client.exists(keys.payload_chunk(batch.event.payload["ref"], 0))
    assert client.xpending(keys.batch_stream("alpha"), "t_one")["pending"] == 0


def test_every_request_id_of_a_trainer_with_a_long_valid_id_is_a_valid_request_id(keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    Registry(client, keys).put_policy(PolicyRecord("alpha", serving=0))
    long_id = "trainer." + "x" * 56  # 64 characters: a valid trainer id
    rc = RolloutClient(client, keys, ClientConfig(policy="alpha", trainer_id=long_id, group="g"),
                       Producer("trainer", "x"))
    ids = {rc.request_id("a1b2c3d4", rollout, attempt) for rollout in (0, 7, 10**9) for attempt in (1, 2, 999)}
    for request_id in ids:
        RolloutRequest(policy="alpha", rollout_id=1, n_groups=1, n_samples_per_group=1,
                       request_id=request_id).validate()
    base = rc.request_id("a1b2c3d4", 7)
    assert rc.request_id("a1b2c3d4", 7, 3).startswith(base + "-a")  # attempts still match their rollout
