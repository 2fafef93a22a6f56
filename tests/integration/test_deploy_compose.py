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
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

yaml = pytest.importorskip("yaml")

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
ROLES = {"controller": 9101, "executor": None, "trainer": 9103, "bus-metrics": 9100}
SECRETS = {"CONTROLLER_PASSWORD": "c-secret", "EXECUTOR_PASSWORD": "e-secret", "TRAINER_PASSWORD": "t-secret",
           "STATUS_PASSWORD": "s-secret", "ENGINE_API_KEY": "engine-key", "GRAFANA_ADMIN_PASSWORD": "g-secret"}
"""What a deployer must set: compose refuses to start without any of them."""
_VAR = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


class MissingVariable(ValueError):
    pass


def resolve(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's interpolation: ``${VAR:-default}``, ``${VAR:?message}`` (an error when unset or empty) and
    ``$$`` (a literal ``$``), over ``env`` (default: the secrets a deployer sets)."""
    env = SECRETS if env is None else env

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        value = env.get(name, "")
        if op == ":?" and not value:
            raise MissingVariable(f"{name}: {arg}")
        return value or (arg if op == ":-" else "")
    return _VAR.sub(one, value)


def resolved(node: Any, env: dict[str, str] | None = None) -> Any:
    """The whole compose file, interpolated as ``docker compose config`` does."""
    if isinstance(node, dict):
        return {k: resolved(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [resolved(v, env) for v in node]
    return resolve(node, env) if isinstance(node, str) else node


def compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    return resolved(yaml.safe_load((ROOT / "compose.yaml").read_text()), env)


def command(service: dict[str, Any]) -> list[str]:
    return [str(a) for a in service["command"]]


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


def test_redis_persists_with_aof_everysec_and_loads_the_acl_file_it_renders_from_the_template() -> None:
    redis_svc = compose()["services"]["redis"]
    conf = (ROOT / "deploy" / "redis.conf").read_text()
    settings = dict(line.split(None, 1) for line in conf.splitlines() if line.strip() and not line.startswith("#"))
    assert settings["appendonly"] == "yes" and settings["appendfsync"] == "everysec"
    assert settings["protected-mode"] == "yes"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in redis_svc["volumes"] if v.startswith("./")}
    script = redis_svc["command"][2]
    render = re.search(r"sh (\S+) (\S+) (\S+)", script)
    assert render is not None
    assert mounts[render.group(1)] == "./deploy/render-acl.sh" and mounts[render.group(2)] == "./deploy/users.acl"
    assert render.group(3) == settings["aclfile"]
    assert mounts[re.search(r"redis-server (\S+)", script).group(1)] == "./deploy/redis.conf"  # type: ignore[union-attr]


def test_each_role_connects_as_its_own_acl_user_with_the_password_it_is_given(tmp_path: Path) -> None:
    services = compose()["services"]
    env = {k: v for k, v in services["redis"]["environment"].items() if v}
    done = subprocess.run(["sh", str(ROOT / "deploy" / "render-acl.sh"), str(ROOT / "deploy" / "users.acl"),
                           str(tmp_path / "users.acl")], env={"PATH": os.environ["PATH"], **env},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    users = {}
    for line in (tmp_path / "users.acl").read_text().splitlines():
        parts = line.split()
        users[parts[1]] = next((p[1:] for p in parts if p.startswith("#")), "")
    assert users["default"] == "" and users["admin"] == ""  # off: no ADMIN_PASSWORD given
    for name, expected_user in (("controller", "controller"), ("executor", "executor"), ("trainer", "trainer"),
                                ("bus-metrics", "status")):
        url = urlsplit(services[name]["environment"]["REDIS_URL"])
        assert url.username == expected_user
        assert url.password == SECRETS[f"{expected_user.upper()}_PASSWORD"]
        assert hashlib.sha256((url.password or "").encode()).hexdigest() == users[expected_user]


def test_compose_refuses_to_start_without_each_password_and_the_engine_api_key() -> None:
    for name in SECRETS:
        with pytest.raises(MissingVariable, match=name):
            compose({k: v for k, v in SECRETS.items() if k != name})
    assert "dev-password" not in (ROOT / "compose.yaml").read_text()


def test_engines_get_the_api_key_and_only_the_trainer_writes_published_weights() -> None:
    services = compose()["services"]
    for name in ("controller", "executor"):
        assert services[name]["environment"]["ROLLOUT_BUS_ENGINE_API_KEY"] == SECRETS["ENGINE_API_KEY"]

    def writable(name: str) -> set[str]:
        return {v.split(":")[1] for v in services[name].get("volumes", []) if not v.endswith(":ro")}
    assert writable("executor") == set() and writable("bus-metrics") == set()
    assert writable("controller") == {"/shared/engine-logs"}
    assert writable("trainer") == {"/shared/weights", "/shared/checkpoints", "/shared/runs"}
    assert writable("init-model") == {"/shared/model"}
    args = command(services["controller"])
    assert args[args.index("--weights-root") + 1] == "/shared/weights"


def test_the_gateway_reaches_the_engines_with_their_key_and_its_clients_have_keys_of_their_own() -> None:
    engine_key = "engine-key-0123456789abcdef"
    tenants = "team-a tenant-a-key-0123456789 default; team-b tenant-b-key-0123456789"
    env = {**SECRETS, "ENGINE_API_KEY": engine_key, "GATEWAY_PASSWORD": "gw-secret", "GATEWAY_API_KEYS": tenants}
    services = compose(env)["services"]
    gateway = services["gateway"]
    assert gateway["profiles"] == ["gateway"] and gateway["ports"] == ["127.0.0.1:8300:8300"]
    assert gateway["environment"]["ROLLOUT_BUS_ENGINE_API_KEY"] == engine_key
    assert gateway["environment"]["ROLLOUT_BUS_GATEWAY_API_KEYS"] == tenants
    assert urlsplit(gateway["environment"]["REDIS_URL"]).username == "gateway"
    assert services["redis"]["environment"]["GATEWAY_PASSWORD"] == "gw-secret"  # its ACL user is rendered on
    for name, svc in services.items():  # every engine's key is the one secret: the controller launches them
        if "ROLLOUT_BUS_ENGINE_API_KEY" in svc.get("environment", {}):
            assert svc["environment"]["ROLLOUT_BUS_ENGINE_API_KEY"] == engine_key, name
    assert "ROLLOUT_BUS_GATEWAY_API_KEYS" not in services["controller"]["environment"]
    args = entrypoint(command(gateway))
    assert args[args.index("--host") + 1] == "0.0.0.0"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_URL", "ROLLOUT_BUS_"))}
    base.update(REDIS_URL="redis://127.0.0.1:1/0", ROLLOUT_BUS_ENGINE_API_KEY=engine_key)
    # as compose starts it without GATEWAY_API_KEYS, and with a client key that is the engines': refused
    for keys, refusal in (("", "without client keys"), (f"ops {engine_key}", "engines' key")):
        done = subprocess.run(args, cwd=ROOT, env={**base, "ROLLOUT_BUS_GATEWAY_API_KEYS": keys},
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and refusal in done.stderr and engine_key not in done.stderr, done.stderr


def test_the_sentinel_profile_runs_two_replicas_and_no_service_uses_the_admin_user() -> None:
    services = compose({**SECRETS, "REPLICATION_PASSWORD": "r", "SENTINEL_PASSWORD": "x"})["services"]
    replicas = [n for n, svc in services.items() if "--replicaof" in " ".join(map(str, svc.get("command", [])))]
    assert len(replicas) == 2 and all(services[n]["profiles"] == ["sentinel"] for n in replicas)
    for name in replicas:
        assert "--masteruser replication" in services[name]["command"][2]
    assert "sentinel auth-user mymaster sentinel" in services["sentinel-1"]["command"][0]
    text = yaml.safe_dump(services)
    assert "admin" not in re.sub(r"GF_SECURITY_ADMIN_PASSWORD|GRAFANA_ADMIN_PASSWORD", "", text).replace(
        "--disable-delete", "")


def test_redis_starts_from_the_compose_command_with_the_rendered_acl_and_answers_its_healthcheck(
        tmp_path: Path) -> None:
    from rollout_bus.events.embedded import find_redis_server, free_port

    binary = find_redis_server()
    if binary is None:
        pytest.skip("redis-server is not installed")
    services = compose()["services"]
    redis_svc = services["redis"]
    etc = tmp_path / "etc"
    etc.mkdir()
    for volume in redis_svc["volumes"]:
        if volume.startswith("./"):
            source, target = volume.split(":")[:2]
            (etc / Path(target).name).symlink_to(ROOT / source)
    port = free_port()
    script = (redis_svc["command"][2].replace("/usr/local/etc/redis/", f"{etc}/")
              .replace("/tmp/users.acl", f"{tmp_path}/users.acl").replace("chown redis", "true")
              .replace("exec docker-entrypoint.sh redis-server", f"exec {binary}"))
    script += f" --aclfile {tmp_path}/users.acl --port {port} --bind 127.0.0.1 --dir {tmp_path} --daemonize no"
    env = {"PATH": os.environ["PATH"], **{k: v for k, v in redis_svc["environment"].items() if v}}
    proc = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        health = redis_svc["healthcheck"]["test"][1].replace("redis-cli", f"redis-cli -p {port}")
        deadline = time.monotonic() + 20
        while subprocess.run(["sh", "-c", health], env=env, capture_output=True).returncode != 0:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the healthcheck never passed"
            time.sleep(0.1)
        client = redis.Redis(port=port, username="status", password=SECRETS["STATUS_PASSWORD"])
        assert client.ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, username="admin", password="").ping()  # off without ADMIN_PASSWORD
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, username="controller", password="controller-dev-password").ping()
        assert redis.Redis(port=port, username="controller", password=SECRETS["CONTROLLER_PASSWORD"]).ping()
    finally:
        proc.terminate()
        proc.wait(10)


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
    folders = {"rollout_bus"} | {p.name for p in (ROOT / "rollout_bus").iterdir() if p.is_symlink()}
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


@pytest.mark.parametrize("name", ["init-model", "controller", "executor", "trainer", "bus-metrics", "gateway"])
def test_every_command_compose_runs_exists_and_knows_its_flags(name: str) -> None:
    args = entrypoint(command(compose()["services"][name]))
    assert args[1] == "-m", f"{name}: compose runs an installed module, not a file ({args[1]})"
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "ROLLOUT_BUS_NAMESPACE")}
    done = subprocess.run([*args, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    help_text = done.stdout
    for flag in (a.split("=", 1)[0] for a in args[2:] if a.startswith("--")):
        assert re.search(rf"(^|[\s\[,]){re.escape(flag)}\b", help_text), f"{name}: {flag} unknown to {args[1]}"


PLACEMENT = {"ENGINE_CPUS": "0-7", "TRAINER_CPUS": "8-15", "ENGINE_THREADS": "4", "TRAINER_THREADS": "8"}


def disaggregated(env: dict[str, str]) -> dict[str, Any]:
    return resolved(yaml.safe_load((ROOT / "deploy" / "compose.disaggregated.yaml").read_text()), env)


def test_the_disaggregated_override_pins_each_side_and_adds_only_the_thread_flags_to_the_commands() -> None:
    env = {**SECRETS, **PLACEMENT}
    base, override = compose(env)["services"], disaggregated(env)["services"]
    assert set(override) <= set(base)
    engines_side = {"redis", "controller", "executor"}
    assert {n for n, s in override.items() if s.get("cpuset") == "0-7"} == engines_side
    assert override["trainer"]["cpuset"] == "8-15"
    # the commands are compose.yaml's, each with its side's torch threads: nothing else may drift
    assert command(override["controller"]) == [*command(base["controller"]), "--engine-arg=--torch-threads",
                                               "--engine-arg=4"]
    assert command(override["trainer"]) == [*command(base["trainer"]), "--torch-threads", "8"]
    for name in ("controller", "trainer"):
        args = entrypoint(command(override[name]))
        done = subprocess.run([*args, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                              env={k: v for k, v in os.environ.items() if k not in ("REDIS_URL",)})
        assert done.returncode == 0, done.stderr
        assert ("--engine-arg" if name == "controller" else "--torch-threads") in done.stdout, name
    for missing in PLACEMENT:  # each setting is required: no side silently left on every CPU
        with pytest.raises(MissingVariable, match=missing):
            disaggregated({**SECRETS, **{k: v for k, v in PLACEMENT.items() if k != missing}})
