"""The ``sglang`` backend's launch command, parsed and resolved by SGLang's own ``ServerArgs``."""

from __future__ import annotations

import argparse
import dataclasses
import sys

import pytest

from tests.contract.lane import require_sglang

require_sglang()

from sglang.srt.arg_groups.overrides import resolving_view  # noqa: E402
from sglang.srt.lora.lora_registry import LoRARef  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from rollout_bus.controller.backends import SglangBackend  # noqa: E402
from rollout_bus.controller.config import ControllerConfig  # noqa: E402
from rollout_bus.controller.lifecycle import launch_spec  # noqa: E402
from rollout_bus.engine.guard import parse_args as guard_args  # noqa: E402
from tests.contract.sglang_harness import config_only_model_dir  # noqa: E402


def server_args(argv: list[str]) -> ServerArgs:
    """What ``python -m sglang.launch_server <argv>`` builds before it starts anything."""
    parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    namespace, unknown = parser.parse_known_args(argv)
    assert not unknown, f"SGLang does not know {unknown}"
    return ServerArgs.from_cli_args(namespace)


def engine_argv(config: ControllerConfig, engine_id: str, port: int) -> list[str]:
    """SGLang's part of the command (behind the guard, on the loopback port the guard forwards to)."""
    spec = dataclasses.replace(launch_spec(config, engine_id, port), inner_port=port + 1000)
    cmd = SglangBackend().command(spec)
    at = cmd.index("--")
    guard, engine = guard_args(cmd[3:])
    assert cmd[:3] == [sys.executable, "-m", "rollout_bus.engine.guard"]
    assert (guard.port, guard.upstream_port, guard.api_key) == (port, port + 1000, config.engine_api_key)
    assert engine == cmd[at + 1:] and engine[:3] == [sys.executable, "-m", "sglang.launch_server"]
    argv = cmd[at + 4:]
    assert argv[argv.index("--host") + 1] == spec.host and argv[argv.index("--port") + 1] == str(port + 1000)
    assert SglangBackend().generate_url(spec) == f"http://{spec.advertise_host or spec.host}:{port + 1000}"
    argv[argv.index("--port") + 1] = str(port)  # so that the checks below read the engine's own port
    return argv


@pytest.fixture()
def config() -> ControllerConfig:
    return ControllerConfig(backend="sglang", num_engines=2, pools=["code=1"], model_path="/models/m",
                            weights_root="/w", initial_version=7, enable_lora=True, max_loras_per_batch=4,
                            max_lora_rank=16, lora_target_modules=["q_proj", "v_proj"], tp_size=2, base_gpu_id=1,
                            engine_api_key="sekret", engine_args=["--mem-fraction-static", "0.5"])


def test_every_engine_gets_its_own_gpus_lora_and_the_api_key(config: ControllerConfig) -> None:
    parsed = {engine_id: server_args(engine_argv(config, engine_id, 30000 + i))
              for i, engine_id in enumerate(sorted(config.expected_engines()))}
    assert {e: (a.base_gpu_id, a.tp_size) for e, a in parsed.items()} == {
        "engine-0": (1, 2), "engine-1": (3, 2), "engine-code-0": (5, 2)}
    for i, args in enumerate(parsed.values()):
        assert (args.model_path, args.host, args.port, args.weight_version) == ("/models/m", "127.0.0.1", 30000 + i, "7")
        assert (args.enable_lora, args.max_loras_per_batch, args.max_lora_rank) == (True, 4, 16)
        assert list(args.lora_target_modules) == ["q_proj", "v_proj"]
        assert (args.api_key, args.enable_memory_saver, args.mem_fraction_static) == ("sekret", True, 0.5)


def test_lora_without_adapters_at_launch_passes_sglangs_own_checks(config: ControllerConfig) -> None:
    """SGLang refuses --enable-lora without --lora-paths unless --max-lora-rank and --lora-target-modules
    are given; the backend always gives them."""
    argv = engine_argv(config, "engine-0", 30000)
    argv[argv.index("--model-path") + 1] = config_only_model_dir()
    args = server_args([*argv, "--device", "cpu"])
    args.resolve_once()
    args.check_server_args()
    assert resolving_view(args).enable_lora is True and args.lora_paths in (None, [])


def test_adapters_given_at_launch_become_sglangs_lora_refs(config: ControllerConfig) -> None:
    config.engine_args = ["--lora-paths", "math@v1=/w/math/v000001", "code@v3=/w/code/v000003"]
    argv = engine_argv(config, "engine-1", 30001)
    argv[argv.index("--model-path") + 1] = config_only_model_dir()
    args = server_args([*argv, "--device", "cpu"])
    args.resolve_once()
    args.check_server_args()
    refs = {ref.lora_name: ref.lora_path for ref in resolving_view(args).lora_paths if isinstance(ref, LoRARef)}
    assert refs == {"math@v1": "/w/math/v000001", "code@v3": "/w/code/v000003"}


def test_without_lora_the_command_carries_no_lora_flags() -> None:
    config = ControllerConfig(backend="sglang", model_path="/models/m", weights_root="/w")
    args = server_args(engine_argv(config, "engine-0", 30000))
    assert args.enable_lora is None and (args.base_gpu_id, args.tp_size) == (0, 1) and args.api_key is None
