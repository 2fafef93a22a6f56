"""The weight sender holds the newest versions offered, not only the newest one.

In async training the trainer often saves v2 before the controller's request for v1 arrives. A sender that
held only v2 refused the request, and the engines then waited for a group that never formed (the group
timeout, 60 s by default) before the disk fallback: a run of 5 steps took over two minutes.
"""

from __future__ import annotations

from pathlib import Path

import fakeredis
import pytest

from rollout_bus.events.names import Keys
from rollout_bus.events.schema import Producer, WeightBroadcastRequested
from rollout_bus.trainer.broadcast import WeightSender
from tests.engine_proc import make_weights_dir

CONTROLLER = Producer("controller", "c-0")


def request(version: int, group: str = "default-wt-1") -> WeightBroadcastRequested:
    return WeightBroadcastRequested(producer=CONTROLLER, policy="default", version=version, group_name=group,
                                    world_size=2, new_group=True)


@pytest.fixture()
def sender(tmp_path: Path) -> WeightSender:
    client = fakeredis.FakeRedis()
    made = WeightSender(client, Keys("t"), "default", timeout_s=0.3, keep=2)
    for version in (1, 2, 3):
        directory = make_weights_dir(tmp_path / f"v{version}", seed=version)
        assert made.offer(version, None, directory)
    return made


def test_the_newest_versions_are_held_up_to_keep(sender: WeightSender) -> None:
    assert sender.held() == [2, 3]
    assert not sender.offered(1) and sender.offered(2) and sender.offered(3)
    assert sender.plan(1) == [] and sender.plan(2) and sender.plan(2) == sender.plan(3)


def test_a_request_for_a_version_no_longer_held_is_refused_naming_what_is_held(sender: WeightSender) -> None:
    assert sender.serve(request(1)) is False
    assert "v1 is not among the versions held (v2, v3)" in sender.failures[-1]
    assert sender.held() == [2, 3]  # nothing older than v1 to drop


def test_a_request_for_an_older_held_version_is_served_and_drops_the_versions_before_it(
        sender: WeightSender) -> None:
    """v2 is asked while v3 is the newest: the sender tries to send v2 (here the group cannot form: no engine
    joins, so it fails on the group's timeout, not on the version), and v2's request drops nothing newer."""
    assert sender.serve(request(2)) is False
    assert "broadcast of v2 in default-wt-1 failed" in sender.failures[-1]
    assert sender.held() == [2, 3]
    assert sender.serve(request(3, "default-wt-2")) is False
    assert "broadcast of v3" in sender.failures[-1]
    assert sender.held() == [3]  # the controller moved on to v3: v2 is never asked again


def test_keep_must_hold_at_least_the_newest_version() -> None:
    with pytest.raises(ValueError, match="keep must be at least 1"):
        WeightSender(fakeredis.FakeRedis(), Keys("t"), "default", keep=0)
