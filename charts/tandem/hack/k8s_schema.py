"""Kubernetes types as CRD structural schemas, inlined from kubernetes-validate's JSON schemas.

A HybridModel field that holds a Kubernetes type (the model's volume source, the node affinity,
the tolerations) carries that type's schema. Left open (x-kubernetes-preserve-unknown-fields), a
misspelled field passes `kubectl apply`, the operator copies it into the pod template, and the
API server drops it there without a word: the user's placement is ignored. Typed, the API server
rejects the unknown field (kubectl's strict field validation) or at least prunes it from the
HybridModel itself, so the spec the user reads back is the one that runs.

kubernetes-validate's schemas are JSON Schema; a CRD needs a structural OpenAPI schema, so:
- `$ref`s are inlined (a CRD allows none) and descriptions dropped, to keep the CRD small
  (`kubectl explain pod.spec.affinity.nodeAffinity` has them);
- `type: [T, "null"]` becomes `type: T`: the API server prunes a null in a non-nullable field
  of a custom resource, which leaves the field unset, what null means in a pod;
- Quantity and IntOrString (oneOf string or number) become `x-kubernetes-int-or-string`, the
  one typed junctor a structural schema allows;
- strategic-merge-patch hints are dropped (custom resources do not take that patch); the list
  and map types for server-side apply are kept;
- ENUMS closes string fields whose Kubernetes description lists every value the API server
  accepts, and METADATA_FIELDS trims an embedded ObjectMeta to the fields its description
  allows. Both are checked against the descriptions, so a Kubernetes that changes them fails
  generation rather than being silently contradicted.

    python charts/tandem/hack/k8s_schema.py io.k8s.api.core.v1.Toleration  # print one as YAML
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import sys
from functools import cache
from typing import Any

import yaml

# The newest Kubernetes whose schemas kubernetes-validate (pinned in pyproject.toml) ships: the
# CRD accepts the fields a current cluster accepts.
K8S_SCHEMA_VERSION = "1.37.0"
VOLUME = "io.k8s.api.core.v1.Volume"
# A Volume without its name: what HybridModel.spec.model.volume holds (the OpenAPI of
# Kubernetes inlines VolumeSource into Volume and has no definition of its own for it).
VOLUME_SOURCE = "io.k8s.api.core.v1.VolumeSource"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
INT_OR_STRING = ({"type": "integer"}, {"type": "string"})
# "" is listed where Kubernetes accepts an empty value: for a toleration it means all effects,
# or the default operator, Equal.
ENUMS: dict[str, dict[str, list[str]]] = {
    "io.k8s.api.core.v1.Toleration": {
        # Lt and Gt need the TaintTolerationComparisonOperators feature gate; where it is off the
        # API server rejects the pod, which the Deployment's ReplicaSet reports.
        "operator": ["", "Equal", "Exists", "Lt", "Gt"],
        "effect": ["", "NoSchedule", "PreferNoSchedule", "NoExecute"],
    },
    "io.k8s.api.core.v1.NodeSelectorRequirement": {
        "operator": ["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"],
    },
}
# Embedded ObjectMeta: the fields its description allows ("May contain labels and annotations
# ... No other fields are allowed"); the rest is the API server's to write.
METADATA_FIELDS: dict[str, dict[str, tuple[str, ...]]] = {
    "io.k8s.api.core.v1.PersistentVolumeClaimTemplate": {"metadata": ("labels", "annotations")},
}
_DROPPED = ("description", "x-kubernetes-patch-strategy", "x-kubernetes-patch-merge-key")
_KEY_ORDER = ("type", "format", "enum", "required", "minProperties", "maxProperties")


@cache
def definitions(version: str = K8S_SCHEMA_VERSION) -> dict[str, Any]:
    """kubernetes-validate's (non-strict) definitions for one Kubernetes version, plus VolumeSource."""
    root = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    source = json.loads((root / f"v{version}-local" / "_definitions.json").read_text())["$defs"]
    volume = {key: value for key, value in source[VOLUME].items() if key != "required"}
    volume["properties"] = {k: v for k, v in volume["properties"].items() if k != "name"}
    if source[VOLUME].get("required", ["name"]) != ["name"]:
        raise ValueError(f"{VOLUME} requires more than its name: {source[VOLUME]['required']}")
    source[VOLUME_SOURCE] = volume
    return source


def structural_schema(name: str, version: str = K8S_SCHEMA_VERSION) -> dict[str, Any]:
    """The Kubernetes type `name` as a structural schema for a CRD (see the module doc).

    Raises:
        KeyError: if Kubernetes `version` has no such type.
        ValueError: if an enum or metadata trim no longer matches Kubernetes' descriptions,
            or the type holds something a structural schema cannot say.
    """
    defs = definitions(version)
    return _inline(defs[name], name, defs, (name,))


