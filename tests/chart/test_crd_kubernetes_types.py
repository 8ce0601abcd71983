"""The HybridModel fields that hold Kubernetes types (model.volume, placement.nodeAffinity,
placement.tolerations) carry Kubernetes' own schemas, generated from kubernetes-validate: a typo
fails at `kubectl apply` instead of vanishing from the pods' template."""

from __future__ import annotations

import copy
import importlib.metadata
import re
import tomllib

import helm_python
import jsonschema
import pytest
import yaml
from kubernetes_validate import utils as kv

from conftest import CRD_SOURCE, REPO, load_example, load_hack

crd_schema = load_hack("crd_schema")
k8s_schema = load_hack("k8s_schema")
sync = load_hack("sync")

CRD_TEXT = CRD_SOURCE.read_text()
OPENAPI = crd_schema.crd_version_schema(yaml.safe_load(CRD_TEXT), "v1alpha1")
# The API server prunes what the schema does not declare and kubectl's strict field validation
# turns that into an error: the converted schema rejects unknown fields the same way.
VALIDATOR = jsonschema.Draft7Validator(crd_schema.to_json_schema(OPENAPI))
SPEC = OPENAPI["properties"]["spec"]["properties"]
EMBEDDED = {
    "io.k8s.api.core.v1.VolumeSource": SPEC["model"]["properties"]["volume"],
    "io.k8s.api.core.v1.NodeAffinity": SPEC["placement"]["properties"]["nodeAffinity"],
    "io.k8s.api.core.v1.Toleration": SPEC["placement"]["properties"]["tolerations"]["items"],
}
# The CRD's own keys beside a generated block.
HAND_WRITTEN = ("description", "minProperties", "maxProperties")

# From the Kubernetes docs: "Assigning Pods to Nodes" (node affinity) and "Taints and
# Tolerations".
DOCS_NODE_AFFINITY = {
    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["antarctica-east1", "antarctica-west1"]},
    ]}]},
    "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": {"matchExpressions": [
        {"key": "another-node-label-key", "operator": "In", "values": ["another-node-label-value"]},
    ]}}],
}
DOCS_TOLERATIONS = [
    {"key": "key1", "operator": "Equal", "value": "value1", "effect": "NoSchedule"},
    {"key": "key1", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "key1", "operator": "Equal", "value": "value1", "effect": "NoExecute", "tolerationSeconds": 3600},
    {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 6000},
    {"key": "example-key", "operator": "Exists", "effect": "PreferNoSchedule"},
    {"operator": "Exists"},
]
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
TERMS = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}
# placement override -> (where the error is, what it names)
TYPOS = {
    "affinity field": ({"nodeAffinity": {REQUIRED + "s": TERMS}}, "spec.placement.nodeAffinity",
                       REQUIRED + "s"),
    "toleration field": ({"tolerations": [{"key": "gpu", "operater": "Exists"}]}, "spec.placement.tolerations.0",
                         "operater"),
    "toleration effect": ({"tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedul"}]},
                          "spec.placement.tolerations.0.effect", "NoSchedul"),
}
WRONG = {
    "toleration operator": ({"tolerations": [{"key": "gpu", "operator": "exists"}]},
                            "spec.placement.tolerations.0.operator"),
    "toleration seconds as a string": ({"tolerations": [{"operator": "Exists", "tolerationSeconds": "60"}]},
                                       "spec.placement.tolerations.0.tolerationSeconds"),
    "selector operator": ({"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "gpu", "operator": "in", "values": ["a"]}]}]}}},
        f"spec.placement.nodeAffinity.{REQUIRED}.nodeSelectorTerms.0.matchExpressions.0.operator"),
    "no node selector terms": ({"nodeAffinity": {REQUIRED: {}}}, f"spec.placement.nodeAffinity.{REQUIRED}"),
    "term misspelled": ({"nodeAffinity": {REQUIRED: {"nodeSelectorTerm": []}}},
                        f"spec.placement.nodeAffinity.{REQUIRED}"),
    "weight as a string": ({"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": "1", "preference": {}}]}}, "spec.placement.nodeAffinity.preferred"),
    "affinity as a list": ({"nodeAffinity": [TERMS]}, "spec.placement.nodeAffinity"),
}


