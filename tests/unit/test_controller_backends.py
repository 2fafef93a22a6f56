"""Both backends build their command by the same launch spec; sglang's is only built, never run here."""

from __future__ import annotations

import pytest

from rollout_bus.controller.backends import CpuBackend, LaunchSpec, SglangBackend, make_backend


def spec(**kw: object) -> LaunchSpec:
    base: dict[str, object] = dict(engine_id="engine-0", host="127.0.0.1", port=31000, model_path="/models/qwen",
                                   weight_version=7, python="/usr/bin/python3")
    base.update(kw)
    return LaunchSpec(**base)  # type: ignore[arg-type]


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_sglang_command_launches_the_server_module_with_model_host_port_and_version() -> None:
    cmd = SglangBackend(guard=False).command(spec(extra_args=("--tp", "2")))
    assert cmd[:3] == ["/usr/bin/python3", "-m", "sglang.launch_server"]
    assert flag(cmd, "--model-path") == "/models/qwen"
    assert flag(cmd, "--host") == "127.0.0.1"
    assert flag(cmd, "--port") == "31000"
    assert flag(cmd, "--weight-version") == "7"
    assert cmd.count("--enable-memory-saver") == 1  # offload/onload need it
    assert cmd[-2:] == ["--tp", "2"]


def test_sglang_memory_saver_is_not_doubled_and_can_be_left_out() -> None:
    assert SglangBackend().command(spec(extra_args=("--enable-memory-saver",))).count("--enable-memory-saver") == 1
    assert "--enable-memory-saver" not in SglangBackend(memory_saver=False).command(spec())


def test_cpu_command_runs_the_project_engine_with_its_options() -> None:
    cmd = CpuBackend().command(spec(token_delay_ms=2.5, seed=3, extra_args=("--max-batch-size", "8")))
    assert cmd[:3] == ["/usr/bin/python3", "-m", "rollout_bus.engine.server"]
    assert flag(cmd, "--model-path") == "/models/qwen"
    assert flag(cmd, "--port") == "31000"
    assert flag(cmd, "--weight-version") == "7"
    assert flag(cmd, "--token-delay-ms") == "2.5"
    assert flag(cmd, "--seed") == "3"
    assert cmd[-2:] == ["--max-batch-size", "8"]
    assert "--token-delay-ms" not in CpuBackend().command(spec())


def test_make_backend_knows_both_and_refuses_others() -> None:
    assert isinstance(make_backend("cpu"), CpuBackend)
    assert isinstance(make_backend("sglang"), SglangBackend)
    with pytest.raises(ValueError, match="unknown backend"):
        make_backend("vllm")
    assert spec().url == "http://127.0.0.1:31000"


def test_lora_and_the_api_key_reach_both_backends_and_each_engine_gets_its_own_gpus() -> None:
    from rollout_bus.controller.config import ControllerConfig
    from rollout_bus.controller.lifecycle import launch_spec
    from rollout_bus.engine.args import parse_args

    config = ControllerConfig(num_engines=2, pools=["code=1"], model_path="/m", weights_root="/w", enable_lora=True,
                              max_lora_rank=16, tp_size=2, base_gpu_id=1, engine_api_key="k")
    specs = {e: launch_spec(config, e, 31000) for e in sorted(config.expected_engines())}
    assert {e: s.base_gpu_id for e, s in specs.items()} == {"engine-0": 1, "engine-1": 3, "engine-code-0": 5}
    cpu = CpuBackend().command(specs["engine-1"])
    args = parse_args(cpu[3:])  # the CPU engine's own parser takes what the backend gives it
    assert (args.enable_lora, args.max_lora_rank, args.api_key) == (True, 16, "k")
    sglang = SglangBackend().command(specs["engine-1"])
    assert (flag(sglang, "--base-gpu-id"), flag(sglang, "--tp-size"), flag(sglang, "--api-key")) == ("3", "2", "k")
    assert "--enable-lora" in sglang and flag(sglang, "--max-lora-rank") == "16"
    plain = CpuBackend().command(launch_spec(ControllerConfig(model_path="/m", weights_root="/w"), "engine-0", 1))
    assert "--enable-lora" not in plain and "--api-key" not in plain


def test_a_cpu_engine_gets_the_weights_root_it_may_load_from() -> None:
    assert flag(CpuBackend().command(spec(weights_root="/shared/weights")), "--weights-root") == "/shared/weights"
    assert "--weights-root" not in CpuBackend().command(spec())


def test_sglang_runs_behind_its_fence_guard_which_takes_the_engines_port() -> None:
    backend = SglangBackend()
    launched = backend.prepare(spec(api_key="k"))
    cmd = backend.command(launched)
    at = cmd.index("--")
    assert cmd[:3] == ["/usr/bin/python3", "-m", "rollout_bus.engine.guard"]
    assert (flag(cmd[:at], "--port"), flag(cmd[:at], "--api-key")) == ("31000", "k")
    assert flag(cmd[:at], "--upstream-port") == str(launched.inner_port) != "31000"
    assert cmd[at + 1:at + 4] == ["/usr/bin/python3", "-m", "sglang.launch_server"]
    assert flag(cmd[at:], "--port") == str(launched.inner_port)
    assert backend.generate_url(launched) == f"http://127.0.0.1:{launched.inner_port}"
    assert CpuBackend().generate_url(CpuBackend().prepare(spec())) == ""  # the CPU engine reads the fence itself