def _inline(node: dict[str, Any], name: str | None, defs: dict[str, Any],
            seen: tuple[str, ...]) -> dict[str, Any]:
    # `name` is the definition this node is (None for a node inside one).
    if "$ref" in node:
        target = node["$ref"].removeprefix("#/$defs/")
        if target in seen:
            raise ValueError(f"{' -> '.join(seen + (target,))} is recursive: a CRD cannot inline it")
        return _inline(defs[target], target, defs, seen + (target,))
    if "oneOf" in node:
        return _int_or_string(node, seen)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key == "type":
            value = _single_type(value, seen)
        elif key == "properties":
            value = {prop: _property(name, prop, sub, defs, seen) for prop, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            value = _inline(value, None, defs, seen)
        out[key] = value
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        # The API server would prune every field of it, silently.
        raise ValueError(f"{' -> '.join(seen)}: an object without fields")
    return _ordered(out)


def _property(owner: str | None, prop: str, node: dict[str, Any], defs: dict[str, Any],
              seen: tuple[str, ...]) -> dict[str, Any]:
    description = node.get("description", "")
    keep = METADATA_FIELDS.get(owner, {}).get(prop)
    if keep is not None:
        node = _trimmed_metadata(node, keep, description, defs, f"{owner}.{prop}")
    out = _inline(node, None, defs, seen)
    enum = ENUMS.get(owner, {}).get(prop)
    if enum is not None:
        missing = [value for value in enum if value and value not in description]
        if out.get("type") != "string" or missing:
            raise ValueError(f"{owner}.{prop}: Kubernetes no longer documents {missing or enum}: {description!r}")
        out = _ordered({**out, "enum": enum})
    return out


def _trimmed_metadata(node: dict[str, Any], keep: tuple[str, ...], description: str,
                      defs: dict[str, Any], where: str) -> dict[str, Any]:
    if node.get("$ref") != f"#/$defs/{OBJECT_META}" or not all(name in description for name in keep):
        raise ValueError(f"{where}: not an ObjectMeta limited to {keep} any more: {description!r}")
    meta = defs[OBJECT_META]
    return {**meta, "properties": {name: meta["properties"][name] for name in keep}}


def _single_type(value: str | list[str], seen: tuple[str, ...]) -> str:
    types = [value] if isinstance(value, str) else [t for t in value if t != "null"]
    if len(types) != 1:
        raise ValueError(f"{' -> '.join(seen)}: type {value} is not one type")
    return types[0]


def _int_or_string(node: dict[str, Any], seen: tuple[str, ...]) -> dict[str, Any]:
    types = sorted(_single_type(option.get("type"), seen) for option in node["oneOf"])
    if types not in (["integer", "string"], ["number", "string"]):
        raise ValueError(f"{' -> '.join(seen)}: oneOf {types} is not an int-or-string")
    # A Quantity may be a JSON number; a CRD takes integers and strings ("1.5" as a string).
    return {"anyOf": [dict(t) for t in INT_OR_STRING], "x-kubernetes-int-or-string": True}


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    first = [key for key in _KEY_ORDER if key in node]
    return {key: node[key] for key in first + sorted(k for k in node if k not in first)}


class _Dumper(yaml.SafeDumper):
    """Block style, but a mapping or list of scalars on one line, as the CRD is written."""

    def ignore_aliases(self, data):
        return True


def _leaf(value: Any) -> bool:
    # A scalar, or a list of scalars.
    if isinstance(value, list):
        return all(not isinstance(item, (dict, list)) for item in value)
    return not isinstance(value, dict)


def _represent_dict(dumper: yaml.SafeDumper, data: dict) -> yaml.Node:
    return dumper.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=all(map(_leaf, data.values())))


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=_leaf(data))


_Dumper.add_representer(dict, _represent_dict)
_Dumper.add_representer(list, _represent_list)


def dump(schema: dict[str, Any]) -> str:
    """The schema as the CRD's YAML writes one: block style, leaves on one line, keys in order."""
    return yaml.dump(copy.deepcopy(schema), Dumper=_Dumper, sort_keys=False, width=1000)


if __name__ == "__main__":
    for type_name in sys.argv[1:] or ["io.k8s.api.core.v1.Toleration"]:
        print(f"# {type_name} (Kubernetes {K8S_SCHEMA_VERSION})\n{dump(structural_schema(type_name))}")
