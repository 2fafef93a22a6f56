"""The trainer over several Redis shards (``trainer.redis_shards``): where requests go, where batches come from and
are acked, what happens to the requests of a lost shard; the settings that refuse shards."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import fakeredis
import pytest

from rollout_bus.events.errors import BusUnavailable
from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import PolicyRecord, Registry
from rollout_bus.events.rollouts import RolloutRequest
from rollout_bus.events.schema import BatchConsumed, Producer, RolloutRequested, TrainerJoined, decode
from rollout_bus.executor.output import BatchSink
from rollout_bus.launch.config import RunConfig, RunFailed
from rollout_bus.launch.job import run_job
from rollout_bus.launch.shards import shard_problems, split_urls
from rollout_bus.trainer.cli import parse, trainer_config
from rollout_bus.trainer.client import ClientConfig, RolloutClient
from rollout_bus.trainer.config import ConfigError, PublishConfig, TrainerConfig
from rollout_bus.trainer.redis_shards import ShardedClient, ShardSet, ShardSettings
from rollout_bus.trainer.weights import WeightPublisher
from tests.support.fake_rollouts import fake_batch

URLS = ["fake://a", "fake://b", "fake://c"]


class Fleet:
    """Three fake Redis servers as three shards, and a sharded client over them."""

    def __init__(self, keys: Keys, tmp: Path, settings: ShardSettings | None = None) -> None:
        self.keys = keys
        self.servers = {url: fakeredis.FakeServer() for url in URLS}
        self.raw = {url: fakeredis.FakeRedis(server=self.servers[url]) for url in URLS}
        for c in self.raw.values():
            Registry(c, keys).put_policy(PolicyRecord("alpha", serving=0))
        config = ClientConfig(policy="alpha", trainer_id="t_one", group="t_one", block_ms=10)
        producer = Producer("trainer", "x")

        def factory(index: int, url: str, client: fakeredis.FakeRedis) -> tuple[RolloutClient, WeightPublisher]:
            rollouts = RolloutClient(client, keys, config, producer)
            return rollouts, WeightPublisher(client, keys, "alpha", tmp, producer, keep_versions=0,
                                             lease=rollouts.lease)

        self.shards = ShardSet(URLS, keys, factory, settings or ShardSettings(probe_s=60.0),
                               connect_fn=lambda url: fakeredis.FakeRedis(server=self.servers[url]))
        self.client = ShardedClient(self.shards, config)
        self.client.start()

    def queued(self, url: str) -> list[str]:
        return [decode(f).request_id for _, f in page(self.raw[url], self.keys.rollout_stream)
                if isinstance(decode(f), RolloutRequested)]

    def deliver(self, url: str, request_id: str, rollout_id: int) -> None:
        c = self.raw[url]
        BatchSink(c, self.keys, Publisher(c, self.keys, Producer("executor", "x"))).publish(
            RolloutRequest(policy="alpha", rollout_id=rollout_id, n_groups=1, n_samples_per_group=2,
                           request_id=request_id), fake_batch(1, 2, rollout_id=rollout_id, version=0))


@pytest.fixture()
def fleet(keys: Keys, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(keys, tmp_path)
    yield f
    f.client.stop()


def test_requests_spread_over_the_shards_by_what_each_has_in_flight(fleet: Fleet) -> None:
    for r in range(6):
        fleet.client.request(r, fleet.client.request_id("run", r))
    assert sorted(len(fleet.queued(u)) for u in URLS) == [2, 2, 2]
    everywhere = [rid for u in URLS for rid in fleet.queued(u)]
    assert len(everywhere) == len(set(everywhere)) == 6  # each request on one shard only
    # a shard whose requests were answered gets the next one
    first = fleet.queued(URLS[1])[0]
    rollout = int(first.rsplit("-r", 1)[1])
    fleet.deliver(URLS[1], first, rollout)
    batch = fleet.client.get(rollout, timeout_s=2.0)
    assert batch.shard == 1
    fleet.client.ack(batch, staleness=0, accepted=True)
    fleet.client.request(6, fleet.client.request_id("run", 6))
    assert fleet.client.pending[6].shard == 1


def test_batches_come_from_every_shard_and_are_acked_where_they_came_from(fleet: Fleet, keys: Keys) -> None:
    for r in range(3):
        fleet.client.request(r, fleet.client.request_id("run", r))
    where = {fleet.client.pending[r].shard: (fleet.client.pending[r].request.request_id, r) for r in range(3)}
    for shard, (request_id, r) in sorted(where.items(), reverse=True):  # shard 2's first
        fleet.deliver(URLS[shard], request_id, r)
    got = [fleet.client.next(timeout_s=2.0) for _ in range(3)]
    assert sorted(b.shard for b in got) == [0, 1, 2]
    for b in got:
        fleet.client.ack(b, staleness=0, accepted=True)
    for shard, url in enumerate(URLS):
        consumed = [e for _, f in page(fleet.raw[url], keys.trainer_stream)
                    if isinstance(e := decode(f), BatchConsumed)]
        assert [e.batch_id for e in consumed] == [f"batch-{where[shard][0]}"]  # the ack went to its own shard
    assert not fleet.client.pending


def test_a_lost_shards_requests_go_elsewhere_unless_their_batch_is_held(fleet: Fleet) -> None:
    for r in range(6):
        fleet.client.request(r, fleet.client.request_id("run", r))
    on_lost = [(r, p.request.request_id) for r, p in fleet.client.pending.items() if p.shard == 2]
    assert len(on_lost) == 2
    (held_r, held_id), (moved_r, moved_id) = on_lost
    fleet.deliver(URLS[2], held_id, held_r)
    fleet.client.poll()
    assert [b.request_id for b in fleet.client.buffered()] == [held_id]
    fleet.shards.lose(fleet.shards.shards[2], "test: the shard is gone")
    assert fleet.shards.stats.resubmitted == 1
    moved_to = fleet.client.pending[moved_r].shard
    assert moved_to in (0, 1) and moved_id in fleet.queued(URLS[moved_to])
    assert fleet.client.pending[held_r].shard == 2  # its batch is here: trained as any other
    # the held batch is still handed over; its ack cannot reach the lost shard and is counted as such
    batch = fleet.client.get(held_r, timeout_s=2.0)
    fleet.client.ack(batch, staleness=0, accepted=True)
    assert fleet.shards.stats.acks_lost == 1
    # new requests go to the live shards only
    for r in range(6, 10):
        fleet.client.request(r, fleet.client.request_id("run", r))
        assert fleet.client.pending[r].shard in (0, 1)


def test_with_every_shard_lost_a_request_fails_saying_so(fleet: Fleet) -> None:
    for shard in fleet.shards.shards:
        fleet.shards.lose(shard, "test")
    with pytest.raises(BusUnavailable, match="every Redis shard"):
        fleet.client.request(0, fleet.client.request_id("run", 0))


def test_shard_settings_and_urls_are_checked() -> None:
    with pytest.raises(ValueError):
        ShardSettings(lost_after_s=0)
    with pytest.raises(ValueError, match="same Redis"):
        split_urls("redis://a:1,redis://a:1")
    with pytest.raises(ValueError, match="empty"):
        split_urls("redis://a:1,,redis://b:1")
    assert split_urls("redis://a:1, redis://b:1") == ["redis://a:1", "redis://b:1"]
    sentinel = "redis+sentinel://h1:26379,h2:26379,h3:26379/main"
    assert split_urls(sentinel) == [sentinel]  # one shard: a Sentinel group's own commas
    assert split_urls(f"{sentinel},redis+sentinel://h4:26379,h5:26379/other,redis://c:1") == [
        sentinel, "redis+sentinel://h4:26379,h5:26379/other", "redis://c:1"]
    base = TrainerConfig(publish=PublishConfig(weights_root="/tmp/w"))
    with pytest.raises(ConfigError, match="shards"):
        TrainerConfig(shards=["redis://a:1", "redis://b:1"],
                      publish=PublishConfig(weights_root="/tmp/w", weight_sync="broadcast")).validate()
    with pytest.raises(ConfigError, match="two or more different"):
        TrainerConfig(shards=["redis://a:1", "redis://a:1"], publish=base.publish).validate()
    ns = parse(["train", "--weights-root", "/tmp/w", "--redis-url", "redis://a:1", "--shard-url", "redis://b:1"])
    assert trainer_config(ns).shards == ["redis://a:1", "redis://b:1"]
    assert trainer_config(parse(["train", "--weights-root", "/tmp/w"])).shards == []
    assert shard_problems(RunConfig(colocate=True, mode="sync"), 2) and not shard_problems(RunConfig(), 2)
    assert not shard_problems(RunConfig(colocate=True, mode="sync"), 1)


def test_a_run_refuses_shard_counts_its_urls_do_not_match(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    with pytest.raises(RunFailed, match="as many urls as shards"):
        run_job(RunConfig(shards=3, redis_url="redis://127.0.0.1:1,redis://127.0.0.1:2", out=str(tmp_path)))
    with pytest.raises(RunFailed, match="one Redis url"):
        run_job(RunConfig(shards=2, redis_url="redis://127.0.0.1:1", out=str(tmp_path)))
    with pytest.raises(RunFailed, match="does not go with"):
        run_job(RunConfig(shards=2, weight_sync="broadcast", out=str(tmp_path)))


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_shard_that_stops_answering_is_lost_then_rejoins_when_it_answers_again(keys: Keys, tmp_path: Path) -> None:
    f = Fleet(keys, tmp_path, ShardSettings(probe_s=0.05, lost_after_s=0.5, rejoin_after_s=0.3))
    try:
        for r in range(3):
            f.client.request(r, f.client.request_id("run", r))
        on_b = next(r for r, p in f.client.pending.items() if p.shard == 1)
        f.servers[URLS[1]].connected = False  # the server stops answering: connections fail
        wait_until(lambda: f.shards.shards[1].suspect)  # left out at the first failed probe ...
        f.client.request(3, f.client.request_id("run", 3))
        assert f.client.pending[3].shard in (0, 2) and f.client.pending[on_b].shard == 1  # ... its requests stay
        wait_until(lambda: f.client.poll() >= 0 and f.shards.stats.lost == 1)  # lost: the trainer's thread acts
        assert not f.shards.shards[1].up
        assert f.client.pending[on_b].shard in (0, 2)  # its request in flight went elsewhere
        f.servers[URLS[1]].connected = True
        wait_until(lambda: f.client.poll() >= 0 and f.shards.stats.rejoined == 1)
        assert f.shards.shards[1].up and not f.shards.shards[1].suspect
        joined = [e for _, fields in page(f.raw[URLS[1]], keys.trainer_stream)
                  if isinstance(e := decode(fields), TrainerJoined)]
        assert len(joined) == 2  # joined again on the new client (lease, group)
        f.client.request(4, f.client.request_id("run", 4))
        assert f.client.pending[4].shard == 1  # the emptiest shard again
    finally:
        f.client.stop()


def test_a_shard_that_answers_again_before_it_is_lost_keeps_its_requests(keys: Keys, tmp_path: Path) -> None:
    f = Fleet(keys, tmp_path, ShardSettings(probe_s=0.05, lost_after_s=60.0, rejoin_after_s=0.2))
    try:
        for r in range(3):
            f.client.request(r, f.client.request_id("run", r))
        on_c = next(r for r, p in f.client.pending.items() if p.shard == 2)
        request_id = f.client.pending[on_c].request.request_id
        f.servers[URLS[2]].connected = False
        wait_until(lambda: f.shards.shards[2].suspect)
        f.client.poll()  # no call waits on it: it is left out at once
        f.servers[URLS[2]].connected = True
        wait_until(lambda: f.client.poll() >= 0 and f.shards.stats.rejoined == 1)
        assert f.shards.stats.lost == 0 and f.shards.stats.resubmitted == 0
        assert f.client.pending[on_c].shard == 2
        f.deliver(URLS[2], request_id, on_c)  # its executor finishes the request: the new client reads it
        batch = f.client.get(on_c, timeout_s=2.0)
        assert batch.shard == 2 and batch.request_id == request_id
        f.client.ack(batch, staleness=0, accepted=True)
        assert f.shards.stats.acks_lost == 0
    finally:
        f.client.stop()


def test_a_batch_held_when_its_shard_stops_answering_is_handed_over_once_after_it_answers(
        keys: Keys, tmp_path: Path) -> None:
    f = Fleet(keys, tmp_path, ShardSettings(probe_s=0.05, lost_after_s=60.0, rejoin_after_s=0.2))
    try:
        for r in range(3):
            f.client.request(r, f.client.request_id("run", r))
        on_a = next(r for r, p in f.client.pending.items() if p.shard == 0)
        f.deliver(URLS[0], f.client.pending[on_a].request.request_id, on_a)
        wait_until(lambda: f.client.poll() >= 0 and len(f.client.buffered()) == 1)
        f.servers[URLS[0]].connected = False
        wait_until(lambda: f.shards.shards[0].suspect)
        f.servers[URLS[0]].connected = True
        wait_until(lambda: f.client.poll() >= 0 and f.shards.stats.rejoined == 1)
        for _ in range(3):
            f.client.poll()  # the new client reads its pending entries again: the same entry is not buffered twice
        held = f.client.buffered()
        assert [b.rollout_id for b in held] == [on_a], held
        batch = f.client.get(on_a, timeout_s=2.0)
        f.client.ack(batch, staleness=0, accepted=True)
        assert f.shards.stats.acks_lost == 0
        consumed = [e for _, fields in page(f.raw[URLS[0]], keys.trainer_stream)
                    if isinstance(e := decode(fields), BatchConsumed)]
        assert len(consumed) == 1
    finally:
        f.client.stop()
