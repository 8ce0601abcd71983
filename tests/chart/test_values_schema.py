"""values.yaml is fully commented and values.schema.json rejects anything it does not know."""

from __future__ import annotations

import json
import re

import helm_python
import jsonschema
import pytest
import yaml

from conftest import CHART_DIR, NAMESPACE, NON_DEFAULT_VALUES, RELEASE, load_example, one, render_objects

SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())
VALUES_TEXT = (CHART_DIR / "values.yaml").read_text()


def object_schemas(node, path="#"):
    """Every (path, schema) in the tree that describes a JSON object."""
    if isinstance(node, dict):
        types = node.get("type")
        if types == "object" or (isinstance(types, list) and "object" in types):
            yield path, node
        for key, value in node.items():
            if key not in ("enum", "const", "default", "required"):
                yield from object_schemas(value, f"{path}/{key}")
    elif isinstance(node, list):
        for index, item in enumerate(node):
            yield from object_schemas(item, f"{path}/{index}")


def test_every_object_schema_closes_its_properties():
    objects = list(object_schemas(SCHEMA))
    assert len(objects) > 20
    # False (a record) or a schema (a map such as labels); never absent, never true.
    open_ones = [path for path, node in objects
                 if node.get("additionalProperties", True) is True]
    assert open_ones == []


def test_schema_is_valid_draft7_and_accepts_the_defaults():
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    defaults = yaml.safe_load(VALUES_TEXT)
    jsonschema.Draft7Validator(SCHEMA).validate(defaults)


@pytest.mark.parametrize("values", NON_DEFAULT_VALUES.values(), ids=list(NON_DEFAULT_VALUES))
def test_schema_accepts_the_non_default_values(chart, values):
    chart.validate_schema(values)


@pytest.mark.parametrize("values", [
    {"replicaCount": 2},
    {"crds": {"install": True}},
    {"operator": {"image": {"repo": "x"}}},
    {"operator": {"resources": {"limit": {"cpu": "1"}}}},
    {"operator": {"securityContext": {"runAsNonroot": True}}},
    {"operator": {"tolerations": [{"key": "a", "opertor": "Exists"}]}},
    {"operator": {"affinity": {"nodeAfinity": {}}}},
    {"operator": {"env": [{"name": "A", "valeu": "b"}]}},
    {"serviceAccount": {"annotation": {}}},
    {"serviceMonitor": {"enabled": True, "intervall": "1m"}},
    {"hybridModel": {"enabled": True, "spec": {"image": "x", "model": {"volume": {"emptyDir": {}}},
                                               "atention": {}}}},
], ids=lambda values: json.dumps(values)[:40])
def test_unknown_keys_are_rejected_at_every_level(chart, values):
    with pytest.raises(helm_python.HelmValuesError, match="additional propert"):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize("values, message", [
    ({"operator": {"logLevel": "loud"}}, "logLevel"),
    ({"operator": {"watchNamespaces": ["Not_A_Namespace"]}}, "watchNamespaces"),
    ({"operator": {"image": {"digest": "latest"}}}, "digest"),
    ({"operator": {"healthPort": 0}}, "healthPort"),
    ({"serviceMonitor": {"interval": "often"}}, "interval"),
    ({"hybridModel": {"enabled": True}}, "spec"),
    ({"hybridModel": {"enabled": True, "spec": {"image": "x"}}}, "spec"),
])
def test_bad_values_are_rejected_with_the_key_named(chart, values, message):
    with pytest.raises(helm_python.HelmValuesError, match=message):
        chart.validate_schema(values)


def test_hybrid_model_spec_is_checked_against_the_crd(chart):
    spec = load_example("deepseek-r1.yaml")["spec"]
    chart.validate_schema({"hybridModel": {"enabled": True, "spec": spec}})
    bad = {**spec, "experts": {**spec["experts"], "quantization": "int3"}}
    with pytest.raises(helm_python.HelmValuesError, match="quantization"):
        chart.validate_schema({"hybridModel": {"enabled": True, "spec": bad}})
    gguf = {**spec, "experts": {**spec["experts"], "quantization": "none", "gguf": "DeepSeek-R1-GGUF/r1.Q4_K.gguf"}}
    chart.validate_schema({"hybridModel": {"enabled": True, "spec": gguf}})
    for path in ("/srv/models/r1.gguf", "../r1.gguf", "r1.safetensors", ""):
        bad = {**spec, "experts": {**spec["experts"], "gguf": path}}
        with pytest.raises(helm_python.HelmValuesError, match="gguf"):
            chart.validate_schema({"hybridModel": {"enabled": True, "spec": bad}})


def test_hybrid_model_tls_passes_through_checked_against_the_crd(chart):
    spec = load_example("mixtral-8x7b-tls.yaml")["spec"]
    mutual = {**spec, "tls": {**spec["tls"], "clientCAConfigMap": {"name": "clients-ca"}}}
    values = {"hybridModel": {"enabled": True, "name": "mixtral-8x7b", "spec": mutual}}
    chart.validate_schema(values)
    assert one(render_objects(chart, values), "HybridModel")["spec"]["tls"] == mutual["tls"]
    for tls in ({}, {"certSecret": {"name": "Mixtral_TLS"}}, {"certSecret": {"name": "t"}, "clientCA": {"name": "c"}},
                {"certSecret": {"name": "t"}, "clientCASecret": {"name": "c", "key": "a/b"}}):
        with pytest.raises(helm_python.HelmValuesError, match="tls"):
            chart.validate_schema({"hybridModel": {"enabled": True, "spec": {**spec, "tls": tls}}})


def value_keys(text: str):
    """(line number, key path) for every key in values.yaml, with the comment block above it."""
    stack: list[tuple[int, str]] = []
    lines = text.splitlines()
    for number, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        stack = [(i, k) for i, k in stack if i < indent] + [(indent, key)]
        yield number, ".".join(k for _, k in stack), lines[number - 1].strip() if number else ""


# Values that are Kubernetes objects passed through as they are: their own fields (requests.cpu,
# runAsUser, ...) are Kubernetes' and documented there.
PASSTHROUGH = ("operator.resources", "operator.podSecurityContext", "operator.securityContext")


def test_every_values_key_is_commented():
    keys = list(value_keys(VALUES_TEXT))
    assert len(keys) > 40
    missing = [path for _, path, above in keys
               if not above.startswith("#") and not path.startswith(tuple(p + "." for p in PASSTHROUGH))]
    assert missing == []


def test_the_values_comment_check_can_fail():
    text = "# documented\na: 1\nb: 2\n"
    commented = [(path, above.startswith("#")) for _, path, above in value_keys(text)]
    assert commented == [("a", True), ("b", False)]


def template_value_paths() -> set[str]:
    """Every `.Values.a.b` path the templates read."""
    paths = set()
    for template in (CHART_DIR / "templates").iterdir():
        paths.update(re.findall(r"\.Values\.([A-Za-z][\w.]*[\w])", template.read_text()))
    return paths


def test_every_value_the_templates_read_is_a_default_and_in_the_schema():
    defaults = yaml.safe_load(VALUES_TEXT)
    paths = template_value_paths()
    assert "operator.image.pullPolicy" in paths and "rbac.aggregateClusterRoles" in paths
    for path in sorted(paths):
        value, schema = defaults, SCHEMA
        for key in path.split("."):
            assert isinstance(value, dict) and key in value, f"{path} is not in values.yaml"
            assert key in schema.get("properties", {}), f"{path} is not in values.schema.json"
            value, schema = value[key], schema["properties"][key]