def with_placement(placement: dict) -> dict:
    model = copy.deepcopy(load_example("mixtral-8x7b.yaml"))
    model["spec"]["placement"] = placement
    return model


def schema_errors(model: dict) -> list[str]:
    """Each error as `path: message`, as `kubectl apply` would name the field."""
    return [".".join(map(str, error.absolute_path)) + ": " + error.message for error in VALIDATOR.iter_errors(model)]


# drift

def test_each_kubernetes_field_is_generated_and_equals_the_generator():
    assert sync.generated_types(CRD_TEXT) == sorted(EMBEDDED, key=CRD_TEXT.index)
    for name, field in EMBEDDED.items():
        generated = {key: value for key, value in field.items() if key not in HAND_WRITTEN}
        assert generated == k8s_schema.structural_schema(name), f"{name}: run charts/tandem/hack/sync.py"


def test_generator_reads_the_pinned_kubernetes_validate():
    # The newest Kubernetes the version pinned in pyproject.toml ships, and that one installed.
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    (pin,) = [d for d in dependencies if d.startswith("kubernetes-validate")]
    assert pin == f"kubernetes-validate=={importlib.metadata.version('kubernetes-validate')}"
    assert k8s_schema.K8S_SCHEMA_VERSION == kv.latest_version()


def test_sync_notices_and_repairs_a_hand_edited_block(tmp_path, monkeypatch):
    edited = CRD_TEXT.replace("enum: ['', NoSchedule, PreferNoSchedule, NoExecute]", "enum: ['', NoSchedule]", 1)
    assert edited != CRD_TEXT
    source, copied = tmp_path / "crd.yaml", tmp_path / "copy.yaml"
    source.write_text(edited)
    copied.write_text(edited)
    monkeypatch.setattr(sync, "CRD_SOURCE", source)
    monkeypatch.setattr(sync, "CRD_COPY", copied)
    monkeypatch.setattr(sync, "CHART", tmp_path)
    monkeypatch.setattr(sync, "VALUES_SCHEMA", tmp_path / "values.schema.json")
    (tmp_path / "values.schema.json").write_text((CRD_SOURCE.parents[1] / "values.schema.json").read_text())
    assert sync.main(["--check"]) == 1
    assert sync.main([]) == 0
    assert source.read_text() == copied.read_text() == CRD_TEXT


# the schema itself

def test_the_crd_is_structural_and_leaves_nothing_open():
    assert crd_schema.structural_errors(OPENAPI) == []
    # An open field is what let typos through; none is left.
    assert "x-kubernetes-preserve-unknown-fields" not in CRD_TEXT
    assert "$ref" not in CRD_TEXT


@pytest.mark.parametrize("schema, error", [
    ({"type": "object", "x-kubernetes-preserve-unknown-fields": True}, None),
    ({"type": "object"}, "an object without fields"),
    ({"type": ["string", "null"]}, "not one type"),
    ({"$ref": "#/$defs/io.k8s.api.core.v1.Toleration"}, "$ref"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": {"type": "string"}},
     "properties and additionalProperties"),
    ({"type": "object", "additionalProperties": False}, "additionalProperties: false"),
    ({"type": "object", "properties": {"q": {"oneOf": [{"type": "string"}, {"type": "number"}]}}}, ".q: no type"),
    ({"type": "object", "properties": {"q": {"x-kubernetes-int-or-string": True,
                                             "anyOf": [{"type": "integer"}, {"type": "string"}]}}}, None),
])
def test_the_structural_check_can_fail(schema, error):
    root = {"type": "object", "properties": {"metadata": {"type": "object"}, "spec": schema}}
    errors = crd_schema.structural_errors(root)
    assert errors == [] if error is None else any(error in e for e in errors), errors


