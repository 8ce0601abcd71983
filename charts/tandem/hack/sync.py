"""Regenerate the chart's derived files from their sources; `--check` only reports drift.

    python charts/tandem/hack/sync.py          # rewrite
    python charts/tandem/hack/sync.py --check  # exit 1 if anything would change

Derived files:
- files/hybridmodels.tandem.dev.yaml: a byte-for-byte copy of crds/ (the operator's CRD),
  rendered by templates/crd.yaml so the CRD upgrades with the chart.
- values.schema.json "definitions": `hybridModelSpec`, the CRD's spec schema converted to
  JSON Schema, and the Kubernetes types the values pass through (affinity, tolerations, ...)
  from kubernetes-validate's strict schemas. The rest of values.schema.json is hand-written.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from crd_schema import crd_version_schema, to_json_schema  # noqa: E402

CHART = Path(__file__).resolve().parents[1]
CRD_SOURCE = CHART / "crds" / "hybridmodels.tandem.dev.yaml"
CRD_COPY = CHART / "files" / "hybridmodels.tandem.dev.yaml"
VALUES_SCHEMA = CHART / "values.schema.json"
CRD_VERSION = "v1alpha1"

# The newest Kubernetes whose schemas kubernetes-validate ships: accept the fields a current
# cluster accepts. tests/chart renders with them and validates against 1.28 as well.
K8S_SCHEMA_VERSION = "1.37.0"
K8S_TYPES = (
    "io.k8s.api.core.v1.Affinity",
    "io.k8s.api.core.v1.NodeAffinity",
    "io.k8s.api.core.v1.Volume",
    "io.k8s.api.core.v1.Toleration",
    "io.k8s.api.core.v1.ResourceRequirements",
    "io.k8s.api.core.v1.EnvVar",
    "io.k8s.api.core.v1.LocalObjectReference",
    "io.k8s.api.core.v1.PodSecurityContext",
    "io.k8s.api.core.v1.SecurityContext",
)
_REF = re.compile(r"^#/\$defs/(.+)$")
# A volume without its name: what HybridModel.spec.model.volume holds.
VOLUME_SOURCE = "io.k8s.api.core.v1.VolumeSource"
FIELDS_V1 = "io.k8s.apimachinery.pkg.apis.meta.v1.FieldsV1"
# Fields the CRD leaves open (x-kubernetes-preserve-unknown-fields) that are Kubernetes types:
# the values schema checks them as those types, so a typo fails `helm install`, not the pod.
SPEC_K8S_FIELDS = {
    ("model", "volume"): VOLUME_SOURCE,
    ("placement", "nodeAffinity"): "io.k8s.api.core.v1.NodeAffinity",
    ("placement", "tolerations", "items"): "io.k8s.api.core.v1.Toleration",
}


def hybrid_model_spec_schema() -> dict[str, Any]:
    """The CRD's `spec` schema as draft-7 JSON Schema."""
    crd = yaml.safe_load(CRD_SOURCE.read_text())
    schema = to_json_schema(crd_version_schema(crd, CRD_VERSION))
    return schema["properties"]["spec"]


def with_kubernetes_types(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec schema with SPEC_K8S_FIELDS checked as their Kubernetes types."""
    for path, definition in SPEC_K8S_FIELDS.items():
        parent = spec
        for name in path[:-1]:
            parent = parent["properties"][name] if name != "items" else parent["items"]
        key = path[-1]
        if key == "items":
            original = parent["items"]
        else:
            parent, key = parent["properties"], key
            original = parent[key]
        # Draft 7 ignores keywords next to $ref, so the CRD's own bounds go beside it in allOf.
        kept = {k: v for k, v in original.items() if k not in ("type", "description")}
        parent[key] = {"description": original.get("description", ""),
                       "allOf": [{"$ref": f"#/definitions/{definition}"}, kept]}
    return spec


def kubernetes_definitions() -> dict[str, Any]:
    """K8S_TYPES and every definition they reference, descriptions dropped, refs rewritten."""
    root = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    path = root / f"v{K8S_SCHEMA_VERSION}-local-strict" / "_definitions.json"
    source = json.loads(path.read_text())["$defs"]
    wanted, found = list(K8S_TYPES), {}
    while wanted:
        name = wanted.pop()
        if name not in found:
            found[name] = _rewrite(source[name], wanted)
    # managedFields (in an ephemeral volume's claim template) are written by the API server,
    # never by users: the one free-form Kubernetes type here is closed rather than left open.
    found[FIELDS_V1] = {"type": "object", "additionalProperties": False, "maxProperties": 0}
    volume = found["io.k8s.api.core.v1.Volume"]
    found[VOLUME_SOURCE] = {
        **volume,
        "properties": {k: v for k, v in volume["properties"].items() if k != "name"},
        "required": [k for k in volume.get("required", []) if k != "name"],
    }
    return dict(sorted(found.items()))


def _rewrite(node: Any, refs: list[str]) -> Any:
    if isinstance(node, list):
        return [_rewrite(item, refs) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "description" or key.startswith("x-kubernetes-"):
            continue
        if key == "$ref":
            name = _REF.match(value).group(1)
            refs.append(name)
            value = f"#/definitions/{name}"
        elif key != "properties" or not isinstance(value, dict):
            value = _rewrite(value, refs)
        else:
            value = {prop: _rewrite(sub, refs) for prop, sub in value.items()}
        out[key] = value
    return out


def expected_values_schema() -> str:
    """values.schema.json as it should be: the hand-written part with fresh definitions."""
    schema = json.loads(VALUES_SCHEMA.read_text())
    spec = with_kubernetes_types(hybrid_model_spec_schema())
    schema["definitions"] = {"hybridModelSpec": spec, **kubernetes_definitions()}
    return json.dumps(schema, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report drift, change nothing")
    args = parser.parse_args(argv)
    targets = {CRD_COPY: CRD_SOURCE.read_text(), VALUES_SCHEMA: expected_values_schema()}
    stale = [path for path, text in targets.items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(CHART)} is out of date: run {Path(__file__).name}", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(targets[path])
        print(f"wrote {path.relative_to(CHART)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
