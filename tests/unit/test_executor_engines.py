"""Routing by load, updating engines, cool-down after failures; reading /generate replies."""

from __future__ import annotations

import time

import fakeredis
import pytest

from rollout_bus.events.names import Keys
from rollout_bus.events.registry import EngineRecord, EngineState, Registry
from rollout_bus.executor.engines import EngineRouter, EngineTime, parse_reply


def record(engine_id: str, load: int = 0, updating: dict[str, int] | None = None,
           state: EngineState = EngineState.SERVING, versions: dict[str, int] | None = None) -> EngineRecord:
    return EngineRecord(engine_id=engine_id, url=f"http://{engine_id}", state=state, load=load, base_policy="p",
                        updating=updating or {}, versions={"p": 0} if versions is None else versions)


@pytest.fixture()
def router(fake_client: fakeredis.FakeRedis, keys: Keys) -> EngineRouter:
    return EngineRouter(Registry(fake_client, keys))


def test_the_least_loaded_serving_engine_wins(router: EngineRouter) -> None:
    records = [record("a", load=5), record("b", load=1), record("c", state=EngineState.UNHEALTHY),
               record("d", versions={"q": 0})]
    assert router.choose(records, "p", set()).engine_id == "b"  # type: ignore[union-attr]
    router.in_flight["b"] = 10
    assert router.choose(records, "p", set()).engine_id == "a"  # type: ignore[union-attr]
    assert router.choose(records, "zzz", set()) is None


def test_updating_and_failed_engines_are_used_only_as_a_last_resort(router: EngineRouter) -> None:
    records = [record("a", updating={"p": 1}), record("b", load=50)]
    assert router.choose(records, "p", set()).engine_id == "b"  # type: ignore[union-attr]
    assert router.choose(records, "p", {"b"}).engine_id == "a"  # type: ignore[union-attr]
    assert router.choose([record("a", updating={"p": 1})], "p", set()).engine_id == "a"  # type: ignore[union-attr]
    router.failed("b")
    assert router.choose(records, "p", set()).engine_id == "a"  # type: ignore[union-attr]
    router._cooling["b"] = time.monotonic() - 1
    assert router.choose(records, "p", set()).engine_id == "b"  # type: ignore[union-attr]


def test_parse_reply_reads_tokens_logprobs_finish_and_versions() -> None:
    reply = {"output_ids": [5, 6], "meta_info": {
        "finish_reason": {"type": "length", "length": 2}, "weight_version": "7",
        "output_token_logprobs": [[-0.1, 5, None], [-1.5, 6, None]],
        "weight_versions": [{"version": "6", "start": 0, "end": 1}, {"version": "7", "start": 1, "end": 2}]}}
    assert parse_reply(reply) == ([5, 6], [-0.1, -1.5], "length", {6, 7})
    reply["meta_info"]["weight_version"] = "default"  # type: ignore[index]
    reply["meta_info"].pop("weight_versions")  # type: ignore[union-attr]
    assert parse_reply(reply)[3] == set()


