"""Weight-update rounds against fake engines: supersession, stale versions, refusals, failures,
pools and adapter policies, SGLang's unflushed 400, and the base policy's launch record (written at
startup, never verified as weights)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import fakeredis
import numpy as np
import pytest
from safetensors.numpy import save_file

from rollout_bus.controller import service as controller_service
from rollout_bus.controller.bus import ControllerBus
from rollout_bus.controller.config import ControllerConfig
from rollout_bus.controller.core import Core
from rollout_bus.controller.metrics import ControllerMetrics
from rollout_bus.controller.service import InferenceController
from rollout_bus.controller.state import EngineHandle
from rollout_bus.controller.updates import WeightUpdater
from rollout_bus.engine.http_client import EngineHTTPError
from rollout_bus.events.names import Keys, publication_key
from rollout_bus.events.registry import EngineRecord, EngineState, PolicyRecord, Registry
from rollout_bus.events.schema import (
    Producer,
    WeightsApplied,
    WeightsPublished,
    WeightUpdateFailed,
    WeightVersionServing,
)
from rollout_bus.lm.files import write_weights_dir
from tests.support.controller_driver import find, weight_events

UNFLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or queued. "
             "Retract or finish them, then call /flush_cache.")


class FakeEngine:
    """The calls a weight update makes, recorded; versions in ``refuse`` get a 400, in ``crash`` no reply,
    in ``unflushed`` SGLang's 400 after loading the weights without flushing (when a flush is asked for)."""

    def __init__(self, url: str, delay_s: float = 0.0) -> None:
        self.url = url
        self.delay_s = delay_s
        self.calls: list[str] = []
        self.applied: list[int] = []
        self.refuse: set[int] = set()
        self.crash: set[int] = set()
        self.unflushed: set[int] = set()
        self.adapters: list[str] = []

    async def pause_generation(self, mode: str = "abort", **_: Any) -> dict[str, Any]:
        self.calls.append(f"pause:{mode}")
        return {}

    async def continue_generation(self, **_: Any) -> dict[str, Any]:
        self.calls.append("continue")
        return {}

    async def flush_cache(self, **_: Any) -> None:
        self.calls.append("flush")

    async def update_weights_from_disk(self, model_path: str, *, weight_version: Any = None,
                                       flush_cache: bool = True, **_: Any) -> dict[str, Any]:
        version = int(weight_version)
        self.calls.append(f"update:{version}:flush={flush_cache}")
        await asyncio.sleep(self.delay_s)
        if version in self.crash:
            raise EngineHTTPError(self.url, "/update_weights_from_disk", 0, "connection reset")
        if version in self.refuse:
            raise EngineHTTPError(self.url, "/update_weights_from_disk", 400, "weights do not fit the model")
        self.applied.append(version)
        if flush_cache and version in self.unflushed:
            raise EngineHTTPError(self.url, "/update_weights_from_disk", 400, UNFLUSHED)
        return {"success": True}

    async def update_weight_version(self, new_version: Any, *, abort_all_requests: bool = False,
                                    **_: Any) -> dict[str, Any]:
        self.calls.append(f"version:{new_version}:abort={abort_all_requests}")
        return {"success": True}

    async def load_lora_adapter(self, lora_name: str, lora_path: str, **_: Any) -> dict[str, Any]:
        self.calls.append(f"load:{lora_name}")
        self.adapters.append(lora_name)
        return {"success": True}

    async def unload_lora_adapter(self, lora_name: str, **_: Any) -> dict[str, Any]:
        self.calls.append(f"unload:{lora_name}")
        self.adapters.remove(lora_name)
        return {"success": True}


