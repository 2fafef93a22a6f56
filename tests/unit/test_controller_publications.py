"""A publication is what it says, and a refusal is final only when it should be: a forged version is
refused (the next genuine one still applies), an unreadable weights file is a refused version whose entry
is acknowledged, a directory late to appear on a shared mount is looked for again, and a version refused
for good can be announced again once its cause is fixed."""

from __future__ import annotations

import asyncio
import json
import os
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from rollout_bus.controller.bus import GROUP
from rollout_bus.events.consume import Message
from rollout_bus.events.schema import Producer, WeightsPublished, WeightUpdateFailed, WeightVersionServing
from rollout_bus.lm.files import write_weights_dir
from rollout_bus.trainer.weights import WeightPublisher
from tests.support.controller_driver import find
from tests.unit.test_controller_updates import Rig, run


def version_dir(rig: Rig, version: int, policy: str = "default") -> tuple[Path, str]:
    """``<root>/<policy>/v<version:06d>`` with full weights and a manifest naming that policy and version."""
    directory = rig.root / policy / f"v{version:06d}"
    sha = write_weights_dir(directory, lambda tmp: save_file(
        {"w": np.full((2, 2), version, dtype=np.float32)}, str(tmp / "model.safetensors")),
        policy=policy, version=version)
    return directory, sha


def announced(policy: str, version: int, directory: Path, sha: str) -> WeightsPublished:
    return WeightsPublished(producer=Producer("trainer", "t"), policy=policy, version=version, uri=str(directory),
                            sha256=sha)


async def wait_for(what: str, condition: object, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():  # type: ignore[operator]
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"no {what} after {timeout_s}s")
        await asyncio.sleep(0.02)


async def entries(rig: Rig) -> list[Message]:
    return [m for m in await rig.bus.read_weights() if isinstance(m.event, WeightsPublished)]


def pending(rig: Rig) -> int:
    return int(rig.client.xpending(rig.keys.weight_stream("default"), GROUP)["pending"])


def test_a_version_announced_as_another_is_refused_and_the_next_genuine_version_is_still_applied(
        tmp_path: Path) -> None:
    """``v000004`` announced as version 999999 would have frozen the policy: every genuine version after it
    refused as stale."""
    async def scenario() -> tuple[Rig, list[str | None]]:
        rig = Rig(tmp_path)
        v4, sha4 = version_dir(rig, 4)
        v5, sha5 = version_dir(rig, 5)
        reasons = [await rig.updater.submit(announced("default", 4, v4, sha4))]
        await rig.settle()
        reasons.append(await rig.updater.submit(announced("default", 999999, v4, sha4)))
        reasons.append(await rig.updater.submit(announced("full", 5, v5, sha5)))  # another policy's directory
        reasons.append(await rig.updater.submit(announced("default", 5, v5, sha5)))
        await rig.settle()
        await rig.close()
        return rig, reasons

    rig, (genuine4, forged, foreign, genuine5) = run(scenario())
    assert genuine4 is None and genuine5 is None
    assert forged is not None and "publishes 'default' v4, but the event announces 'default' v999999" in forged
    assert foreign is not None and "a policy publishes only under its own folder" in foreign
    for fake in rig.fakes:
        assert fake.applied == [4, 5]
    assert [e.version for e in find(rig.weight_events(), WeightVersionServing)] == [4, 5]  # type: ignore[attr-defined]
    assert rig.core.book.target("default").version == 5  # type: ignore[union-attr]


def test_a_weights_file_with_wrong_offsets_is_a_refused_version_and_its_entry_is_acknowledged(tmp_path: Path) -> None:
    """A safetensors header whose offsets do not hold whole elements raised ``ValueError`` from the
    non-finite scan, out of the weights loop, and the entry stayed pending."""
    def crafted(tmp: Path) -> None:
        header = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 15]}}).encode()
        (tmp / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))

    async def scenario() -> tuple[Rig, list[str | None], int]:
        rig = Rig(tmp_path, n=1)
        directory = rig.root / "default" / "v000001"
        sha = write_weights_dir(directory, crafted, policy="default", version=1)
        rig.bus.publisher.publish(rig.keys.weight_stream("default"), announced("default", 1, directory, sha))
        reasons = [await rig.updater.submit(m.event, m.id) for m in await entries(rig)]  # type: ignore[arg-type]
        left = pending(rig)
        await rig.close()
        return rig, reasons, left

    rig, reasons, left = run(scenario())
    assert len(reasons) == 1 and reasons[0] is not None
    assert "data_offsets [0, 15]: 15 bytes, not a whole number of 4-byte elements" in reasons[0]
    assert left == 0
    (failed,) = find(rig.weight_events(), WeightUpdateFailed, version=1)
    assert "data_offsets" in failed.reason  # type: ignore[attr-defined]
    assert rig.fakes[0].calls == []


