"""Every role's ``/metrics`` is scraped over HTTP while a real run goes on, and holds its figures.

``rollout-bus run --metrics-base-port N`` runs the whole system as processes (a controller with two
engines, an executor, a trainer, the bus exporter). The test polls the four endpoints until each
holds the figures Prometheus is meant to get (engine states, health-check latency, weight-update
duration; jobs started, done and failed, samples, batch bytes; staleness, batches, steps, reward;
consumer lag, pending, dead letters, queue depth), then stops the run by SIGTERM, long before its
steps are done: every scrape below is of live processes.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from rollout_bus.launch.cli import build_parser, config_from_args
from rollout_bus.launch.config import RunConfig, metrics_ports

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
ENGINES = 2
N_GROUPS, N_SAMPLES = 4, 4
MODE = "sync"
TOKEN_DELAY_MS = 20.0
Samples = dict[str, list[tuple[dict[str, str], float]]]
Check = tuple[str, Callable[[Samples], bool]]


def free_port_block(n: int) -> int:
    """A base port with ``n`` free ports from it (below Linux's ephemeral range)."""
    for _ in range(100):
        base = random.randrange(20_000, 32_000 - n)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no block of {n} free ports")


def scrape(port: int) -> Samples | None:
    """Samples by name (``_total``, ``_count``... included), or None when nothing answers."""
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return None
    out: Samples = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def values(samples: Samples, name: str, **labels: str) -> list[float]:
    return [v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(values(samples, name, **labels))


def checks(keys: Keys) -> dict[str, list[Check]]:
    ns, policy, trainer = keys.namespace, "p0", "trainer-p0"
    queue = keys.rollout_queue
    return {
        "controller": [
            (f"engines serving == {ENGINES}",
             lambda s: values(s, "rollout_bus_controller_engines", state="serving") == [ENGINES]),
            ("no engine launching or unhealthy",
             lambda s: total(s, "rollout_bus_controller_engines", state="launching")
             + total(s, "rollout_bus_controller_engines", state="unhealthy") == 0),
            ("health checks observed",
             lambda s: total(s, "rollout_bus_controller_health_check_seconds_count", outcome="ok") > 0
             and total(s, "rollout_bus_controller_health_check_seconds_sum", outcome="ok") > 0),
            ("health check rounds observed", lambda s: total(s, "rollout_bus_controller_health_round_seconds_count") > 0),
            ("weight updates observed",
             lambda s: total(s, "rollout_bus_controller_weight_update_seconds_count", policy=policy,
                             outcome="applied") > 0
             and total(s, "rollout_bus_controller_weight_update_seconds_sum", policy=policy) > 0),
        ],
        "executor-0": [
            ("jobs started", lambda s: total(s, "rollout_bus_executor_jobs_started_total") > 0),
            ("jobs done", lambda s: total(s, "rollout_bus_executor_jobs_total", outcome="ok") > 0),
            ("failed jobs exported", lambda s: values(s, "rollout_bus_executor_jobs_total", outcome="failed") != []),
            ("started >= done",
             lambda s: total(s, "rollout_bus_executor_jobs_started_total")
             >= total(s, "rollout_bus_executor_jobs_total", outcome="ok")),
            ("samples published",
             lambda s: total(s, "rollout_bus_executor_samples_total") >= N_GROUPS * N_SAMPLES),
            ("batch bytes observed",
             lambda s: total(s, "rollout_bus_executor_batch_bytes_count") > 0
             # tokens alone are int64, several per sample
             and total(s, "rollout_bus_executor_batch_bytes_sum") / total(s, "rollout_bus_executor_batch_bytes_count")
             > N_GROUPS * N_SAMPLES * 8),
        ],
        "trainer-p0": [
            ("steps", lambda s: total(s, "rollout_bus_trainer_steps_total", policy=policy, trainer=trainer) > 0),
            ("staleness histogram",
             lambda s: total(s, "rollout_bus_trainer_sample_staleness_count", policy=policy, trainer=trainer) > 0
             and total(s, "rollout_bus_trainer_sample_staleness_bucket", policy=policy, trainer=trainer, le="+Inf")
             == total(s, "rollout_bus_trainer_sample_staleness_count", policy=policy, trainer=trainer)),
            ("batches trained", lambda s: total(s, "rollout_bus_trainer_batches_total", outcome="trained") > 0),
            ("reward in [0, 1]",
             lambda s: [r for r in values(s, "rollout_bus_trainer_reward_mean", policy=policy) if 0 <= r <= 1] != []),
            ("weight version", lambda s: total(s, "rollout_bus_trainer_weight_version", policy=policy) > 0),
        ],
        "bus-metrics": [
            ("redis up", lambda s: values(s, "rollout_bus_redis_up", namespace=ns) == [1.0]),
            ("lag of the trainer's group",
             lambda s: len(values(s, "rollout_bus_group_lag", namespace=ns, stream=f"batches/{policy}",
                                  group=trainer)) == 1),
            ("pending of the trainer's group",
             lambda s: len(values(s, "rollout_bus_group_pending", namespace=ns, stream=f"batches/{policy}",
                                  group=trainer)) == 1),
            ("dead letters", lambda s: [d for d in values(s, "rollout_bus_dead_letters", namespace=ns) if d >= 0]
             != []),
            ("rollout queue depth",
             lambda s: len(values(s, "rollout_bus_queue_jobs", namespace=ns, queue=queue, state="queued")) == 1),
            (f"{ENGINES} engines serving in the registry",
             lambda s: values(s, "rollout_bus_engines", namespace=ns, state="serving") == [ENGINES]),
        ],
    }


def missing(samples: Samples | None, role_checks: list[Check]) -> list[str]:
    if samples is None:
        return ["no answer"]
    return [name for name, ok in role_checks if not ok(samples)]


def test_every_role_serves_its_metrics_during_a_run(tmp_path: Path, redis_server: RedisServer, keys: Keys) -> None:
    roles = ["controller", "executor-0", "trainer-p0", "bus-metrics"]
    base = free_port_block(len(roles))
    ports = dict(zip(roles, range(base, base + len(roles)), strict=True))
    stdout = tmp_path / "run.out"
    out = tmp_path / "out"
    args = [sys.executable, "-m", "rollout_bus", "run", "--mode", MODE, "--engines", str(ENGINES), "--executors", "1",
            "--trainers", "1", "--steps", "500", "--n-groups", str(N_GROUPS), "--n-samples", str(N_SAMPLES),
            "--token-delay-ms", str(TOKEN_DELAY_MS), "--warm-steps", "10", "--out", str(out),
            "--redis-url", redis_server.url, "--namespace", keys.namespace, "--no-progress", "--no-plot",
            "--timeout-s", "100", "--metrics-base-port", str(base)]
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "ROLLOUT_BUS_NAMESPACE")}
    with stdout.open("wb") as sink:
        run = subprocess.Popen(args, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    want = checks(keys)
    latest: dict[str, Samples | None] = dict.fromkeys(roles)
    try:
        deadline = time.monotonic() + 60
        while True:
            latest = {role: scrape(port) for role, port in ports.items()}
            gaps = {role: m for role in roles if (m := missing(latest[role], want[role]))}
            if not gaps:
                break
            if run.poll() is not None or time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                                 for p in sorted((out / "logs").glob("*.log")))
                pytest.fail(f"missing after {'the run ended' if run.poll() is not None else 'the deadline'}: "
                            f"{gaps}\n--- run.py\n{stdout.read_text(errors='replace')[-3000:]}\n{logs}")
            time.sleep(0.25)
        # scraped while the run goes on: the trainer is far from its 500 steps
        trainer = latest["trainer-p0"]
        assert trainer is not None and total(trainer, "rollout_bus_trainer_steps_total") < 500
        assert run.poll() is None
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGTERM)  # run.py stops everything it started, by pid
            try:
                run.wait(45)  # its own stop sends SIGKILL after 10 s per process
            except subprocess.TimeoutExpired:
                run.kill()
                run.wait(5)
    printed = stdout.read_text()
    for role, port in ports.items():
        assert f"http://127.0.0.1:{port}/metrics" in printed, role
    for port in ports.values():  # the run took its processes down with it
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0


def test_the_metrics_ports_follow_the_base_port_and_are_off_by_default() -> None:
    assert metrics_ports(RunConfig()) == {}
    config = config_from_args(build_parser().parse_args(["--executors", "2", "--trainers", "2",
                                                         "--metrics-base-port", "9101"]))
    assert metrics_ports(config) == {"controller": 9101, "executor-0": 9102, "executor-1": 9103,
                                     "trainer-p0": 9104, "trainer-p1": 9105, "bus-metrics": 9106}
    with pytest.raises(SystemExit):
        config_from_args(build_parser().parse_args(["--metrics-base-port", "65534"]))
