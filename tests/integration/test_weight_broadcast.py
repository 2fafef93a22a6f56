"""Weights by collective on real processes: two CPU engines (the tiny LM), a real redis-server, the
controller with ``weight_sync="broadcast"``, and a trainer's publisher and sender in a process of its own
(``tests.support.weight_sender``: rank 0 of the engines' gloo group).

A version offered by collective reaches both engines without ``/update_weights_from_disk`` (their
``model_path`` stays the launch one) and each reports the version directory's digest; a second version
reuses the open group; so with ``broadcast_pause="swap"`` (the engines serve the old weights while all but the
last bucket arrive). Faults: an engine killed mid-broadcast, the sender killed mid-broadcast, and a
sender that hangs until the group times out each leave every live engine on the old version or the new
one (its digest one of the two, never a mix), the broken group destroyed, and the version delivered by
disk; the next version opens a new group.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from rollout_bus.controller.config import ControllerConfig
from rollout_bus.controller.service import InferenceController
from rollout_bus.engine.http_client import EngineClient
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.schema import (
    WeightBroadcastRequested,
    WeightsApplied,
    WeightsPublished,
    WeightVersionServing,
)
from rollout_bus.lm.files import tensors_digest, version_dir
from tests.engine_proc import ROOT, EngineProcess, make_weights_dir
from tests.support.controller_driver import find, read_events, wait_until_async

pytestmark = pytest.mark.integration

GROUP_TIMEOUT_S = 4.0


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    make_weights_dir(tmp_path / "base", seed=0)
    return tmp_path


@pytest.fixture()
def engines(root: Path) -> Iterator[list[EngineProcess]]:
    procs = [EngineProcess(root / "base", extra_args=["--weights-root", str(root),
                                                      "--dist-timeout", str(GROUP_TIMEOUT_S)]) for _ in range(2)]
    yield procs
    for proc in procs:
        proc.stop()


class Sender:
    """The sender process (``tests.support.weight_sender``), stopped by pid."""

    def __init__(self, root: Path, server: RedisServer, keys: Keys, versions: str, *extra: str) -> None:
        self.status = root / f"sender-{versions.replace(',', '-')}.json"
        self.log = open(root / f"sender-{versions.replace(',', '-')}.log", "wb")  # noqa: SIM115
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.weight_sender", "--redis", server.url, "--namespace", keys.namespace,
             "--root", str(root), "--base", str(root / "base"), "--versions", versions, "--status", str(self.status),
             "--bucket-kb", "16", "--timeout-s", str(GROUP_TIMEOUT_S), *extra],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def state(self) -> dict[str, Any]:
        try:
            return json.loads(self.status.read_text())
        except (OSError, ValueError):
            return {}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture()
def senders() -> Iterator[list[Sender]]:
    made: list[Sender] = []
    yield made
    for sender in made:
        sender.stop()


def config(keys: Keys, server: RedisServer, root: Path, engines: list[EngineProcess], **kw: Any) -> ControllerConfig:
    settings: dict[str, Any] = dict(namespace=keys.namespace, redis_url=server.url, num_engines=0,
                                    adopt_urls=[e.url for e in engines], model_path=str(root / "base"),
                                    weights_root=str(root), health_interval_s=0.5, health_timeout_s=2.0,
                                    weight_sync="broadcast", group_timeout_s=GROUP_TIMEOUT_S, update_timeout_s=20.0)
    return ControllerConfig(**{**settings, **kw})


async def digests(engines: list[EngineProcess]) -> list[dict[str, Any]]:
    return [await EngineClient(e.url).weights_digest() for e in engines]


def served(client: redis.Redis, keys: Keys, version: int) -> bool:
    return bool(find(read_events(client, keys.weight_stream("default")), WeightVersionServing, version=version))


def requests(client: redis.Redis, keys: Keys) -> list[WeightBroadcastRequested]:
    return [e for e in read_events(client, keys.weight_stream("default")) if isinstance(e, WeightBroadcastRequested)]


@pytest.mark.parametrize("pause", ["before", "swap"])
def test_versions_travel_by_collective_and_the_engines_report_the_directory_digest(
        pause: str, keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path,
        engines: list[EngineProcess], senders: list[Sender]) -> None:
    async def scenario() -> None:
        ctl = InferenceController(config(keys, redis_server, root, engines, broadcast_pause=pause), redis_client)
        await ctl.start()
        try:
            await ctl.wait_serving(timeout_s=20)
            gate = root / "gate"
            gate.mkdir()
            senders.append(Sender(root, redis_server, keys, "1,2", "--gate", str(gate)))
            for version in (1, 2):
                (gate / f"go-v{version}").touch()  # v2 only after v1 was looked at: no engine has moved on yet
                await wait_until_async(f"v{version} served", lambda v=version: served(redis_client, keys, v), 30)
                expected = tensors_digest(version_dir(root, "default", version))
                reports = await digests(engines)
                assert [r["digest"] for r in reports] == [expected, expected]
                assert [r["weight_version"] for r in reports] == [str(version)] * 2
                # not loaded from disk: a disk update reports the version directory as the model path
                assert [r["model_path"] for r in reports] == [str(root / "base")] * 2
        finally:
            await ctl.stop()

    asyncio.run(scenario())
    published = [e for e in read_events(redis_client, keys.weight_stream("default")) if isinstance(e, WeightsPublished)]
    assert all(e.group_address and e.buckets for e in published)
    asked = requests(redis_client, keys)
    assert [(r.version, r.new_group, r.world_size) for r in asked] == [(1, True, 3), (2, False, 3)]
    assert asked[0].group_name == asked[1].group_name  # opened once, used again
    assert senders[0].state()["sent"] == [1, 2] and senders[0].state()["failures"] == []


def _fault_scenario(keys: Keys, server: RedisServer, client: redis.Redis, root: Path, engines: list[EngineProcess],
                    senders: list[Sender], fault: str, pause: str) -> dict[str, Any]:
    """Version 1 by collective with a fault mid-way; it must end delivered by disk to the live engines, then
    version 2 (from a fresh sender) by collective in a new group. Returns what the test checks."""
    old = tensors_digest(root / "base")
    extra = {"engine": ["--bucket-delay-s", "0.4"], "trainer": ["--bucket-delay-s", "0.4"],
             "timeout": ["--hang-after", "3"]}[fault]
    out: dict[str, Any] = {}

    async def scenario() -> None:
        ctl = InferenceController(config(keys, server, root, engines, broadcast_pause=pause), client)
        await ctl.start()
        try:
            await ctl.wait_serving(timeout_s=20)
            sender = Sender(root, server, keys, "1", *extra)
            senders.append(sender)
            await wait_until_async("three buckets sent", lambda: sender.state().get("buckets_sent", 0) >= 3, 30)
            live = engines
            if fault == "engine":
                engines[0].proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
                engines[0].proc.wait(10)  # type: ignore[union-attr]
                live = engines[1:]
            elif fault == "trainer":
                sender.proc.send_signal(signal.SIGKILL)
                sender.proc.wait(10)
            # the fault landed mid-broadcast: some buckets were sent, not all of them (19 in the plan)
            out["buckets_at_fault"] = sender.state()["buckets_sent"]
            # meanwhile no live engine ever reports a mix: the old digest until the new one
            new = None
            while not served(client, keys, 1):
                for report in await digests(live):
                    assert report["digest"] == old or report["digest"] == (
                        new := new or tensors_digest(version_dir(root, "default", 1)))
                await asyncio.sleep(0.05)
            out["v1"] = await digests(live)
            out["groups_after_v1"] = dict(ctl.updater.broadcast.groups) if ctl.updater.broadcast else None
            out["fallbacks"] = ctl.updater.broadcast.fallbacks if ctl.updater.broadcast else 0
            if fault != "trainer":
                sender.stop()
            fresh = Sender(root, server, keys, "2")
            senders.append(fresh)
            await wait_until_async("v2 served", lambda: served(client, keys, 2), 40)
            out["v2"] = await digests(live)
            # the engines may report v2 served before the sender has written down that it sent it
            await wait_until_async("the fresh sender's record", lambda: fresh.state().get("sent") or
                                   fresh.state().get("failures"), 20)
            out["fresh"] = fresh.state()
            out["live"] = len(live)
        finally:
            await ctl.stop()

    asyncio.run(scenario())
    return out


@pytest.mark.parametrize(("fault", "pause"), [("engine", "before"), ("trainer", "before"), ("timeout", "before"),
                                              ("engine", "swap"), ("trainer", "swap")])
def test_a_broken_broadcast_leaves_no_mix_destroys_the_group_and_delivers_by_disk(
        fault: str, pause: str, keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path,
        engines: list[EngineProcess], senders: list[Sender]) -> None:
    out = _fault_scenario(keys, redis_server, redis_client, root, engines, senders, fault, pause)
    assert 3 <= out["buckets_at_fault"] < 19, out
    v1 = tensors_digest(version_dir(root, "default", 1))
    v2 = tensors_digest(version_dir(root, "default", 2))
    # version 1 came by disk (the model path is its directory) to every live engine, with its digest
    assert [r["digest"] for r in out["v1"]] == [v1] * out["live"]
    assert [r["model_path"] for r in out["v1"]] == [str(version_dir(root, "default", 1).resolve())] * out["live"]
    assert out["fallbacks"] == 1 and out["groups_after_v1"] == {}  # the broken group was destroyed, forgotten
    # version 2 came by collective, in a new group of the live engines
    assert [r["digest"] for r in out["v2"]] == [v2] * out["live"]
    asked = requests(redis_client, keys)
    first, second = [r for r in asked if r.version == 1], [r for r in asked if r.version == 2]
    assert second and second[-1].new_group and second[-1].group_name != first[0].group_name
    assert second[-1].world_size == out["live"] + 1
    assert out["fresh"]["sent"] == [2]
    applied = find(read_events(redis_client, keys.weight_stream("default")), WeightsApplied, version=1)
    assert len(applied) == out["live"]
