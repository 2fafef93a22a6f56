"""The bus epoch on fakeredis: created once, checked, and a reset (the key gone or replaced) is a BusReset."""

from __future__ import annotations

import threading

import pytest
import redis

from rollout_bus.events.epoch import BusEpoch, EpochWatch, create_epoch
from rollout_bus.events.errors import BusReset, Failure
from rollout_bus.events.names import Keys


def test_the_epoch_is_created_once_and_every_later_join_sees_the_same(fake_client: redis.Redis, keys: Keys) -> None:
    first = create_epoch(fake_client, keys)
    later = BusEpoch(fake_client, keys)
    assert later.join() == first.value and first.value
    later.check()  # nothing changed


@pytest.mark.parametrize("fault", ["flushall", "replaced"])
def test_an_epoch_gone_or_replaced_is_a_bus_reset_that_names_the_namespace(
        fake_client: redis.Redis, keys: Keys, fault: str) -> None:
    epoch = create_epoch(fake_client, keys)
    if fault == "flushall":
        fake_client.flushall()
    else:  # a role started on the emptied Redis made a new one
        fake_client.set(keys.bus_epoch, "another")
    with pytest.raises(BusReset, match=f"namespace {keys.namespace}: its bus epoch {epoch.value} "):
        epoch.check()
    assert issubclass(BusReset, Failure)


def test_a_watch_reports_the_reset_from_its_thread_within_its_interval(fake_client: redis.Redis, keys: Keys) -> None:
    seen: list[BusReset] = []
    done = threading.Event()
    watch = EpochWatch(BusEpoch(fake_client, keys, create=True), lambda exc: (seen.append(exc), done.set()), interval_s=0.02)
    watch.start()
    try:
        fake_client.delete(keys.bus_epoch)
        assert done.wait(2)
    finally:
        watch.stop()
    assert watch.reset is seen[0] and "is gone" in str(seen[0])


def test_a_role_that_does_not_create_the_epoch_only_reads_it_and_adopts_the_first_it_sees(
        fake_client: redis.Redis, keys: Keys) -> None:
    reader = BusEpoch(fake_client, keys)  # an executor or trainer started before the controller
    assert reader.join() is None and fake_client.get(keys.bus_epoch) is None
    reader.check()  # none yet: nothing to compare
    created = create_epoch(fake_client, keys)
    reader.check()  # adopts it
    assert reader.value == created.value
    fake_client.delete(keys.bus_epoch)
    with pytest.raises(BusReset):
        reader.check()
