"""What a role on a host of its own needs: an address others reach, and the shared weights root."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_bus.controller.config import ConfigError, ControllerConfig
from rollout_bus.controller.lifecycle import launch_spec
from rollout_bus.events.connection import redis_host, route_address
from rollout_bus.lm.files import weights_root_problem


def test_engines_on_the_redis_host_listen_and_register_on_loopback() -> None:
    config = ControllerConfig(model_path="/m", weights_root="/w", redis_url="redis://127.0.0.1:6379/0")
    assert config.engine_addresses() == ("127.0.0.1", "127.0.0.1")
    assert launch_spec(config, "engine-0", 4321).url == "http://127.0.0.1:4321"


def test_an_advertised_address_is_what_engines_register_under_and_they_listen_everywhere() -> None:
    config = ControllerConfig(model_path="/m", weights_root="/w", advertise_host="10.1.2.3")
    assert config.engine_addresses() == ("0.0.0.0", "10.1.2.3")
    spec = launch_spec(config, "engine-0", 4321)
    assert (spec.host, spec.url) == ("0.0.0.0", "http://10.1.2.3:4321")


def test_engines_that_would_listen_on_loopback_but_register_elsewhere_are_refused() -> None:
    config = ControllerConfig(model_path="/m", weights_root="/w", engine_host="127.0.0.1", advertise_host="10.1.2.3")
    with pytest.raises(ConfigError, match="other hosts could not reach them"):
        config.engine_addresses()


def test_the_route_to_redis_names_this_hosts_address_for_plain_and_sentinel_urls() -> None:
    assert redis_host("redis+sentinel://s1:26380,s2/m/0") == ("s1", 26380)
    assert redis_host("redis://u:p@10.0.0.9:6390/1") == ("10.0.0.9", 6390)
    assert route_address("redis://127.0.0.1:6379/0") == "127.0.0.1"


def test_a_weights_root_this_host_cannot_see_is_a_clear_error(tmp_path: Path) -> None:
    assert weights_root_problem(str(tmp_path)) is None
    problem = weights_root_problem(str(tmp_path / "not-mounted"))
    assert problem is not None and "does not exist on host" in problem and "every host mounts" in problem


def test_the_controller_will_not_start_without_a_usable_weights_root(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from rollout_bus.controller.cli import main

    (tmp_path / "nfs").write_text("a file where the mount should be")
    code = main(["--model-path", str(tmp_path), "--weights-root", str(tmp_path / "nfs" / "weights")])
    assert code == 2
    assert "every host mounts at the same path" in capsys.readouterr().err


def test_a_submit_reads_the_policy_records_not_every_engine_record(fake_client: object) -> None:
    from rollout_bus.events.names import Keys
    from rollout_bus.events.registry import EngineRecord, EngineState, PolicyRecord, Registry
    from rollout_bus.events.submit import RolloutSubmitter

    keys = Keys("submitcost")
    registry = Registry(fake_client, keys)  # type: ignore[arg-type]
    registry.put_engine(EngineRecord(engine_id="e0", url="http://e0", state=EngineState.SERVING,
                                     versions={"p": 0, "adapter": 1}, base_policy="p"))
    registry.put_policy(PolicyRecord(policy="p", published=0, serving=0))
    submitter = RolloutSubmitter(fake_client, keys)  # type: ignore[arg-type]
    reads: list[int] = []
    engines = submitter.registry.engines
    submitter.registry.engines = lambda: reads.append(1) or engines()  # type: ignore[method-assign,func-returns-value]
    assert "p" in submitter.known_policies("p") and reads == []  # a policy record: no engine record read
    assert "adapter" in submitter.known_policies("adapter") and reads == [1]  # only on engines: read them


def test_an_executor_checks_a_request_against_the_policy_records_not_every_engine_record(fake_client: object) -> None:
    from rollout_bus.events.names import Keys
    from rollout_bus.events.registry import EngineRecord, EngineState, PolicyRecord, Registry
    from rollout_bus.events.submit import known_policies
    from rollout_bus.executor import service

    keys = Keys("execcost")
    registry = Registry(fake_client, keys)  # type: ignore[arg-type]
    registry.put_engine(EngineRecord(engine_id="e0", url="http://e0", state=EngineState.SERVING,
                                     versions={"p": 0, "adapter": 1}, base_policy="p"))
    registry.put_policy(PolicyRecord(policy="p", published=0, serving=0))
    reads: list[int] = []
    engines = registry.engines
    registry.engines = lambda: reads.append(1) or engines()  # type: ignore[method-assign,func-returns-value]
    assert service.known_policies is known_policies  # what ExecutorService.run_job checks a request with
    assert known_policies(registry, "p") == {"p"} and reads == []
    assert known_policies(registry, "adapter") == {"p", "adapter"} and reads == [1]
    assert "ghost" not in known_policies(registry, "ghost") and reads == [1, 1]
