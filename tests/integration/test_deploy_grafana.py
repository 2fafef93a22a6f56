"""The Grafana dashboard: compose provisions it, and every panel's PromQL finds series in a real Prometheus.

A real ``prometheus`` (Debian's package; ``.ci/run`` installs it) runs with a config written
here, on free ports, scraping a live ``rollout-bus run --metrics-base-port`` (controller with
two engines, an executor, a trainer, the bus exporter) every half second. Each panel's query
goes to Prometheus' HTTP query API until every one returns at least one series; then the
run is stopped by SIGTERM and Prometheus by its pid. No Grafana server is needed: Grafana
sends these same queries.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from rollout_bus.events.embedded import RedisServer
from rollout_bus.events.names import Keys
from tests.integration.test_metrics_scrape import free_port_block

yaml = pytest.importorskip("yaml")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "rollout-bus.json"
ROLES = ["controller", "executor-0", "trainer-p0", "bus-metrics"]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel."""
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] if p["type"] != "row" for t in p["targets"]]


def test_compose_provisions_grafana_with_the_prometheus_datasource_and_the_dashboard() -> None:
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    grafana = services["grafana"]
    mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in grafana["volumes"] if v.startswith("./")}
    assert mounts["/etc/grafana/provisioning"] == GRAFANA / "provisioning"
    (source,) = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())[
        "datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "prometheus" in services and "127.0.0.1:9090:9090" in services["prometheus"]["ports"]
    (provider,) = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "rollout-bus.yml").read_text())[
        "providers"]
    assert mounts[provider["options"]["path"]] == DASHBOARD.parent
    board = dashboard()
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    assert all(p["datasource"]["uid"] == source["uid"] for p in panels)
    assert all(t["datasource"]["uid"] == source["uid"] and t["expr"] for p in panels for t in p["targets"])
    titles = " | ".join(p["title"] for p in panels).lower()
    for subject in ("engine states", "weight version per engine", "rollout queue depth", "consumer lag per group",
                    "dead letters", "executor throughput", "trainer step time"):
        assert subject in titles, subject


def start_prometheus(tmp_path: Path, binary: str, targets: dict[str, int]) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port_block(1)
    config = {"global": {"scrape_interval": "500ms", "evaluation_interval": "500ms"},
              "scrape_configs": [{"job_name": role, "static_configs": [{"targets": [f"127.0.0.1:{p}"]}]}
                                 for role, p in targets.items()]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    log.close()
    return proc, port


def api(port: int, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{port}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=5) as reply:
        body = json.loads(reply.read())
    assert body["status"] == "success", body
    return body["data"]


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 45) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_every_panel_query_returns_series_from_a_real_prometheus_scraping_a_live_run(
        tmp_path: Path, redis_server: RedisServer, keys: Keys) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus; .ci/run installs it)")
    base = free_port_block(len(ROLES))
    ports = dict(zip(ROLES, range(base, base + len(ROLES)), strict=True))
    out = tmp_path / "out"
    args = [sys.executable, "-m", "rollout_bus", "run", "--mode", "sync", "--engines", "2", "--executors", "1",
            "--steps", "500", "--n-groups", "4", "--n-samples", "4", "--token-delay-ms", "20", "--warm-steps", "10",
            "--out", str(out), "--redis-url", redis_server.url, "--namespace", keys.namespace, "--no-progress",
            "--no-plot", "--timeout-s", "120", "--metrics-base-port", str(base)]
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "ROLLOUT_BUS_NAMESPACE")}
    prometheus, prom_port = start_prometheus(tmp_path, binary, ports)
    with (tmp_path / "run.out").open("wb") as sink:
        run = subprocess.Popen(args, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    queries = panel_queries()
    empty: list[str] = [title for title, _ in queries]
    started = time.monotonic()
    try:
        deadline = time.monotonic() + 90
        while True:
            time.sleep(1.0)
            if prometheus.poll() is not None:
                pytest.fail(f"prometheus exited with {prometheus.returncode}:\n"
                            f"{(tmp_path / 'prometheus.log').read_text(errors='replace')[-3000:]}")
            try:
                empty = [f"{title}: {expr}" for title, expr in queries
                         if not api(prom_port, "query", query=expr)["result"]]
            except OSError:  # not listening yet
                continue
            if not empty:
                print(f"every panel has series {time.monotonic() - started:.1f}s after the start", file=sys.stderr)
                break
            if run.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"panels without series {'after the run ended' if run.poll() is not None else ''}: "
                            f"{empty}\n--- run\n{(tmp_path / 'run.out').read_text(errors='replace')[-3000:]}")
        # the series came from scrapes of the live run's processes, every one of them up
        targets = api(prom_port, "targets")["activeTargets"]
        assert {t["labels"]["job"]: t["health"] for t in targets} == dict.fromkeys(ROLES, "up")
        assert run.poll() is None
        engines = api(prom_port, "query", query="rollout_bus_engine_weight_version")["result"]
        assert {r["metric"]["engine"] for r in engines} == {"engine-0", "engine-1"}
        assert {r["metric"]["namespace"] for r in engines} == {keys.namespace}
    finally:
        stop(run)
        stop(prometheus, 15)
    for port in [*ports.values(), prom_port]:  # everything started here is gone
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
