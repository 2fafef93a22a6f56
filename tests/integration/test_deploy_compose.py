"""compose.yaml, the Dockerfile and deploy/ hang together, and every command they run accepts its arguments.

There is no Docker engine here: the file is parsed, and each role's entrypoint is run with the
compose arguments plus ``--help`` (every flag compose passes must be one the entrypoint knows).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

yaml = pytest.importorskip("yaml")

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
ROLES = {"controller": 9101, "executor": None, "trainer": 9103, "bus-metrics": 9100}
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def resolve(value: str) -> str:
    """Compose's ``${VAR:-default}`` with the defaults (the environment is the deployer's, not ours)."""
    return _VAR.sub(lambda m: m.group(2) or "", value)


def command(service: dict[str, Any]) -> list[str]:
    return [resolve(str(a)) for a in service["command"]]


def acl_users() -> dict[str, str]:
    users = {}
    for line in (ROOT / "deploy" / "users.acl").read_text().splitlines():
        parts = line.split()
        secret = next((p[1:] for p in parts if p.startswith("#")), "")
        users[parts[1]] = secret
    return users


def test_compose_has_every_service_built_from_one_image() -> None:
    services = compose()["services"]
    assert {"redis", "controller", "executor", "trainer", "prometheus", "bus-metrics"} <= set(services)
    assert services["redis"]["image"].startswith("redis:7")
    builds = {name: (svc.get("build"), svc.get("image")) for name, svc in services.items()
              if "build" in svc and "profiles" not in svc}
    assert set(ROLES) <= set(builds) and len(set(builds.values())) == 1
    assert (ROOT / "Dockerfile").is_file()


def test_the_executor_scales_no_fixed_name_host_ports_or_hostname() -> None:
    executor = compose()["services"]["executor"]
    assert not {"container_name", "ports", "hostname"} & set(executor)


def test_redis_persists_with_aof_everysec_and_loads_the_acl_file_compose_mounts() -> None:
    redis_svc = compose()["services"]["redis"]
    conf = (ROOT / "deploy" / "redis.conf").read_text()
    settings = dict(line.split(None, 1) for line in conf.splitlines() if line.strip() and not line.startswith("#"))
    assert settings["appendonly"] == "yes" and settings["appendfsync"] == "everysec"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in redis_svc["volumes"] if v.startswith("./")}
    assert mounts[settings["aclfile"]] == "./deploy/users.acl"
    assert mounts[redis_svc["command"][1]] == "./deploy/redis.conf"


def test_each_role_connects_as_its_own_acl_user_with_the_default_password() -> None:
    users = acl_users()
    assert users["default"] == "" and "off" in (ROOT / "deploy" / "users.acl").read_text().splitlines()[0]
    for name, expected_user in (("controller", "controller"), ("executor", "executor"), ("trainer", "trainer"),
                                ("bus-metrics", "status")):
        url = urlsplit(resolve(compose()["services"][name]["environment"]["REDIS_URL"]))
        assert url.username == expected_user
        assert hashlib.sha256((url.password or "").encode()).hexdigest() == users[expected_user]


def test_prometheus_scrapes_the_metrics_ports_compose_serves() -> None:
    services = compose()["services"]
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets: dict[str, set[int]] = {}
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            for t in static["targets"]:
                host, port = t.rsplit(":", 1)
                targets.setdefault(host, set()).add(int(port))
        for dns in job.get("dns_sd_configs", []):
            for n in dns["names"]:
                targets.setdefault(n, set()).add(int(dns["port"]))
    for name in ROLES:
        args = command(services[name])
        for flag in ("--metrics-port", "--serve-metrics"):
            if flag in args:
                assert int(args[args.index(flag) + 1]) in targets[name], name
    assert "executor" in targets  # replicas found through Docker DNS


def test_the_dockerfile_installs_cpu_torch_first_then_every_package_it_copies() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    torch_at = text.index("torch==2.13.0")
    assert "download.pytorch.org/whl/cpu" in text[torch_at:text.index("\n", torch_at)]
    assert torch_at < text.index("pip install .")
    copied = re.findall(r"^COPY (\S+)/ ", text, re.M)
    folders = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    assert folders <= set(copied)
    for path in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for src in path.split():
            assert (ROOT / src).exists(), src


def entrypoint(args: list[str]) -> list[str]:
    """The compose command as this interpreter runs it (``rollout-bus`` is ``python -m rollout_bus``)."""
    if args[0] == "rollout-bus":
        return [sys.executable, "-m", "rollout_bus", *args[1:]]
    assert args[0] == "python", args
    return [sys.executable, *args[1:]]


@pytest.mark.parametrize("name", ["init-model", "controller", "executor", "trainer", "bus-metrics"])
def test_every_command_compose_runs_exists_and_knows_its_flags(name: str) -> None:
    args = entrypoint(command(compose()["services"][name]))
    assert args[1] == "-m", f"{name}: compose runs an installed module, not a file ({args[1]})"
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "ROLLOUT_BUS_NAMESPACE")}
    done = subprocess.run([*args, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    help_text = done.stdout
    for flag in (a.split("=", 1)[0] for a in args[2:] if a.startswith("--")):
        assert re.search(rf"(^|[\s\[,]){re.escape(flag)}\b", help_text), f"{name}: {flag} unknown to {args[1]}"