def test_generated_types_are_kubernetes_own_without_descriptions():
    toleration = k8s_schema.structural_schema("io.k8s.api.core.v1.Toleration")
    assert toleration == {"type": "object", "properties": {
        "effect": {"type": "string", "enum": ["", "NoSchedule", "PreferNoSchedule", "NoExecute"]},
        "key": {"type": "string"},
        "operator": {"type": "string", "enum": ["", "Equal", "Exists", "Lt", "Gt"]},
        "tolerationSeconds": {"type": "integer", "format": "int64"},
        "value": {"type": "string"},
    }}
    volume = k8s_schema.structural_schema("io.k8s.api.core.v1.VolumeSource")
    assert "name" not in volume["properties"]
    assert {"hostPath", "persistentVolumeClaim", "nfs"} <= set(volume["properties"])
    assert volume["properties"]["emptyDir"]["properties"]["sizeLimit"] == {
        "anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
    metadata = volume["properties"]["ephemeral"]["properties"]["volumeClaimTemplate"]["properties"]["metadata"]
    assert set(metadata["properties"]) == {"labels", "annotations"}
    assert "description" not in yaml.safe_dump(volume)


def test_an_enum_kubernetes_no_longer_documents_fails_generation(monkeypatch):
    monkeypatch.setitem(k8s_schema.ENUMS["io.k8s.api.core.v1.Toleration"], "effect", ["NoSchedule", "Sometimes"])
    with pytest.raises(ValueError, match="Sometimes"):
        k8s_schema.structural_schema("io.k8s.api.core.v1.Toleration")


def test_every_enum_value_is_in_kubernetes_description():
    defs = k8s_schema.definitions()
    for type_name, fields in k8s_schema.ENUMS.items():
        for field, values in fields.items():
            description = defs[type_name]["properties"][field]["description"]
            assert all(re.search(rf"\b{value}\b", description) for value in values if value), (type_name, field)


# what it accepts and rejects

def test_the_kubernetes_docs_examples_are_accepted_and_reach_the_pods():
    model = with_placement({"nodeAffinity": DOCS_NODE_AFFINITY, "tolerations": DOCS_TOLERATIONS})
    assert schema_errors(model) == []
    spec_module = pytest.importorskip("tandem_operator.spec")
    children = pytest.importorskip("tandem_operator.children")
    objects = children.build_children(spec_module.parse_spec(model["spec"]), "mixtral", "models")
    (deployment,) = [obj for obj in objects if obj["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["tolerations"] == DOCS_TOLERATIONS
    assert {k: v for k, v in pod["affinity"]["nodeAffinity"].items() if v is not None} == DOCS_NODE_AFFINITY
    kv.validate(deployment, kv.latest_version(), strict=True)


@pytest.mark.parametrize("name", TYPOS)
def test_a_typo_is_rejected_with_the_field_named(name):
    placement, path, named = TYPOS[name]
    errors = schema_errors(with_placement(placement))
    assert any(e.startswith(path + ":") and named in e for e in errors), errors


@pytest.mark.parametrize("name", WRONG)
def test_a_wrong_type_or_value_is_rejected_at_its_field(name):
    placement, path = WRONG[name]
    errors = schema_errors(with_placement(placement))
    assert any(e.startswith(path) for e in errors), errors


@pytest.mark.parametrize("name", [name for name in TYPOS if "field" in name])
def test_kubernetes_drops_the_same_typo_from_a_pod(name):
    # What the CRD now rejects is what Kubernetes itself does not know: strict validation of a
    # Deployment carrying the typo fails (the API server, not strict, drops it silently).
    placement, _, _ = TYPOS[name]
    spec_module = pytest.importorskip("tandem_operator.spec")
    deployment_module = pytest.importorskip("tandem_operator.deployment")
    spec = spec_module.parse_spec(with_placement(placement)["spec"])
    deployment = deployment_module.build_deployment(spec, "mixtral", "models")
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, kv.latest_version(), strict=True)


@pytest.mark.parametrize("name", TYPOS)
def test_helm_rejects_the_typo_in_the_charts_hybrid_model(chart, name):
    placement, _, named = TYPOS[name]
    spec = with_placement(placement)["spec"]
    with pytest.raises(helm_python.HelmValuesError, match=re.escape(named)):
        chart.validate_schema({"hybridModel": {"enabled": True, "spec": spec}})
    good = with_placement({"nodeAffinity": DOCS_NODE_AFFINITY, "tolerations": DOCS_TOLERATIONS})["spec"]
    chart.validate_schema({"hybridModel": {"enabled": True, "spec": good}})
