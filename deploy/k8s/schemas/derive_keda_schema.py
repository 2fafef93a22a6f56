"""Writes keda-2.16.1.json: KEDA v2.16.1's ScaledObject and TriggerAuthentication CRD schemas as JSON Schema.

Not run by CI (the output is vendored). Run it in a scratch virtualenv, not the project's:

    python -m venv /tmp/keda-schema && /tmp/keda-schema/bin/pip install cloudcoil cloudcoil-models-keda==2.16.1.0
    /tmp/keda-schema/bin/python deploy/k8s/schemas/derive_keda_schema.py

cloudcoil-models-keda ships pydantic models that cloudcoil generates from KEDA's CRD OpenAPI schemas (its
version is KEDA's, plus a build number). Each model's JSON schema (by alias, validation mode) is KEDA's
CRD schema with camelCase field names; ``additionalProperties: false`` is added to every object that lists
its properties, since the API server's strict field validation (kubectl's default) refuses unknown fields.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

from cloudcoil.models.keda import v1alpha1  # type: ignore[import-not-found]


def strict(node: Any) -> None:
    if isinstance(node, dict):
        if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for value in node.values():
            strict(value)
    elif isinstance(node, list):
        for value in node:
            strict(value)


def main() -> None:
    kinds = {}
    for name in ("ScaledObject", "TriggerAuthentication"):
        schema = getattr(v1alpha1, name).model_json_schema(by_alias=True, mode="validation")
        strict(schema)
        kinds[name] = schema
    package = version("cloudcoil-models-keda")
    doc = {
        "$comment": ("KEDA v2.16.1 CRD schemas (keda.sh/v1alpha1 ScaledObject and TriggerAuthentication) as JSON "
                     "Schema. Derived, not hand-written: cloudcoil-models-keda " + package + " (PyPI) ships pydantic "
                     "models generated from KEDA v2.16.1's CRD OpenAPI schemas; this file is "
                     "Model.model_json_schema(by_alias=True, mode='validation') of each, with additionalProperties: "
                     "false added to every object that lists its properties (the API server's strict field "
                     "validation, kubectl's default, refuses unknown fields). Regenerate: "
                     "deploy/k8s/schemas/derive_keda_schema.py."),
        "keda_version": "2.16.1",
        "source_package": f"cloudcoil-models-keda=={package}",
        "cloudcoil_version": version("cloudcoil"),
        "kinds": kinds,
    }
    out = Path(__file__).with_name("keda-2.16.1.json")
    out.write_text(json.dumps(doc, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
