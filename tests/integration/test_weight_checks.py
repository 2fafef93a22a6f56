"""Checking engines' weights against the published ones, on a real CPU engine behind a real controller.

The engine is adopted with an API key and a weights root; "behind the controller's back" is a direct
``/update_weights_from_disk`` of another directory of the root with that key, which leaves the engine
reporting the version the controller gave it. The on-demand check goes through the bus: the
``rollout-bus status --check-weights`` code sends a ``CheckWeights`` command and reads the answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rollout_bus.check_weights import ask
from rollout_bus.controller.config import ControllerConfig
from rollout_bus.controller.lifecycle import adopted_engine_id
from rollout_bus.controller.service import InferenceController
from rollout_bus.engine.http_client import EngineClient
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.errors import InvalidRequest
from rollout_bus.events.names import Keys
from rollout_bus.events.publish import Publisher
from rollout_bus.events.registry import EngineState, Registry
from rollout_bus.events.schema import (
    CheckWeights,
    EngineServing,
    EngineUnhealthy,
    Producer,
    WeightsChecked,
    WeightVersionServing,
)
from rollout_bus.lm.files import read_manifest, tensors_digest
from rollout_bus.status import main as status_main
from tests.engine_proc import EngineProcess, make_weights_dir
from tests.support.controller_driver import (
    find,
    publish_weights,
    read_events,
    wait_until_async,
    weight_events,
    write_version,
)
from tests.support.models import tiny_adapter

pytestmark = pytest.mark.integration

KEY = "weights-check-key"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("weights-root")
    make_weights_dir(root / "base", seed=0)
    return root


@pytest.fixture
def engine(root: Path) -> Iterator[EngineProcess]:
    proc = EngineProcess(root / "base", extra_args=["--api-key", KEY, "--weights-root", str(root)])
    yield proc
    proc.stop()


@pytest.fixture
def lora_engine(root: Path) -> Iterator[EngineProcess]:
    proc = EngineProcess(root / "base", extra_args=["--api-key", KEY, "--weights-root", str(root), "--enable-lora"])
    yield proc
    proc.stop()


def config(keys: Keys, server: RedisServer, root: Path, engine: EngineProcess, **kw: object) -> ControllerConfig:
    return ControllerConfig(namespace=keys.namespace, redis_url=server.url, num_engines=0, adopt_urls=[engine.url],
                            model_path=str(root / "base"), weights_root=str(root), health_interval_s=0.3,
                            health_timeout_s=2.0, engine_api_key=KEY, **kw)  # type: ignore[arg-type]


def test_an_engine_given_other_weights_behind_the_controllers_back_fails_the_check_and_leaves_serving(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path, engine: EngineProcess,
        capsys: pytest.CaptureFixture[str]) -> None:
    published, sha = write_version(root / "base", root / "default" / "v1", seed=1)
    other, _ = write_version(root / "base", root / "elsewhere" / "v1", seed=2)
    engine_id = adopted_engine_id(engine.url)
    weights = keys.weight_stream("default")

    async def scenario() -> None:
        ctl = InferenceController(config(keys, redis_server, root, engine), redis_client)
        await ctl.start()
        try:
            await ctl.wait_serving(timeout_s=20)
            publish_weights(redis_client, keys, "default", 1, str(published), sha)
            await wait_until_async("v1 served", lambda: find(read_events(redis_client, weights),
                                                             WeightVersionServing, version=1), 15)
            after_update = find(read_events(redis_client, weights), WeightsChecked, engine_id=engine_id, version=1)
            assert [(e.outcome, e.request_id) for e in after_update] == [("match", "")]
            assert after_update[0].actual == after_update[0].expected == tensors_digest(published)

            # behind the controller's back: the engine loads another directory and still says v1
            reply = await EngineClient(engine.url, api_key=KEY).update_weights_from_disk(str(other))
            assert reply["success"] is True
            served = await EngineClient(engine.url, api_key=KEY).weights_digest()
            assert served["digest"] == tensors_digest(other) and served["weight_version"] == "1"

            code = await asyncio.to_thread(status_main, ["--redis-url", redis_server.url, "--namespace",
                                                         keys.namespace, "--check-weights"])
            assert code == 1
            mismatch = find(read_events(redis_client, weights), WeightsChecked, engine_id=engine_id,
                            outcome="mismatch")
            assert len(mismatch) == 1 and mismatch[0].request_id.startswith("check-")
            assert (mismatch[0].policy, mismatch[0].version) == ("default", 1)
            assert mismatch[0].expected == tensors_digest(published)
            assert mismatch[0].actual == tensors_digest(other)
            unhealthy = find(read_events(redis_client, keys.engine_stream), EngineUnhealthy, engine_id=engine_id)
            assert unhealthy and "weights mismatch" in unhealthy[-1].reason
            assert tensors_digest(other) in unhealthy[-1].reason and tensors_digest(published) in unhealthy[-1].reason
            assert ctl.engines[engine_id].state != EngineState.SERVING or len(find(
                read_events(redis_client, keys.engine_stream), EngineServing, engine_id=engine_id)) > 1

            # it answers health, so the controller recovers it with the published weights: then it matches
            await wait_until_async("back in service", lambda: ctl.engines[engine_id].state == EngineState.SERVING
                                   and Registry(redis_client, keys).engines()[engine_id].state == EngineState.SERVING,
                                   20)
            answers = await ctl.check_weights([engine_id], request_id="again")
            assert [(a.outcome, a.actual) for a in answers] == [("match", tensors_digest(published))]
        finally:
            await ctl.stop()

    asyncio.run(scenario())
    out = capsys.readouterr().out
    assert "mismatch" in out and engine_id in out


def test_checking_an_unknown_engine_fails_with_a_clear_message(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path, engine: EngineProcess,
        capsys: pytest.CaptureFixture[str]) -> None:
    async def scenario() -> None:
        ctl = InferenceController(config(keys, redis_server, root, engine), redis_client)
        await ctl.start()
        try:
            await ctl.wait_serving(timeout_s=20)
            with pytest.raises(InvalidRequest, match=r"unknown engines \['nope'\]"):
                await ctl.check_weights(["nope"])
            code, answers = await asyncio.to_thread(ask, redis_client, keys, ["nope"], 10.0)
            assert (code, answers) == (2, [])
            # sent anyway (the registry check is the tool's): the controller answers with the reason
            command = CheckWeights(producer=Producer("operator", "test"), request_id="bad-1", engine_ids=["nope"])
            Publisher(redis_client, keys, command.producer).publish(keys.command_stream, command)
            await wait_until_async("refusal", lambda: find(weight_events(redis_client, keys),
                                                           WeightsChecked, request_id="bad-1", outcome="refused"), 10)
            refused = find(weight_events(redis_client, keys), WeightsChecked, request_id="bad-1")
            assert len(refused) == 1 and "unknown engines ['nope']" in refused[0].reason
        finally:
            await ctl.stop()

    asyncio.run(scenario())
    assert "unknown engine ids ['nope']" in capsys.readouterr().err


def test_an_adapter_and_the_launch_weights_match_their_published_digests_after_an_update(
        keys: Keys, redis_server: RedisServer, redis_client: redis.Redis, root: Path,
        lora_engine: EngineProcess) -> None:
    adapter = tiny_adapter(root / "math" / "v3", seed=3, policy="math", version=3)
    engine_id = adopted_engine_id(lora_engine.url)

    async def scenario() -> list[WeightsChecked]:
        ctl = InferenceController(config(keys, redis_server, root, lora_engine, enable_lora=True), redis_client)
        await ctl.start()
        try:
            await ctl.wait_serving(timeout_s=20)
            publish_weights(redis_client, keys, "math", 3, str(adapter), read_manifest(adapter)[1])
            await wait_until_async("math served", lambda: find(weight_events(redis_client, keys),
                                                               WeightVersionServing, policy="math"), 15)
            return await ctl.check_weights(None, request_id="all")
        finally:
            await ctl.stop()

    answers = asyncio.run(scenario())
    after_update = find(weight_events(redis_client, keys), WeightsChecked, request_id="")
    assert {(e.policy, e.outcome) for e in after_update} == {("default", "match"), ("math", "match")}
    by_policy = {a.policy: a for a in answers}
    assert {p: (a.version, a.outcome) for p, a in by_policy.items()} == {"default": (0, "match"),
                                                                          "math": (3, "match")}
    assert by_policy["default"].actual == tensors_digest(root / "base")
    assert by_policy["math"].actual == tensors_digest(adapter) != by_policy["default"].actual
    done = find(weight_events(redis_client, keys), WeightsChecked, request_id="all", outcome="done")
    assert [d.reason for d in done] == ["2 match, 0 mismatch, 0 unchecked"]
    assert all(a.engine_id == engine_id for a in answers)