@pytest.mark.parametrize("reply", [
    None, {"output_ids": [1]}, {"output_ids": [1], "meta_info": {"output_token_logprobs": [],
                                                                  "finish_reason": {"type": "stop"}}},
    {"output_ids": [], "meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "exploded"}}},
])
def test_unreadable_replies_are_value_errors(reply: object) -> None:
    with pytest.raises(ValueError):
        parse_reply(reply)


def test_engine_time_counts_overlapping_calls_once() -> None:
    timer = EngineTime()
    with timer.call():
        with timer.call():
            time.sleep(0.02)
        time.sleep(0.02)
    assert 0.035 < timer.busy_s < 0.2 and timer.calls == 2


def test_the_router_rereads_the_engine_records_only_after_a_registry_write(fake_client: fakeredis.FakeRedis,
                                                                           keys: Keys) -> None:
    import asyncio

    from rollout_bus.executor.engines import RouterConfig

    reads = []

    class Counting(Registry):
        def engines(self) -> dict[str, EngineRecord]:
            reads.append(1)
            return super().engines()

    registry = Counting(fake_client, keys)
    registry.put_engines([record("a"), record("b")])
    router = EngineRouter(registry, RouterConfig(refresh_s=0.0, max_age_s=60.0))

    async def snapshots(n: int) -> list[str]:
        out: list[str] = []
        for _ in range(n):
            out = sorted(r.engine_id for r in await router.snapshot())
        return out

    assert asyncio.run(snapshots(5)) == ["a", "b"] and len(reads) == 1  # unchanged: one read, then HGETs only
    registry.put_engine(record("c"))
    assert asyncio.run(snapshots(5)) == ["a", "b", "c"] and len(reads) == 2  # a write: read once more
    registry.remove_engine("a")
    assert asyncio.run(snapshots(1)) == ["b", "c"] and len(reads) == 3


def test_generate_goes_to_the_engines_generate_url_when_it_has_one(router: EngineRouter) -> None:
    """An SGLang engine behind its fence guard: control calls go to ``url``, /generate straight to SGLang."""
    guarded = EngineRecord("e0", "http://h:30000", EngineState.SERVING, generate_url="http://h:30001")
    plain = EngineRecord.unpack(record("e1").pack())
    assert router.client(guarded).url == "http://h:30001"
    assert router.client(plain).url == plain.url
    assert EngineRecord.unpack(guarded.pack()).generate_url == "http://h:30001"


def test_training_calls_never_take_an_eval_engine_and_eval_calls_prefer_one(router: EngineRouter) -> None:
    idle_eval = record("eval-0", load=0)
    idle_eval.role = "eval"
    busy = record("a", load=9)
    assert idle_eval.evaluates and not busy.evaluates
    assert router.choose([busy, idle_eval], "p", set()).engine_id == "a"  # type: ignore[union-attr]
    assert router.choose([idle_eval], "p", set()) is None  # a training call waits rather than take it
    assert router.choose([busy, idle_eval], "p", set(), evaluating=True).engine_id == "eval-0"  # type: ignore[union-attr]
    assert router.choose([busy], "p", set(), evaluating=True).engine_id == "a"  # type: ignore[union-attr]
    assert EngineRecord.unpack(idle_eval.pack()).role == "eval"


def test_an_eval_call_waits_for_an_eval_engine_of_its_pool_that_is_still_launching(router: EngineRouter) -> None:
    """The eval before training came while the eval engine was still launching (no weights, no versions): the
    call went to a training engine. It waits for the eval engine instead; another pool's eval engine does not
    count."""
    launching = record("eval-0", load=0)
    launching.role, launching.state, launching.versions, launching.base_policy = "eval", EngineState.LAUNCHING, {}, "p"
    busy = record("a", load=9)
    assert router.choose([busy, launching], "p", set(), evaluating=True) is None
    launching.base_policy = "other"
    assert router.choose([busy, launching], "p", set(), evaluating=True).engine_id == "a"  # type: ignore[union-attr]


def test_the_controller_registers_its_eval_engines_with_the_eval_role(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from rollout_bus.controller.config import ControllerConfig

    cfg = ControllerConfig(num_engines=2, eval_engines=1, base_policy="p", model_path=str(tmp_path),
                           weights_root=str(tmp_path)).validate()
    assert cfg.expected_engines() == {"engine-0": "p", "engine-1": "p", "engine-eval-0": "p"}
    assert cfg.eval_engine_ids() == ["engine-eval-0"] and cfg.total_engines == 3
    from rollout_bus.controller.config import ConfigError

    with pytest.raises(ConfigError, match="eval_engines must be >= 0"):
        ControllerConfig(num_engines=1, eval_engines=-1, model_path=str(tmp_path), weights_root=str(tmp_path)).validate()
