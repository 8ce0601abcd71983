"""Regenerate the chart's derived files from their sources; `--check` only reports drift.

    python charts/tandem/hack/sync.py          # rewrite
    python charts/tandem/hack/sync.py --check  # exit 1 if anything would change

Derived files and parts:
- In crds/hybridmodels.tandem.dev.yaml, each block between `# generated from TYPE` and
  `# end of generated TYPE`: the Kubernetes type as a structural schema (k8s_schema.py), from
  the kubernetes-validate pinned in pyproject.toml. The rest of the CRD is hand-written.
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
import textwrap
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from crd_schema import crd_version_schema, to_json_schema  # noqa: E402
from k8s_schema import K8S_SCHEMA_VERSION, dump, structural_schema  # noqa: E402

CHART = Path(__file__).resolve().parents[1]
CRD_SOURCE = CHART / "crds" / "hybridmodels.tandem.dev.yaml"
CRD_COPY = CHART / "files" / "hybridmodels.tandem.dev.yaml"
VALUES_SCHEMA = CHART / "values.schema.json"
CRD_VERSION = "v1alpha1"

# The values' own Kubernetes types (operator.affinity, operator.env, ...); the HybridModel spec's
# come inlined in the CRD.
K8S_TYPES = (
    "io.k8s.api.core.v1.Affinity",
    "io.k8s.api.core.v1.Toleration",
    "io.k8s.api.core.v1.ResourceRequirements",
    "io.k8s.api.core.v1.EnvVar",
    "io.k8s.api.core.v1.LocalObjectReference",
    "io.k8s.api.core.v1.PodSecurityContext",
    "io.k8s.api.core.v1.SecurityContext",
)
_REF = re.compile(r"^#/\$defs/(.+)$")
# A generated block: its first marker line's indent is the indent of what lies between.
GENERATED = re.compile(r"^(?P<indent> *)(?P<begin># generated from (?P<type>[\w.]+) by .*\n)"
                       r"(?P<body>(?:.*\n)*?)(?P=indent)(?P<end># end of generated (?P=type)\n)", re.M)


def crd_with_kubernetes_types(text: str) -> str:
    """The CRD's YAML with every generated block filled from kubernetes-validate's schemas."""
    def fill(match: re.Match) -> str:
        indent = match["indent"]
        body = textwrap.indent(dump(structural_schema(match["type"])), indent)
        return f"{indent}{match['begin']}{body}{indent}{match['end']}"
    return GENERATED.sub(fill, text)


def generated_types(text: str) -> list[str]:
    """The Kubernetes types the CRD's generated blocks hold, in order."""
    return [match["type"] for match in GENERATED.finditer(text)]


def hybrid_model_spec_schema(crd_text: str) -> dict[str, Any]:
    """The CRD's `spec` schema as draft-7 JSON Schema."""
    schema = to_json_schema(crd_version_schema(yaml.safe_load(crd_text), CRD_VERSION))
    return schema["properties"]["spec"]


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


def expected_values_schema(crd_text: str) -> str:
    """values.schema.json as it should be: the hand-written part with fresh definitions."""
    schema = json.loads(VALUES_SCHEMA.read_text())
    schema["definitions"] = {"hybridModelSpec": hybrid_model_spec_schema(crd_text), **kubernetes_definitions()}
    return json.dumps(schema, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report drift, change nothing")
    args = parser.parse_args(argv)
    crd = crd_with_kubernetes_types(CRD_SOURCE.read_text())
    targets = {CRD_SOURCE: crd, CRD_COPY: crd, VALUES_SCHEMA: expected_values_schema(crd)}
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
