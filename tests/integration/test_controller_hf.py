"""The controller with two engines on a Hugging Face model (a small random Llama built here): the trainer's
publisher writes a sharded full version and a LoRA adapter version; the controller announces each only
after both engines applied it, and executors generate on both policies through the registry."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis

from rollout_bus.controller.config import ControllerConfig
from rollout_bus.controller.service import InferenceController
from rollout_bus.engine.http_client import close_shared_session
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.events.registry import Registry
from rollout_bus.events.schema import Producer, WeightsApplied, WeightVersionServing
from rollout_bus.executor.engines import EngineCaller, EngineRouter, EngineTime
from rollout_bus.lm import hf
from rollout_bus.trainer.weights import WeightPublisher
from tests.engine_proc import call
from tests.support.controller_driver import find, wait_until_async, weight_events
from tests.support.models import LLAMA_TARGETS, llama_dir, lora

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def announced_after_every_engine_applied(events: list[Any], policy: str, version: int, engine_ids: set[str]) -> bool:
    """``WeightVersionServing`` comes after a ``WeightsApplied`` of each engine, and names all of them."""
    position = {id(e): i for i, e in enumerate(events)}
    (serving,) = find(events, WeightVersionServing, policy=policy, version=version)
    applied = find(events, WeightsApplied, policy=policy, version=version)
    assert {e.engine_id for e in applied} == engine_ids  # type: ignore[attr-defined]
    assert set(serving.engine_ids) == engine_ids  # type: ignore[attr-defined]
    return all(position[id(e)] < position[id(serving)] for e in applied)


def test_a_sharded_version_and_an_adapter_version_reach_both_engines_before_they_are_announced(
        tmp_path: Path, keys: Keys, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    launch = llama_dir(tmp_path / "launch", seed=0)
    root = tmp_path / "weights"
    producer = Producer("trainer", "test")
    full = WeightPublisher(redis_client, keys, "default", root, producer)
    adapter = WeightPublisher(redis_client, keys, "math", root, producer)
    trained = hf.random_llama(259, seed=1)  # "trained" full weights: another seed
    tuned = lora(hf.load_model(launch), LLAMA_TARGETS, seed=2, scale=0.5)
    config = ControllerConfig(namespace=keys.namespace, redis_url=redis_server.url, num_engines=2,
                              model_path=str(launch), weights_root=str(root), enable_lora=True,
                              log_dir=str(tmp_path / "logs"), startup_timeout_s=180, health_interval_s=1.0,
                              pause_mode="retract")

    published: list[Any] = []

    async def scenario() -> tuple[list[Any], list[Any], list[Any]]:
        ctl = InferenceController(config, redis_client)
        await ctl.start()
        try:
            await ctl.wait_serving(timeout_s=180)
            published.append(await asyncio.to_thread(full.publish, trained, 1, tokenizer=hf.byte_tokenizer(),
                                                     max_shard_size="60KB"))
            published.append(await asyncio.to_thread(adapter.publish, tuned, 1))
            await wait_until_async("both versions served", lambda: len(find(
                weight_events(redis_client, keys), WeightVersionServing)) == 2, 60)
            router = EngineRouter(Registry(redis_client, keys))
            caller = EngineCaller(router)
            params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
            outputs = [await caller.generate(policy, [1, 40, 41], params, rid=f"r-{policy}", deadline=None,
                                             timer=EngineTime()) for policy in ("default", "math")]
            await close_shared_session()
            records = list(Registry(redis_client, keys).engines().values())
            seen = [(call(r.url + "/model_info")[1]["weight_version"], [c["id"] for c in call(r.url + "/v1/models")[1]["data"]])
                    for r in records]
            return outputs, records, seen
        finally:
            await ctl.stop()

    (on_base, on_adapter), records, seen = asyncio.run(scenario())
    published_full, published_adapter = published
    assert len(list(Path(published_full.uri).glob("model-*-of-*.safetensors"))) >= 4
    assert [(version, ids[1:]) for version, ids in seen] == [("1", ["math@v1"])] * 2
    events = weight_events(redis_client, keys)
    engine_ids = {r.engine_id for r in records}
    assert engine_ids == {"engine-0", "engine-1"}
    assert announced_after_every_engine_applied(events, "default", 1, engine_ids)
    assert announced_after_every_engine_applied(events, "math", 1, engine_ids)
    for record in records:
        assert record.versions == {"default": 1, "math": 1} and record.adapters == {"math": "math@v1"}
    assert (on_base.versions, on_adapter.versions) == ([1], [1])
    assert on_base.output_ids != on_adapter.output_ids
    policies = Registry(redis_client, keys).policies()
    assert (policies["default"].serving, policies["math"].serving) == (1, 1)
    assert policies["default"].sha256 == published_full.sha256 and policies["math"].sha256 == published_adapter.sha256