def test_a_directory_that_appears_a_moment_after_its_announcement_is_applied(tmp_path: Path) -> None:
    """A shared mount late to show a version: the controller looks again, with backoff, before refusing."""
    async def scenario() -> tuple[Rig, str | None, int, float]:
        rig = Rig(tmp_path, n=1)
        directory, sha = version_dir(rig, 1)
        hidden = directory.with_name(".late")
        os.rename(directory, hidden)  # not visible on this host yet
        started = asyncio.get_running_loop().time()
        rig.bus.publisher.publish(rig.keys.weight_stream("default"), announced("default", 1, directory, sha))
        (message,) = await entries(rig)
        rig.updater.inflight.add(message.id)
        reason = await rig.updater.submit(message.event, message.id)  # type: ignore[arg-type]
        await asyncio.sleep(1.5)
        assert not find(rig.weight_events(), WeightUpdateFailed)  # still looking, not refused
        assert pending(rig) == 1
        os.rename(hidden, directory)
        await wait_for("v1 serving", lambda: find(rig.weight_events(), WeightVersionServing, version=1))
        waited = asyncio.get_running_loop().time() - started
        await rig.settle()
        left = pending(rig)
        await rig.close()
        return rig, reason, left, waited

    rig, reason, left, waited = run(scenario())
    assert reason is None and left == 0
    assert 1.5 <= waited < 6.0  # found at the next look after it appeared (backoff at most 4 s)
    assert rig.fakes[0].applied == [1]
    assert not find(rig.weight_events(), WeightUpdateFailed)


def test_a_version_refused_for_good_can_be_announced_again_once_its_directory_is_there(tmp_path: Path) -> None:
    """The refusal drops the publication's dedupe key: the trainer's second announcement of the same
    version is a new entry (it used to return the refused one, deduplicated for 7 days)."""
    async def scenario() -> tuple[Rig, list[str], list[str | None]]:
        rig = Rig(tmp_path, n=1)
        rig.core.config.weights_missing_wait_s = 0.3
        publisher = WeightPublisher(rig.client, rig.keys, "default", rig.root, Producer("trainer", "t"))
        directory, _sha = version_dir(rig, 1)
        first = publisher.publish(None, 1)
        hidden = directory.with_name(".late")
        os.rename(directory, hidden)  # the controller's host does not see it in time
        (message,) = await entries(rig)
        rig.updater.inflight.add(message.id)
        reasons = [await rig.updater.submit(message.event, message.id)]  # type: ignore[arg-type]
        await wait_for("the final refusal", lambda: find(rig.weight_events(), WeightUpdateFailed, version=1))
        await wait_for("the entry acknowledged", lambda: pending(rig) == 0)
        os.rename(hidden, directory)  # fixed
        again = publisher.publish(None, 1)
        ids = [first.entry_id, again.entry_id]
        for m in await entries(rig):
            reasons.append(await rig.updater.submit(m.event, m.id))  # type: ignore[arg-type]
        await wait_for("v1 serving", lambda: find(rig.weight_events(), WeightVersionServing, version=1))
        await rig.close()
        return rig, ids, reasons

    rig, (first_id, again_id), reasons = run(scenario())
    assert again_id != first_id
    assert reasons == [None, None]  # looked for again, then (announced again) applied
    (refused,) = find(rig.weight_events(), WeightUpdateFailed, version=1)
    assert "weights directory missing on this host" in refused.reason  # type: ignore[attr-defined]
    assert rig.fakes[0].applied == [1]
