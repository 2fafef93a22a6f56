"""deploy/k8s/: every manifest validates offline against the Kubernetes and KEDA schemas, a broken one does not,
and the Redis chart's ACL users are the project's."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from rollout_bus.events.acl import chart_users

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"


def _validator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("validate_k8s", ROOT / "scripts" / "validate_k8s.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


V = _validator()
KEDA = json.loads((K8S / V.KEDA_SCHEMA).read_text())


def doc(name: str, kind: str) -> dict[str, Any]:
    return copy.deepcopy(next(d for d in V.load(K8S / name) if d["kind"] == kind))


def test_every_manifest_validates() -> None:
    assert V.problems() == []
    kinds = {d["kind"] for p in V.manifests(K8S) for d in V.load(p)}
    assert {"Deployment", "Service", "Job", "PersistentVolumeClaim", "ConfigMap", "Secret", "ScaledObject",
            "TriggerAuthentication"} <= kinds


def test_the_shared_weights_volume_is_read_write_many() -> None:
    claim = next(d for d in V.load(K8S / "storage.yaml") if d["metadata"]["name"] == "rollout-bus-weights")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_a_broken_deployment_is_refused() -> None:
    good = doc("executor.yaml", "Deployment")
    assert V.object_problems(good, KEDA) == []
    typo = copy.deepcopy(good)
    typo["spec"]["template"]["spec"]["containers"][0]["imagee"] = typo["spec"]["template"]["spec"]["containers"][0].pop("image")
    assert any("imagee" in p for p in V.object_problems(typo, KEDA))
    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "long"
    assert V.object_problems(wrong_type, KEDA)
    no_selector = copy.deepcopy(good)
    del no_selector["spec"]["selector"]
    assert any("selector" in p for p in V.object_problems(no_selector, KEDA))


def test_a_broken_scaled_object_is_refused() -> None:
    good = doc("executor-keda.yaml", "ScaledObject")
    assert V.object_problems(good, KEDA) == []
    unknown = copy.deepcopy(good)
    unknown["spec"]["minReplicas"] = unknown["spec"].pop("minReplicaCount")
    assert any("minReplicas" in p for p in V.object_problems(unknown, KEDA))
    no_type = copy.deepcopy(good)
    del no_type["spec"]["triggers"][0]["type"]
    assert any("triggers.0" in p and "'type'" in p for p in V.object_problems(no_type, KEDA))
    number = copy.deepcopy(good)
    number["spec"]["triggers"][0]["metadata"]["listLength"] = 1  # KEDA's trigger metadata is strings only
    assert any("listLength" in p for p in V.object_problems(number, KEDA))
    no_target = copy.deepcopy(good)
    del no_target["spec"]["scaleTargetRef"]
    assert any("scaleTargetRef" in p for p in V.object_problems(no_target, KEDA))
    other = copy.deepcopy(good)
    other["kind"] = "ScaledThing"
    assert any("no vendored KEDA schema" in p for p in V.object_problems(other, KEDA))


def test_a_broken_folder_fails_as_a_whole(tmp_path: Path) -> None:
    folder = tmp_path / "k8s"
    shutil.copytree(K8S, folder)
    assert V.problems(folder) == []
    assert V.main([str(folder)]) == 0
    keda = folder / "executor-keda.yaml"
    keda.write_text(keda.read_text().replace("rq:queue:rb.default.rollouts", "rq:queue:rollouts"))
    (folder / "extra.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {a: 1}\n")
    found = V.problems(folder)
    assert any("'rollouts' listName" in p and "rq:queue:rb.default.rollouts" in p for p in found)
    assert any(p.startswith("extra.yaml: ConfigMap/x") for p in found)  # data values must be strings
    assert "kustomization.yaml does not list extra.yaml" in found
    assert V.main([str(folder)]) == 1


def test_the_charts_acl_users_are_the_projects() -> None:
    values = yaml.safe_load((K8S / "redis" / "values.yaml").read_text())
    assert values["auth"]["acl"]["users"] == chart_users()
    assert values["auth"]["acl"]["userSecret"] == "rollout-bus-redis-users"
    assert values["sentinel"]["enabled"] is True
    for user in values["auth"]["acl"]["users"]:  # the chart turns an empty part into ~*, &* or +@all
        assert user["keys"].startswith("resetkeys") and user["channels"].startswith("resetchannels")
        assert user["commands"].startswith("-@all")
    secret = next(d for d in V.load(K8S / "secrets.example.yaml") if d["metadata"]["name"] == "rollout-bus-redis-users")
    assert {u["username"] for u in chart_users()} <= set(secret["stringData"])


def env_of(name: str) -> dict[str, Any]:
    (deployment,) = [d for d in V.load(K8S / name) if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e for e in container.get("env", [])}


def secret_ref(env: dict[str, Any], name: str) -> tuple[str, str]:
    ref = env[name]["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def test_the_engines_and_the_gateway_get_their_keys_from_secrets_and_no_client_holds_the_engines() -> None:
    engine_key = ("rollout-bus-engine", "api-key")
    for name in ("controller.yaml", "executor.yaml", "gateway.yaml"):  # the controller launches every engine with it
        assert secret_ref(env_of(name), "ROLLOUT_BUS_ENGINE_API_KEY") == engine_key, name
    gateway = env_of("gateway.yaml")
    assert secret_ref(gateway, "ROLLOUT_BUS_GATEWAY_API_KEYS") == ("rollout-bus-gateway", "api-keys")
    for name in ("controller.yaml", "executor.yaml"):
        assert "ROLLOUT_BUS_GATEWAY_API_KEYS" not in env_of(name)
    (deployment,) = [d for d in V.load(K8S / "gateway.yaml") if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert args[args.index("--host") + 1] == "0.0.0.0"  # a pod address: it starts only with client keys
    secrets = {d["metadata"]["name"]: d for d in V.load(K8S / "secrets.example.yaml")}
    assert set(secrets["rollout-bus-gateway"]["stringData"]) == {"api-keys"}
    assert set(secrets["rollout-bus-engine"]["stringData"]) == {"api-key"}


@pytest.mark.parametrize("name", [p.name for p in V.manifests(K8S)])
def test_each_role_uses_its_own_redis_user(name: str) -> None:
    for d in V.load(K8S / name):
        if d["kind"] not in ("Deployment", "Job"):
            continue
        for container in d["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in container.get("env", [])}
            if "REDIS_URL" not in env:
                continue
            user = env["REDIS_URL"]["value"].split("://", 1)[1].split(":", 1)[0]
            assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == user
