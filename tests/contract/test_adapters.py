"""Adapters against SGLang itself: its real replies to a stale adapter name, the executor's retry on them,
and the controller's reconciliation of what ``/v1/models`` lists with its own record.

SGLang keeps every adapter name it ever loaded (``TokenizerManager.lora_ref_cache``) and loads an
unloaded one again when a request names it (``_resolve_lora_path``): from disk while its files are there,
else a 400 "Failed to implicitly load LoRA adapter ...". The texts here come from running SGLang's own
``_resolve_lora_path`` (and its ``LoRAConfig``, which a backend load starts with), not from a copy.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest

from tests.contract.lane import require_sglang

require_sglang()

from sglang.srt.lora.lora_config import LoRAConfig  # noqa: E402
from sglang.srt.lora.lora_registry import LoRARef, LoRARegistry  # noqa: E402
from sglang.srt.managers.io_struct import GenerateReqInput, LoRAUpdateOutput  # noqa: E402
from sglang.srt.managers.tokenizer_manager import TokenizerManager  # noqa: E402

from rollout_bus.engine.http_client import EngineClient, EngineHTTPError  # noqa: E402
from rollout_bus.events.names import Keys  # noqa: E402
from rollout_bus.events.registry import EngineRecord, EngineState, Registry  # noqa: E402
from rollout_bus.executor.engines import EngineCaller, EngineRouter, EngineTime  # noqa: E402
from tests.contract.sglang_harness import Harness  # noqa: E402
from tests.contract.test_requests import ARGV, controller, run  # noqa: E402


@pytest.fixture(scope="module")
def harness() -> Harness:
    return Harness(ARGV)


@pytest.fixture(scope="module")
def url(harness: Harness) -> Iterator[str]:
    with harness.serve() as base:
        yield base


def sglang_refusal(name: str, cache: dict[str, str]) -> str:
    """What SGLang's ``_resolve_lora_path`` raises for a request naming adapter ``name``, with ``cache``
    (name -> path) as the names it loaded before and none of them loaded now."""
    async def load_lora_adapter(obj: Any) -> Any:  # a backend load starts by reading the adapter's config
        try:
            LoRAConfig(obj.lora_path)
        except Exception as exc:  # noqa: BLE001  # the backend turns any failure into its message
            return LoRAUpdateOutput(success=False, error_message=str(exc))
        return LoRAUpdateOutput(success=True)

    tm = types.SimpleNamespace(lora_registry=LoRARegistry(), load_lora_adapter=load_lora_adapter,
                               lora_ref_cache={n: LoRARef(lora_name=n, lora_path=p) for n, p in cache.items()})
    obj = GenerateReqInput(input_ids=[1, 2], lora_path=name)
    with pytest.raises(ValueError) as caught:
        asyncio.run(TokenizerManager._resolve_lora_path(tm, obj))  # type: ignore[arg-type]
    return str(caught.value)


def test_sglangs_replies_to_a_stale_adapter_name_are_recognised_as_such(harness: Harness, tmp_path: Path) -> None:
    never = sglang_refusal("p@v2", {})
    deleted = sglang_refusal("p@v2", {"p@v2": str(tmp_path / "p" / "v000002")})  # unloaded, files gone
    assert never.startswith("Got LoRA adapter that has never been loaded: p@v2")
    assert deleted.startswith("Failed to implicitly load LoRA adapter p@v2: ")
    for message in (never, deleted):
        assert EngineHTTPError("http://e", "/generate", 400, message).unknown_adapter
    assert not EngineHTTPError("http://e", "/generate", 400, "max_new_tokens must be >= 0").unknown_adapter


def test_the_executor_retries_a_stale_adapter_on_the_name_the_registry_gives_now(
        harness: Harness, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry moved to p@v3 after the executor's snapshot; SGLang refuses p@v2 (retired, its files
    deleted) with its real text; the call is retried on p@v3 and the sample carries version 3."""
    refusal = sglang_refusal("p@v2", {"p@v2": str(tmp_path / "gone")})
    real_check = harness.tm._check_lora

    def check(lora_path: Any) -> None:
        if lora_path == "p@v2":
            raise ValueError(refusal)
        real_check(lora_path)

    monkeypatch.setattr(harness.tm, "_check_lora", check)
    registry = Registry(fakeredis.FakeRedis(), Keys("adapters"))
    record = EngineRecord("e0", url, EngineState.SERVING, versions={"default": 0, "p": 2}, adapters={"p": "p@v2"})
    registry.put_engine(record)

    async def scenario() -> Any:
        await EngineClient(url).load_lora_adapter("p@v3", "/w/p/v000003")
        router = EngineRouter(registry)
        await router.snapshot()  # the executor's snapshot names p@v2
        registry.put_engine(EngineRecord("e0", url, EngineState.SERVING, versions={"default": 0, "p": 3},
                                         adapters={"p": "p@v3"}))
        return await EngineCaller(router).generate("p", [1, 5, 6], {"max_new_tokens": 4}, rid="stale",
                                                    deadline=None, timer=EngineTime())

    out = run(scenario())
    sent = [c.obj.lora_path for c in harness.tm.calls_of("generate_request")]
    assert sent[0] == "p@v2" and sent[-1] == "p@v3" and out.versions == [3]
    assert out.failovers >= 1 and len(out.output_ids) == 4


def test_the_controller_unloads_strays_sglang_holds_and_reloads_what_it_lost(
        harness: Harness, url: str, tmp_path: Path) -> None:
    harness.tm.loras.clear()  # what earlier tests loaded
    harness.tm.calls.clear()
    ctl, h = controller(url, tmp_path)
    h.record.versions, h.record.adapters = {"default": 0, "p": 5, "q": 1}, {"p": "p@v5", "q": "q@v1"}

    async def scenario() -> tuple[list[str], list[str]]:
        client = EngineClient(url)
        for name in ("p@v4", "p@v5", "other"):  # p@v4: brought back by a stale request after it was retired
            await client.load_lora_adapter(name, f"/w/{name}")
        first = await ctl.adapters.reconcile(h)  # seen once: it may be a name retired a moment ago
        assert not harness.tm.calls_of("unload_lora_adapter")
        second = await ctl.adapters.reconcile(h)
        return first, second

    try:
        first, second = run(scenario())
    finally:
        ctl.core.bus.close()
    assert [c.obj.lora_name for c in harness.tm.calls_of("unload_lora_adapter")] == ["p@v4"]  # "other": not ours
    assert first == ["q"] and second == []  # q@v1 is not there: dropped from the record, pushed again
    assert h.record.adapters == {"p": "p@v5"} and h.record.versions == {"default": 0, "p": 5}
