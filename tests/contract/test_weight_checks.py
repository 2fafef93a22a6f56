"""What SGLang offers to check weights, against the controller's check (``controller.checks``).

SGLang's app has no ``/weights_digest``: the controller reports such an engine ``unchecked``, with the
reason, and neither fails it nor takes it out of service, directly or behind the guard. What SGLang does
offer, ``/weights_checker``, hashes its runner's own parameters (docs/architecture.md, "The SGLang
contract lane", says why that cannot be compared with a published directory); this pins that it is there
with the fields that account rests on, so a new sglang that changes it fails here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest

from tests.contract.lane import require_sglang

require_sglang()

from rollout_bus.controller.checks import NO_ROUTE  # noqa: E402
from rollout_bus.controller.config import ControllerConfig  # noqa: E402
from rollout_bus.controller.service import InferenceController  # noqa: E402
from rollout_bus.events.registry import EngineState  # noqa: E402
from tests.contract.sglang_harness import Harness  # noqa: E402
from tests.contract.test_guard import guarded  # noqa: E402
from tests.contract.test_requests import run  # noqa: E402

KEY = "sekret"


@pytest.fixture(scope="module")
def harness() -> Harness:
    return Harness(["--api-key", KEY, "--weight-version", "0"])


@pytest.fixture(scope="module")
def url(harness: Harness) -> Iterator[str]:
    with harness.serve() as base:
        yield base


def test_an_sglang_engine_is_reported_unchecked_with_the_reason_and_keeps_serving(
        harness: Harness, url: str, tmp_path: Path) -> None:
    config = ControllerConfig(namespace="checks", num_engines=0, adopt_urls=[url], weights_root=str(tmp_path),
                              log_dir=str(tmp_path / "logs"), engine_api_key=KEY)
    ctl = InferenceController(config, fakeredis.FakeRedis())

    async def scenario() -> list[tuple[str, str]]:
        answers = []
        async with guarded(url) as door:
            for engine_id, address in (("direct", url), ("guarded", door)):
                h = ctl.lifecycle.new_handle(engine_id, address, managed=False, state=EngineState.SERVING)
                h.record.versions = {"default": 0}
                answers += [(a.engine_id, a.outcome, a.reason) for a in await ctl.check_weights([engine_id])]
        return answers

    try:
        answers = run(scenario())
    finally:
        ctl.core.bus.close()
    assert answers == [("direct", "unchecked", NO_ROUTE), ("guarded", "unchecked", NO_ROUTE)]
    assert all(h.state == EngineState.SERVING for h in ctl.engines.values())


def test_sglangs_own_weights_checker_hashes_its_runners_parameters() -> None:
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers.io_struct import ChecksumInfo, CheckWeightsReqInput
    from sglang.srt.utils import weight_checker

    paths = {getattr(route, "path", None) for route in http_server.app.routes}
    assert "/weights_checker" in paths and "/weights_digest" not in paths
    assert CheckWeightsReqInput().action == "checksum"
    assert set(ChecksumInfo.__struct_fields__) == {"checksums", "per_gpu_checksum", "parallelism_info"}
    assert "named_parameters" in weight_checker.WeightChecker._model_state.__code__.co_names
