"""A session gateway for tests: real redis-server, real engine processes, the gateway's HTTP server on a
thread of its own (its own event loop), and engine records written where the controller would."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from rollout_bus.events.connection import connect
from rollout_bus.events.names import Keys
from rollout_bus.events.registry import EngineRecord, EngineState, Registry
from rollout_bus.gateway.chat import ChatFormat, load_format
from rollout_bus.gateway.keys import ClientKeys
from rollout_bus.gateway.server import Running, make_gateway, serve
from rollout_bus.gateway.service import Gateway
from rollout_bus.lm.model import ModelConfig
from tests.engine_proc import EngineProcess, make_weights_dir

T = TypeVar("T")

CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{%- if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>{\"name\": \"{{ call.function.name }}\""
    ", \"arguments\": {{ call.function.arguments }}}</tool_call>{% endfor %}{% endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
"""ChatML with tools in the Hermes form, for a test model whose template must render them."""


def register(redis_url: str, keys: Keys, engines: Sequence[tuple[str, str]], *, policy: str = "default",
             version: int = 0) -> None:
    """Engine records as the controller writes them: ``(engine_id, url)`` serving ``policy`` at ``version``."""
    client = connect(redis_url)
    try:
        Registry(client, keys).put_engines([
            EngineRecord(engine_id, url, EngineState.SERVING, versions={policy: version}, base_policy=policy)
            for engine_id, url in engines])
    finally:
        client.close()


def set_state(redis_url: str, keys: Keys, engine_id: str, state: EngineState) -> None:
    client = connect(redis_url)
    try:
        registry = Registry(client, keys)
        record = registry.engines()[engine_id]
        record.state = state
        registry.put_engine(record)
    finally:
        client.close()


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LM with room for several turns (the default has 64 positions)."""
    return make_weights_dir(tmp_path_factory.mktemp("tiny"), seed=1, config=ModelConfig(max_seq_len=512))


@pytest.fixture(scope="module")
def agent_engine(agent_model: Path) -> Iterator[EngineProcess]:
    proc = EngineProcess(agent_model)
    yield proc
    proc.stop()


class GatewayThread:
    """The gateway's HTTP server on a loop thread; ``call`` runs a coroutine there."""

    def __init__(self, redis_url: str, keys: Keys, model_path: str | Path | None, *, engine_key: str | None = None,
                 client_keys: ClientKeys | None = None, fmt: ChatFormat | None = None, wait_s: float = 10.0) -> None:
        self.client = connect(redis_url)
        self.keys = keys
        self.fmt = fmt or load_format(str(model_path) if model_path else None)
        self.gateway: Gateway = make_gateway(self.client, keys, self.fmt, instance="test-gateway",
                                             engine_key=engine_key, wait_s=wait_s)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="gateway-loop")
        self.thread.start()
        self.running: Running = self.call(serve(self.gateway, client_keys=client_keys))

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    @property
    def url(self) -> str:
        return self.running.url

    def session_url(self, sid: str) -> str:
        return self.running.session_url(sid)

    def close(self) -> None:
        self.call(self.running.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.client.close()

    def __enter__(self) -> GatewayThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
