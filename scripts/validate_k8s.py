"""Validate deploy/k8s/ offline: every manifest against the Kubernetes schemas, the KEDA objects against KEDA's.

    python scripts/validate_k8s.py [DIR]      # exit 1, naming each problem, when anything is wrong

- Kubernetes objects: ``kubernetes-validate`` (its schemas are vendored in the package; no network), strict
  (unknown fields are errors, as the API server's strict field validation makes them), for ``K8S_VERSION``.
- KEDA objects (``keda.sh/*``): ``jsonschema`` against ``deploy/k8s/schemas/keda-<version>.json``, KEDA's CRD
  schemas vendored with their version (that file's ``$comment`` says where they come from).
- ``kustomization.yaml`` lists every manifest of the folder (the example Secrets excepted).
- The bus's names the KEDA triggers hard-code (the rq queue keys, the batch stream, the trainer's group) are the
  ones ``events.names.Keys`` gives for the namespace of ``config.yaml`` and the trainer of ``trainer.yaml``.

``redis/values.yaml`` is a Helm values file, not a manifest (its ACL users are checked by the tests).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S_DIR = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.33.0"
KEDA_SCHEMA = "schemas/keda-2.16.1.json"
NOT_APPLIED = {"secrets.example.yaml"}
"""Manifests kustomization.yaml must not list (examples to fill in, never to apply as they are)."""


def manifests(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.yaml") if p.name != "kustomization.yaml")


def load(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for d in docs:
        if not isinstance(d, dict):
            raise ValueError(f"{path.name}: a document is a {type(d).__name__}, not a mapping")
    return docs


def _where(doc: dict[str, Any]) -> str:
    return f"{doc.get('kind', '?')}/{(doc.get('metadata') or {}).get('name', '?')}"


def object_problems(doc: dict[str, Any], keda: dict[str, Any]) -> list[str]:
    """What is wrong with one object (empty: nothing)."""
    api = str(doc.get("apiVersion", ""))
    if api.startswith("keda.sh/"):
        schema = keda["kinds"].get(str(doc.get("kind")))
        if schema is None:
            return [f"{_where(doc)}: no vendored KEDA schema for kind {doc.get('kind')!r} "
                    f"(have {', '.join(sorted(keda['kinds']))})"]
        if api != "keda.sh/v1alpha1":
            return [f"{_where(doc)}: apiVersion {api!r}, KEDA {keda['keda_version']} serves keda.sh/v1alpha1"]
        errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
        return [f"{_where(doc)}: {'.'.join(str(p) for p in e.path) or '(top)'}: {e.message}" for e in errors]
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{_where(doc)}: {'.'.join(str(p) for p in e.path) or '(top)'}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError:
        return [f"{_where(doc)}: no Kubernetes {K8S_VERSION} schema for {api} {doc.get('kind')}"]
    return []


def kustomization_problems(folder: Path) -> list[str]:
    path = folder / "kustomization.yaml"
    if not path.is_file():
        return ["kustomization.yaml is missing"]
    listed = (yaml.safe_load(path.read_text()) or {}).get("resources") or []
    wanted = [p.name for p in manifests(folder) if p.name not in NOT_APPLIED]
    problems = [f"kustomization.yaml does not list {n}" for n in wanted if n not in listed]
    problems += [f"kustomization.yaml lists {n}, which is not a manifest here" for n in listed if n not in wanted]
    return problems


def _find(docs: Iterable[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for d in docs:
        if d.get("kind") == kind and (d.get("metadata") or {}).get("name") == name:
            return d
    raise KeyError(f"{kind}/{name}")


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def names_problems(docs: list[dict[str, Any]]) -> list[str]:
    """The keys KEDA reads are the ones the bus writes (a renamed queue must not leave KEDA watching nothing)."""
    from rollout_bus.events.names import Keys

    try:
        namespace = _find(docs, "ConfigMap", "rollout-bus-config")["data"]["ROLLOUT_BUS_NAMESPACE"]
        trainer = _find(docs, "Job", "rollout-bus-trainer-default")["spec"]["template"]["spec"]["containers"][0]
        policy, group = _flag(trainer["command"], "--policy"), _flag(trainer["command"], "--trainer-id")
        triggers = {t.get("name"): t for t in _find(docs, "ScaledObject", "rollout-bus-executor")["spec"]["triggers"]}
    except (KeyError, ValueError, IndexError, TypeError) as exc:
        return [f"cannot find what the KEDA triggers must match: {exc}"]
    keys = Keys(namespace)
    want = {("rollouts", "listName"): f"rq:queue:{keys.rollout_queue}", ("eval", "listName"): f"rq:queue:{keys.eval_queue}",
            ("batches", "stream"): keys.batch_stream(policy), ("batches", "consumerGroup"): group}
    problems = []
    for (trigger, field), value in want.items():
        got = ((triggers.get(trigger) or {}).get("metadata") or {}).get(field)
        if got != value:
            problems.append(f"ScaledObject trigger {trigger!r} {field} is {got!r}; the bus uses {value!r}")
    return problems


def problems(folder: Path = K8S_DIR) -> list[str]:
    keda = json.loads((folder / KEDA_SCHEMA).read_text())
    out: list[str] = []
    docs: list[dict[str, Any]] = []
    for path in manifests(folder):
        try:
            found = load(path)
        except (yaml.YAMLError, ValueError) as exc:
            out.append(f"{path.name}: {exc}")
            continue
        if not found:
            out.append(f"{path.name}: no object")
        for doc in found:
            out += [f"{path.name}: {p}" for p in object_problems(doc, keda)]
        docs += found
    return out + kustomization_problems(folder) + names_problems(docs)


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else K8S_DIR
    found = problems(folder)
    for p in found:
        print(p, file=sys.stderr)
    n = len(manifests(folder))
    print(f"{folder}: {n} manifests, {len(found)} problem(s) (Kubernetes {K8S_VERSION}, "
          f"KEDA {json.loads((folder / KEDA_SCHEMA).read_text())['keda_version']})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
