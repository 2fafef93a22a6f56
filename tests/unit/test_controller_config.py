"""Config validation: every problem reported at once, unknown settings refused with a hint."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_bus.controller.cli import parse_config
from rollout_bus.controller.config import ConfigError, ControllerConfig


def valid(tmp_path: Path, **kw: object) -> ControllerConfig:
    base: dict[str, object] = dict(model_path=str(tmp_path), weights_root=str(tmp_path))
    base.update(kw)
    return ControllerConfig(**base)  # type: ignore[arg-type]


def test_a_complete_config_validates(tmp_path: Path) -> None:
    cfg = valid(tmp_path, adopt_urls=["http://10.0.0.2:30000"], pause_mode="in_place").validate()
    assert cfg.total_engines == 2


def test_every_problem_is_listed_in_one_error(tmp_path: Path) -> None:
    cfg = valid(tmp_path, backend="vllm", pause_mode="hold", health_timeout_s=0, health_failure_threshold=0,
                namespace="bad ns", adopt_urls=["10.0.0.2"], metrics_port=70000, weights_root="")
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    text = str(info.value)
    for needle in ("backend 'vllm'", "pause_mode 'hold'", "health_timeout_s", "health_failure_threshold",
                   "namespace", "http://host:port", "metrics_port", "weights_root"):
        assert needle in text


def test_launching_needs_a_model_directory_for_the_cpu_backend_but_not_for_sglang(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model_path is required"):
        valid(tmp_path, model_path="").validate()
    with pytest.raises(ConfigError, match="not a directory"):
        valid(tmp_path, model_path=str(tmp_path / "missing")).validate()
    valid(tmp_path, backend="sglang", model_path="Qwen/Qwen3-0.6B").validate()


def test_nothing_to_manage_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nothing to manage"):
        valid(tmp_path, num_engines=0).validate()


def test_unknown_settings_are_refused_with_the_closest_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="did you mean 'pause_mode'"):
        ControllerConfig.from_mapping({"model_path": str(tmp_path), "weights_root": str(tmp_path),
                                       "pause_mod": "abort"})


def test_cli_flags_become_a_validated_config(tmp_path: Path) -> None:
    cfg, level = parse_config([
        "--model-path", str(tmp_path), "--weights-root", str(tmp_path), "--num-engines", "3",
        "--pause-mode", "abort", "--adopt-url", "http://127.0.0.1:9", "--engine-arg=--max-batch-size",
        "--engine-arg=4", "--keep-engines", "--metrics-port", "0", "--log-level", "debug"])
    assert (cfg.num_engines, cfg.pause_mode, cfg.adopt_urls) == (3, "abort", ["http://127.0.0.1:9"])
    assert cfg.engine_args == ["--max-batch-size", "4"]
    assert cfg.stop_engines_on_exit is False
    assert cfg.metrics_port == 0
    assert level == "debug"
    with pytest.raises(ConfigError):
        parse_config(["--model-path", str(tmp_path)])


def test_pools_name_a_policy_and_a_number_of_engines_and_never_the_base_policy() -> None:
    config = ControllerConfig(model_path="/m", weights_root="/w", num_engines=1, pools=["math=2"], backend="sglang")
    assert config.validate().expected_engines() == {"engine-0": "default", "engine-math-0": "math",
                                                    "engine-math-1": "math"}
    assert config.total_engines == 3
    for pools, fragment in ((["math"], "must be POLICY=NUM_ENGINES"), (["default=1"], "is the base policy"),
                            (["a b=1"], "pool policy"), (["m=1", "m=2"], "given twice")):
        with pytest.raises(ConfigError, match=fragment):
            ControllerConfig(model_path="/m", weights_root="/w", pools=pools, backend="sglang").validate()
