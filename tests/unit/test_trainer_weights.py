"""Publishing weights: versioned files, sha256, one WeightsPublished per version, waiting for serving."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import fakeredis
import pytest

from rollout_bus.events.names import Keys
from rollout_bus.events.paging import page
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import PolicyRecord, Registry
from rollout_bus.events.schema import (
    Producer,
    WeightsPublished,
    WeightUpdateFailed,
    WeightVersionServing,
    decode,
)
from rollout_bus.lm.files import verify_weights_dir
from rollout_bus.lm.model import ModelConfig, build_model, load_model
from rollout_bus.trainer.weights import ServingTimeout, WeightPublisher, version_dir


def publisher(tmp_path: Path, keys: Keys, client: fakeredis.FakeRedis, keep: int = 4) -> WeightPublisher:
    return WeightPublisher(client, keys, "alpha", tmp_path, Producer("trainer", "t"), keep_versions=keep)


def test_a_version_is_saved_hashed_and_announced_once(tmp_path: Path, keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    model = build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32), seed=0)
    weights = publisher(tmp_path, keys, client)
    first = weights.publish(model, 3)
    again = weights.publish(None, 3)  # after a restart: the same version, no second event
    assert first.entry_id == again.entry_id
    directory = version_dir(tmp_path, "alpha", 3)
    assert first.uri == str(directory.resolve())
    assert first.sha256 == hashlib.sha256((directory / "manifest.json").read_bytes()).hexdigest()
    assert verify_weights_dir(directory, first.sha256).kind == "full"  # every file is in the manifest
    events = [decode(f) for _, f in page(client, keys.weight_stream("alpha"))]
    assert len(events) == 1 and isinstance(events[0], WeightsPublished)
    assert (events[0].policy, events[0].version, events[0].sha256) == ("alpha", 3, first.sha256)
    reloaded = load_model(directory)
    assert all((a == b).all() for a, b in zip(reloaded.state_dict().values(), model.state_dict().values(), strict=True))


def on_disk(tmp_path: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in (tmp_path / "alpha").iterdir())


def test_old_versions_are_pruned_only_once_the_controller_is_done_with_them(tmp_path: Path, keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    model = build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32), seed=0)
    weights = publisher(tmp_path, keys, client, keep=1)
    controller = Publisher(client, keys, Producer("controller", "c"))
    for v in range(1, 5):
        weights.publish(model, v)
    assert on_disk(tmp_path) == [1, 2, 3, 4]  # nothing settled yet: the controller may be verifying any of them
    controller.publish(keys.weight_stream("alpha"), WeightVersionServing(producer=controller.producer, policy="alpha",
                                                                version=3, engine_ids=["e0"]))
    controller.publish(keys.weight_stream("other"), WeightVersionServing(producer=controller.producer, policy="other",
                                                                version=9, engine_ids=["e0"]))
    weights.publish(model, 5)
    assert on_disk(tmp_path) == [3, 4, 5]  # below the served one: gone; served and in flight: kept
    controller.publish(keys.weight_stream("alpha"), WeightUpdateFailed(producer=controller.producer, policy="alpha",
                                                              version=4, engine_id="", reason="superseded by 5"))
    weights.publish(model, 6)
    assert on_disk(tmp_path) == [3, 5, 6]  # a version given up on goes too; 5 is still in flight


def test_waiting_ends_at_the_serving_announcement(tmp_path: Path, keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    weights = publisher(tmp_path, keys, client)
    announcer = Publisher(client, keys, Producer("controller", "c"))

    def announce() -> None:
        announcer.publish(keys.weight_stream("alpha"), WeightVersionServing(producer=announcer.producer, policy="alpha",
                                                                   version=2, engine_ids=["e0"]))
    timer = threading.Timer(0.2, announce)
    timer.start()
    waited = weights.wait_serving(2, timeout_s=5.0)
    timer.join()
    assert 0.1 < waited < 4.0


def test_the_registry_answers_a_wait_for_a_version_already_served(tmp_path: Path, keys: Keys) -> None:
    client = fakeredis.FakeRedis()
    Registry(client, keys).put_policy(PolicyRecord("alpha", published=5, serving=5))
    weights = publisher(tmp_path, keys, client)
    assert weights.wait_serving(4, timeout_s=1.0) < 0.5
    with pytest.raises(ServingTimeout):
        weights.wait_serving(6, timeout_s=0.3)
