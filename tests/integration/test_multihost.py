"""The main job across separate hosts: Redis, the controller with its engines, two executors and the
trainer each in a network namespace of their own, joined by a bridge on a private subnet.

Nothing runs on 127.0.0.1 of another role's host: the engines must register an address the
executors' hosts reach (the controller's route to Redis), an engine's ``/metrics`` must answer
from another host, and weights travel through the filesystem every host shares. The tiny-LM job
completes and the reward rises. Skips (with the reason) only where namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fake_rollouts import shared_init_dir
from tests.support.netns import Hosts, why_not

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ["redis", "engines", "exec0", "exec1", "trainer"]
STEPS = 16
MIN_RISE = 0.15
METRICS = 9400


@pytest.fixture()
def hosts() -> Iterator[Hosts]:
    reason = why_not()
    if reason is not None:
        pytest.skip(f"cannot make network namespaces here: {reason}")
    with Hosts(HOSTS) as h:
        yield h


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _reaches(hosts: Hosts, host: str, addr: str, port: int) -> bool:
    probe = f"import socket; socket.create_connection(({addr!r}, {port}), timeout=1).close()"
    return hosts.run(host, sys.executable, "-c", probe).returncode == 0


def test_the_job_runs_with_every_role_on_a_host_of_its_own(hosts: Hosts, tmp_path: Path) -> None:
    redis_addr = hosts.address("redis")
    redis = subprocess.Popen([*hosts.prefix("redis"), "redis-server", "--bind", redis_addr, "--port", "6379",
                              "--save", "", "--appendonly", "no", "--protected-mode", "no", "--dir", str(tmp_path),
                              "--logfile", str(tmp_path / "redis.log")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    driver: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.monotonic() + 20
        while not _reaches(hosts, "trainer", redis_addr, 6379):
            assert redis.poll() is None, (tmp_path / "redis.log").read_text()
            assert time.monotonic() < deadline, "Redis never answered on its host's address"
            time.sleep(0.2)
        assert not _reaches(hosts, "trainer", "127.0.0.1", 6379)  # another host: Redis is not on its loopback

        out = tmp_path / "out"
        places = {"controller": hosts.prefix("engines"), "executor-0": hosts.prefix("exec0"),
                  "executor-1": hosts.prefix("exec1"), "default": hosts.prefix("trainer")}
        scrape = {"controller": f"http://{hosts.address('engines')}:{METRICS}/metrics",
                  "executor-0": f"http://{hosts.address('exec0')}:{METRICS + 1}/metrics",
                  "executor-1": f"http://{hosts.address('exec1')}:{METRICS + 2}/metrics"}
        spec = {"places": places, "scrape": scrape,
                "config": {"mode": "async", "steps": STEPS, "seed": 0, "out": str(out), "executors": 2,
                           "redis_url": f"redis://{redis_addr}:6379/0", "namespace": f"mh{hosts.tag}",
                           "init_dir": str(shared_init_dir()), "progress": False, "plot": False, "timeout_s": 300.0,
                           "metrics_base_port": METRICS}}
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        with (tmp_path / "driver.log").open("wb") as log:
            driver = subprocess.Popen([*hosts.prefix("trainer"), sys.executable, str(ROOT / "tests/support/multihost_job.py"),
                                       str(tmp_path / "spec.json"), str(tmp_path / "result.json")],
                                      cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log,
                                      stderr=subprocess.STDOUT)
        try:
            code = driver.wait(360)
        except subprocess.TimeoutExpired:
            _stop(driver)
            raise
        assert code == 0, (tmp_path / "driver.log").read_text()[-4000:]
    finally:
        if driver is not None:
            _stop(driver)
        _stop(redis)

    result = json.loads((tmp_path / "result.json").read_text())
    print(result["text"], result["seen"])
    p0 = result["summaries"]["p0"]
    assert p0["steps"] == STEPS
    assert p0["reward_after"] - p0["reward_before"] >= MIN_RISE, p0["rewards"]
    seen = result["seen"]
    engines_at = hosts.address("engines")
    assert seen["engine_urls"] and all(u.startswith(f"http://{engines_at}:") for u in seen["engine_urls"])
    # every role's /metrics answers from another host (the trainer's) at its own host's address
    assert seen["metrics"] == {name: [200, seen["metrics"][name][1]] for name in scrape}
    assert all(lines > 0 for _, lines in seen["metrics"].values())
    logs = out / "logs"
    for name in ("controller", "executor-0", "executor-1", "trainer-p0"):
        assert (logs / f"{name}.log").is_file(), name
