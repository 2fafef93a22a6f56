"""The trainer's client: deterministic request ids, get(rollout_id) in any arrival order, acks."""

from __future__ import annotations

import fakeredis

from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import PolicyRecord, Registry
from rollout_bus.events.rollouts import RolloutRequest
from rollout_bus.events.schema import BatchConsumed, Producer, RolloutRequested, TrainerJoined, decode
from rollout_bus.executor.output import BatchSink
from rollout_bus.trainer.client import ClientConfig, RolloutClient
from tests.support.fake_rollouts import fake_batch


def make_client(client: fakeredis.FakeRedis, keys: Keys) -> RolloutClient:
    Registry(client, keys).put_policy(PolicyRecord("alpha", serving=0))
    rc = RolloutClient(client, keys, ClientConfig(policy="alpha", trainer_id="t.one", group="t.one", block_ms=10),
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
    assert isinstance(joined[0], TrainerJoined) and joined[0].group == "t.one"


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
    assert client.xpending(keys.batch_stream("alpha"), "t.one")["pending"] == 0


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