class Rig:
    def __init__(self, tmp_path: Path, n: int = 2, delay_s: float = 0.0) -> None:
        self.root = tmp_path
        self.client = fakeredis.FakeRedis()
        self.keys = Keys("unit")
        config = ControllerConfig(model_path=str(tmp_path), weights_root=str(tmp_path), pause_mode="in_place",
                                  enable_lora=True, pools=["full=0"])
        self.bus = ControllerBus(self.client, self.keys, Producer("controller", "unit"), "unit")
        self.core = Core(config, self.bus, ControllerMetrics(), tmp_path / "logs")
        self.core.book.seed("default", 0)
        self.failed: list[tuple[str, str]] = []
        self.updater = WeightUpdater(self.core, self._on_failed)
        self.fakes: list[FakeEngine] = []
        for i in range(n):
            fake = FakeEngine(f"http://fake:{i}", delay_s)
            record = EngineRecord(f"e{i}", fake.url, EngineState.SERVING, versions={"default": 0})
            self.core.engines[record.engine_id] = EngineHandle(record, fake)  # type: ignore[arg-type]
            self.fakes.append(fake)

    async def _on_failed(self, h: EngineHandle, reason: str) -> None:
        self.failed.append((h.engine_id, reason))
        h.move(EngineState.UNHEALTHY)

    def publication(self, version: int, policy: str = "default", adapter: bool = False) -> WeightsPublished:
        directory = self.root / policy / f"v{version}"

        def fill(tmp: Path) -> None:
            if adapter:
                (tmp / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
                save_file({"base_model.model.w.lora_A.weight": np.ones((2, 2), dtype=np.float32)},
                          str(tmp / "adapter_model.safetensors"))
            else:
                save_file({"w": np.full((2, 2), version, dtype=np.float32)}, str(tmp / "model.safetensors"))

        sha = write_weights_dir(directory, fill, replace=True, policy=policy, version=version)
        return WeightsPublished(producer=Producer("trainer", "t"), policy=policy, version=version,
                                uri=str(directory), sha256=sha)

    async def settle(self) -> None:
        for _ in range(500):
            await asyncio.sleep(0.01)
            if self.updater.idle():
                return
        raise TimeoutError("weight updates did not settle")

    def weight_events(self) -> list[Any]:
        return weight_events(self.client, self.keys)

    async def close(self) -> None:
        await self.core.cancel_tasks()
        self.bus.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_newer_version_supersedes_one_in_flight_and_the_older_is_never_applied_after_it(tmp_path: Path) -> None:
    async def scenario() -> Rig:
        rig = Rig(tmp_path, delay_s=0.2)
        assert await rig.updater.submit(rig.publication(1)) is None
        await asyncio.sleep(0.05)  # v1 is being loaded on both engines
        assert await rig.updater.submit(rig.publication(2)) is None
        assert await rig.updater.submit(rig.publication(3)) is None
        reason = await rig.updater.submit(rig.publication(2))
        assert reason is not None and "equal to" not in reason and "older than" in reason
        await rig.settle()
        await rig.close()
        return rig

    rig = run(scenario())
    for fake in rig.fakes:
        assert fake.applied == [1, 3]  # 2 was superseded before it started; nothing after 3
        assert fake.calls[0] == "pause:in_place" and fake.calls[-1] == "continue"
    events = rig.weight_events()
    serving = find(events, WeightVersionServing)
    assert [e.version for e in serving] == [3]  # type: ignore[attr-defined]
    assert {h.record.versions["default"] for h in rig.core.engines.values()} == {3}
    reasons = [e.reason for e in find(events, WeightUpdateFailed, version=2, engine_id="")]  # type: ignore[attr-defined]
    assert any(r.startswith("stale: version 2 is older than the newest accepted version 3") for r in reasons)
    assert any(r.startswith("superseded by version 3") for r in reasons)


def test_full_weights_of_a_policy_without_a_pool_are_refused_and_never_touch_the_base_weights(tmp_path: Path) -> None:
    """SGLang ignores a ``lora_name`` on /update_weights_from_disk and overwrites the base model: full
    weights of a policy go only to engines whose base that policy is."""
    async def scenario() -> tuple[Rig, str | None]:
        rig = Rig(tmp_path, n=1)
        reason = await rig.updater.submit(rig.publication(1, policy="math"))
        await rig.settle()
        await rig.close()
        return rig, reason

    rig, reason = run(scenario())
    assert reason is not None and "no engine pool runs it as its base" in reason and "--pool math=N" in reason
    assert rig.fakes[0].calls == []
    assert rig.core.engines["e0"].record.versions == {"default": 0}
    (failed,) = find(rig.weight_events(), WeightUpdateFailed, version=1)
    assert failed.policy == "math" and "--pool math=N" in failed.reason  # type: ignore[attr-defined]


def test_while_a_trainer_holds_the_policy_lease_only_its_publications_are_applied(tmp_path: Path) -> None:
    """The weights stream is shared by every trainer (no ACL can scope it to one policy), so the controller
    checks the writer: another trainer's (or a forged) publication of a leased policy is refused."""
    async def scenario() -> tuple[Rig, str | None, str | None]:
        rig = Rig(tmp_path, n=1)
        rig.client.hset(rig.keys.trainer_lease("default"), mapping={"owner": "trainer-0/1", "r0": "tok|9|h:1"})
        genuine_key = rig.bus.publisher._dedupe_key(rig.keys.weight_stream("default"), publication_key("default", 1))
        rig.client.set(genuine_key, "1-1")  # the holder's own announcement of v1
        forged = rig.publication(1)
        forged = dataclasses.replace(forged, producer=Producer("trainer", "host-7-trainer-other"))
        refused = await rig.updater.submit(forged)
        assert rig.client.get(genuine_key) == b"1-1"  # a forged event never drops the holder's key
        genuine = dataclasses.replace(rig.publication(2), producer=Producer("trainer", "host-7-trainer-0"))
        applied = await rig.updater.submit(genuine)
        await rig.settle()
        await rig.close()
        return rig, refused, applied

    rig, refused, applied = run(scenario())
    assert refused is not None and "held by trainer 'trainer-0'" in refused and "trainer-other" in refused
    assert applied is None and rig.core.engines["e0"].record.versions == {"default": 2}


def test_an_adapter_policy_is_loaded_under_versioned_names_the_new_one_before_the_old_one_goes(tmp_path: Path) -> None:
    async def scenario() -> Rig:
        rig = Rig(tmp_path, n=2)
        await rig.updater.submit(rig.publication(1, policy="math", adapter=True))
        await rig.settle()
        await rig.updater.submit(rig.publication(2, policy="math", adapter=True))
        await rig.settle()
        await asyncio.sleep(1.3)  # the old name is retired a moment after the registry names the new one
        await rig.close()
        return rig

    rig = run(scenario())
    for fake in rig.fakes:
        assert fake.calls == ["load:math@v1", "load:math@v2", "unload:math@v1"]  # no pause, no base update
        assert fake.adapters == ["math@v2"]
    for h in rig.core.engines.values():
        assert h.record.versions == {"default": 0, "math": 2} and h.record.adapters == {"math": "math@v2"}
        assert h.record.lora_path("math") == "math@v2"
    assert [e.version for e in find(rig.weight_events(), WeightVersionServing, policy="math")] == [1, 2]  # type: ignore[attr-defined]


def test_publications_a_pool_cannot_serve_as_published_are_refused(tmp_path: Path) -> None:
    async def scenario() -> tuple[Rig, list[str | None]]:
        rig = Rig(tmp_path, n=1)
        reasons = [await rig.updater.submit(rig.publication(1, policy="full", adapter=True))]
        rig.core.config.enable_lora = False
        reasons.append(await rig.updater.submit(rig.publication(1, policy="math", adapter=True)))
        await rig.close()
        return rig, reasons

    rig, (pool_adapter, no_lora) = run(scenario())
    assert pool_adapter is not None and "is the base of an engine pool" in pool_adapter
    assert no_lora is not None and "--enable-lora" in no_lora
    assert rig.fakes[0].calls == []


def test_an_in_place_pause_asks_for_no_flush_and_an_unflushed_400_still_counts_as_applied(tmp_path: Path) -> None:
    """SGLang refuses the flush after loading under an in_place pause with requests held, answers 400 and
    keeps the old version: the weights ARE loaded, so the version is set and the update counts."""
    async def scenario() -> Rig:
        rig = Rig(tmp_path, n=1)
        await rig.updater.submit(rig.publication(1))
        await rig.settle()
        rig.core.config.pause_mode = "retract"
        rig.fakes[0].unflushed.add(2)
        await rig.updater.submit(rig.publication(2))
        await rig.settle()
        await rig.close()
        return rig

    rig = run(scenario())
    assert rig.fakes[0].calls == ["pause:in_place", "update:1:flush=False", "pause:retract", "flush", "continue",
                                  "pause:retract", "update:2:flush=True", "version:2:abort=False", "continue"]
    assert not rig.failed and rig.core.book.target("default").version == 2  # type: ignore[union-attr]
    assert [e.version for e in find(rig.weight_events(), WeightVersionServing)] == [1, 2]  # type: ignore[attr-defined]


def test_weights_every_engine_refuses_roll_back_and_engines_say_they_keep_the_old_version(tmp_path: Path) -> None:
    async def scenario() -> Rig:
        rig = Rig(tmp_path)
        await rig.updater.submit(rig.publication(1))
        await rig.settle()
        for fake in rig.fakes:
            fake.refuse.add(2)
        await rig.updater.submit(rig.publication(2))
        await rig.settle()
        await rig.close()
        return rig

    rig = run(scenario())
    assert not rig.failed  # a refusal by everyone is bad weights, not bad engines
    failures = find(rig.weight_events(), WeightUpdateFailed, version=2)
    assert sorted(e.engine_id for e in failures) == ["e0", "e1"]  # type: ignore[attr-defined]
    assert all("keeps serving version 1" in e.reason for e in failures)  # type: ignore[attr-defined]
    assert [e.version for e in find(rig.weight_events(), WeightVersionServing)] == [1]  # type: ignore[attr-defined]
    assert rig.core.book.target("default").version == 1  # type: ignore[union-attr]
    assert {h.record.versions["default"] for h in rig.core.engines.values()} == {1}


def test_an_engine_that_refuses_what_others_took_or_stops_answering_leaves_the_serving_set(tmp_path: Path) -> None:
    async def scenario() -> Rig:
        rig = Rig(tmp_path, n=3)
        rig.fakes[1].refuse.add(1)
        rig.fakes[2].crash.add(1)
        await rig.updater.submit(rig.publication(1))
        await rig.settle()
        await rig.close()
        return rig

    rig = run(scenario())
    assert sorted(e for e, _ in rig.failed) == ["e1", "e2"]
    assert [e.engine_id for e in find(rig.weight_events(), WeightsApplied)] == ["e0"]  # type: ignore[attr-defined]
    serving = find(rig.weight_events(), WeightVersionServing)
    assert [(e.version, e.engine_ids) for e in serving] == [(1, ["e0"])]  # type: ignore[attr-defined]


def test_the_launch_record_says_serving_once_every_serving_engine_runs_the_launch_version(tmp_path: Path) -> None:
    async def scenario() -> tuple[Rig, list[PolicyRecord | None]]:
        rig = Rig(tmp_path)
        registry = Registry(rig.client, rig.keys)
        rig.core.policies["default"] = PolicyRecord("default", published=0)
        seen = []
        rig.core.engines["e1"].record.versions = {"default": 7}  # not the launch weights: no claim
        await rig.updater.joined()
        seen.append(registry.policy("default"))
        rig.core.engines["e1"].record.versions = {"default": 0}
        await rig.updater.joined()
        seen.append(registry.policy("default"))
        await rig.updater.submit(rig.publication(1))  # a publication takes over the record
        await rig.settle()
        seen.append(registry.policy("default"))
        await rig.close()
        return rig, seen

    _rig, (before, launch, published) = run(scenario())
    assert before is None
    assert launch is not None and (launch.published, launch.serving, launch.uri) == (0, 0, "")
    assert published is not None and (published.published, published.serving) == (1, 1) and published.uri


def test_startup_writes_a_launch_record_and_a_restart_never_verifies_it_as_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    client = fakeredis.FakeRedis()
    config = ControllerConfig(namespace="unit", num_engines=0, adopt_urls=["http://127.0.0.1:9"],
                              weights_root=str(tmp_path), log_dir=str(tmp_path / "logs"), initial_version=2)
    registry = Registry(client, Keys("unit"))

    async def seed() -> InferenceController:
        ctl = InferenceController(config, client)
        try:
            await ctl._seed_versions(registry.policies())
        finally:
            ctl.core.bus.close()
        return ctl

    run(seed())
    record = registry.policy("default")
    assert record is not None and (record.published, record.serving, record.uri, record.sha256) == (2, -1, "", "")

    record.serving = 2
    registry.put_policy(record)

    def no_verify(*_: Any) -> None:
        raise AssertionError("a launch record names no weights to verify")

    monkeypatch.setattr(controller_service, "verify", no_verify)
    ctl = run(seed())
    assert ctl.core.book.target("default") is None and ctl.core.book.accepted("default") == 2
    assert ctl.core.policies["default"].serving == 2
    again = registry.policy("default")
    assert again is not None and (again.published, again.serving) == (2, 2)  # left as it was


def test_a_controller_whose_lease_went_stale_by_its_clock_reads_nothing_into_the_group(tmp_path: Path) -> None:
    """A leader woken from a pause past its lease must not make a new version its own pending entry (its successor
    claims pending entries only at its takeover): the bus reads nothing while the runner's clock says the lease is
    not good any more, and reads it once it is."""
    from tests.support.controller_driver import publish_weights

    client = fakeredis.FakeRedis()
    keys = Keys("unit")
    bus = ControllerBus(client, keys, Producer("controller", "unit"), "unit")
    bus.weights.config = dataclasses.replace(bus.weights.config, block_ms=10)
    fresh = False
    bus.may_read = lambda: fresh
    publish_weights(client, keys, "default", 1, str(tmp_path), "0" * 64)
    bus.weights.discover()
    bus.weights.consumers[keys.weight_stream("default")].ensure_group()

    assert asyncio.run(bus.read_weights()) == []
    assert client.xpending(keys.weight_stream("default"), "controller")["pending"] == 0  # not read: nobody holds it
    fresh = True
    read = asyncio.run(bus.read_weights())
    assert [m.event.version for m in read] == [1]  # type: ignore[attr-defined]
    bus.close()


def test_the_runner_says_its_lease_is_stale_past_the_renewal_deadline() -> None:
    from rollout_bus.controller.runner import LeaderRunner

    runner = LeaderRunner(None, lambda: None, ttl_s=2.0)  # type: ignore[arg-type]
    runner.last_good = time.monotonic()
    assert runner.lease_fresh()
    runner.last_good = time.monotonic() - 1.6  # past ttl - margin (1.5 s): a renewal this late means step down
    assert not runner.lease_fresh()
