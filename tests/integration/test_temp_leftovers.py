"""Nothing left behind in the system's temp directory: by the suite's helpers, or by a controller."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest
import redis

from rollout_bus.controller.config import ControllerConfig
from rollout_bus.controller.service import InferenceController
from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from tests.conftest import SYSTEM_TEMP
from tests.engine_proc import EngineProcess, make_weights_dir
from tests.support.executor_procs import ExecutorProcess

pytestmark = pytest.mark.integration


def test_the_helpers_write_their_temp_files_under_pytests_directory(
        tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, keys: Keys, tmp_path: Path) -> None:
    base = tmp_path_factory.getbasetemp().resolve()
    assert Path(tempfile.gettempdir()).resolve().is_relative_to(base) and not base.samefile(SYSTEM_TEMP)
    engine = EngineProcess(make_weights_dir(tmp_path / "w"))
    executor = ExecutorProcess(redis_server.url, keys.namespace, 0)
    try:
        for log in (engine.log_path, executor.log_path):
            assert log.resolve().is_relative_to(base), log
    finally:
        engine.kill()
        executor.kill()


def test_a_controller_given_no_log_dir_removes_the_temp_directory_it_made(
        redis_client: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    make_weights_dir(tmp_path / "root" / "base", seed=0)
    cfg = ControllerConfig(namespace=keys.namespace, num_engines=1, model_path=str(tmp_path / "root" / "base"),
                           weights_root=str(tmp_path / "root"))

    async def scenario() -> Path:
        ctl = InferenceController(cfg, redis_client)
        await ctl.start()
        await ctl.wait_serving(60)
        made = ctl.core.log_dir
        assert any(made.glob("engine-0*.log"))  # the engine logged there
        await ctl.stop()
        return made

    made = asyncio.run(scenario())
    assert not made.exists()
