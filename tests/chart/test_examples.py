"""examples/ are valid HybridModels: they pass the CRD's openAPIV3Schema (converted to JSON
Schema), the operator's own spec parser, and the objects the operator would build from them
pass strict Kubernetes validation. Bad specs are rejected."""

from __future__ import annotations

import copy

import jsonschema
import pytest
import yaml
from kubernetes_validate import utils as kv

from conftest import CRD_SOURCE, EXAMPLES_DIR, load_example, load_example_documents, load_hack

crd_schema = load_hack("crd_schema")
CRD = yaml.safe_load(CRD_SOURCE.read_text())
SCHEMA = crd_schema.to_json_schema(crd_schema.crd_version_schema(CRD, "v1alpha1"))
VALIDATOR = jsonschema.Draft7Validator(SCHEMA)
EXAMPLES = sorted(path.name for path in EXAMPLES_DIR.glob("*.yaml"))


def test_the_examples_exist():
    assert {"mixtral-8x7b.yaml", "deepseek-r1.yaml", "mixtral-8x7b-prometheus-tls.yaml",
            "mixtral-8x7b-tls.yaml"} <= set(EXAMPLES)


def test_the_tls_example_issues_the_certificate_its_service_needs():
    spec_module = pytest.importorskip("tandem_operator.spec")
    children = pytest.importorskip("tandem_operator.children")
    (certificate,) = [doc for doc in load_example_documents("mixtral-8x7b-tls.yaml") if doc["kind"] == "Certificate"]
    model = load_example("mixtral-8x7b-tls.yaml")
    tls = spec_module.parse_spec(model["spec"]).tls
    assert certificate["apiVersion"] == "cert-manager.io/v1"
    assert certificate["spec"]["secretName"] == tls.certSecret.name and tls.client_ca is None
    assert "server auth" in certificate["spec"]["usages"]
    # Every name a client in the cluster may use for the operator's Service, in the namespace the
    # example is applied to (the README's `-n models`).
    service = next(c for c in children.build_children(spec_module.parse_spec(model["spec"]),
                                                      model["metadata"]["name"], "models") if c["kind"] == "Service")
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    assert set(certificate["spec"]["dnsNames"]) == {name, f"{name}.{namespace}", f"{name}.{namespace}.svc",
                                                    f"{name}.{namespace}.svc.cluster.local"}


@pytest.mark.parametrize("tls", [{"clientCASecret": {"name": "mixtral-8x7b-tls"}},
                                 {"clientCAConfigMap": {"name": "clients-ca", "key": "ca.crt"}}])
def test_the_tls_examples_mutual_variants_are_valid(tls):
    # The commented mutual TLS variants, uncommented one at a time.
    example = copy.deepcopy(load_example("mixtral-8x7b-tls.yaml"))
    example["spec"]["tls"].update(tls)
    VALIDATOR.validate(example)
    text = (EXAMPLES_DIR / "mixtral-8x7b-tls.yaml").read_text()
    (source,) = tls
    assert f"# {source}:\n    #   name: {tls[source]['name']}\n" in text


def test_the_prometheus_example_names_its_secrets():
    spec_module = pytest.importorskip("tandem_operator.spec")
    prometheus = spec_module.parse_spec(load_example("mixtral-8x7b-prometheus-tls.yaml")["spec"]).autoscaling.metrics
    assert prometheus.source == "Prometheus" and prometheus.prometheus.url.startswith("https://")
    assert prometheus.prometheus.tls.caSecret.name == "prometheus-ca"
    assert prometheus.prometheus.auth.bearerTokenSecret.name == "prometheus-token"


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_matches_the_crd_schema(name):
    example = load_example(name)
    assert example["apiVersion"] == f"{CRD['spec']['group']}/v1alpha1"
    assert example["kind"] == CRD["spec"]["names"]["kind"]
    VALIDATOR.validate(example)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_is_commented(name):
    text = (EXAMPLES_DIR / name).read_text()
    comments = [line for line in text.splitlines() if line.lstrip().startswith("#")]
    assert len(comments) >= 10


@pytest.mark.parametrize("version", ["1.28.0", kv.latest_version()])
@pytest.mark.parametrize("name", EXAMPLES)
def test_operator_builds_valid_objects_from_example(name, version):
    spec_module = pytest.importorskip("tandem_operator.spec")
    children = pytest.importorskip("tandem_operator.children")
    example = load_example(name)
    spec = spec_module.parse_spec(example["spec"])
    objects = children.build_children(spec, example["metadata"]["name"], "models")
    assert {obj["kind"] for obj in objects} >= {"Deployment", "Service"}
    for obj in objects:
        kv.validate(obj, version, strict=True)


def mutate(path: str, value):
    """A copy of the Mixtral example with `value` at dotted `path` (None deletes the key)."""
    example = copy.deepcopy(load_example("mixtral-8x7b.yaml"))
    *parents, last = path.split(".")
    node = example
    for key in parents:
        node = node[key]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return example


BAD_SPECS = {
    "no spec": ("spec", None),
    "no image": ("spec.image", None),
    "empty image": ("spec.image", ""),
    "no model volume": ("spec.model.volume", None),
    "two volume sources": ("spec.model.volume", {"emptyDir": {}, "hostPath": {"path": "/m"}}),
    "misspelled volume source": ("spec.model.volume", {"hostPth": {"path": "/m"}}),
    "misspelled volume field": ("spec.model.volume", {"hostPath": {"path": "/m", "tpye": "Directory"}}),
    "volume field of the wrong type": ("spec.model.volume", {"persistentVolumeClaim": {"claimName": "m",
                                                                                       "readOnly": "yes"}}),
    "path escapes the volume": ("spec.model.path", "../etc"),
    "unknown dtype": ("spec.model.dtype", "int8"),
    "misspelled field": ("spec.atention", {"gpus": 1}),
    "misspelled nested field": ("spec.experts.quantisation", "int4"),
    "negative replicas": ("spec.replicas", -1),
    "fractional cpus": ("spec.experts.cpus", 1.5),
    "zero gpus": ("spec.attention.gpus", 0),
    "zero scheduler steps": ("spec.attention.numSchedulerSteps", 0),
    "scheduler steps above 64": ("spec.attention.numSchedulerSteps", 65),
    "unknown kv cache dtype": ("spec.kvCache.dtype", "int8"),
    "bad memory quantity": ("spec.experts.memory", "lots"),
    "unknown quantization": ("spec.experts.quantization", "int3"),
    "empty gguf": ("spec.experts.gguf", ""),
    "absolute gguf": ("spec.experts.gguf", "/models/m.gguf"),
    "gguf escapes the volume": ("spec.experts.gguf", "gguf/../../m.gguf"),
    "gguf not a .gguf file": ("spec.experts.gguf", "mixtral/model.safetensors"),
    "gguf too long": ("spec.experts.gguf", "m" * 1020 + ".gguf"),
    "zero gpu memory fraction": ("spec.kvCache.gpuMemoryFraction", 0),
    "gpu memory fraction above 1": ("spec.kvCache.gpuMemoryFraction", 1.5),
    "unknown metrics source": ("spec.autoscaling.metrics.source", "Datadog"),
    "prometheus url not http": ("spec.autoscaling.metrics.prometheus", {"url": "prometheus:9090"}),
    "misspelled prometheus tls field": ("spec.autoscaling.metrics.prometheus",
                                        {"url": "https://p", "tls": {"insecureSkipVerfy": True}}),
    "ca secret without a key": ("spec.autoscaling.metrics.prometheus",
                                {"url": "https://p", "tls": {"caSecret": {"name": "ca"}}}),
    "secret name not a DNS subdomain": ("spec.autoscaling.metrics.prometheus",
                                        {"url": "https://p", "auth": {"basicAuthSecret": {"name": "Prom_Basic"}}}),
    "basic auth secret with a key": ("spec.autoscaling.metrics.prometheus",
                                     {"url": "https://p", "auth": {"basicAuthSecret": {"name": "b", "key": "k"}}}),
    "string serviceAccountToken": ("spec.autoscaling.metrics.prometheus",
                                   {"url": "https://p", "auth": {"serviceAccountToken": "true"}}),
    "header value with a newline": ("spec.autoscaling.metrics.prometheus",
                                    {"url": "https://p", "headers": {"X-Scope-OrgID": "a\r\nX-Evil: 1"}}),
    "more than 16 headers": ("spec.autoscaling.metrics.prometheus",
                             {"url": "https://p", "headers": {f"X-{i}": "v" for i in range(17)}}),
    "tolerations not a list": ("spec.placement.tolerations", {"key": "a"}),
    "tls without certSecret": ("spec.tls", {"clientCASecret": {"name": "ca"}}),
    "tls secret name not a DNS subdomain": ("spec.tls", {"certSecret": {"name": "Mixtral_TLS"}}),
    "misspelled tls field": ("spec.tls", {"certSecret": {"name": "t"}, "clientCA": {"name": "ca"}}),
    "tls secret with a key": ("spec.tls", {"certSecret": {"name": "t", "key": "tls.crt"}}),
    "client ca key with a slash": ("spec.tls", {"certSecret": {"name": "t"},
                                                "clientCAConfigMap": {"name": "ca", "key": "a/ca.crt"}}),
    "string boolean": ("spec.autoscaling.enabled", "yes"),
}


@pytest.mark.parametrize("path, value", BAD_SPECS.values(), ids=list(BAD_SPECS))
def test_bad_spec_is_rejected(path, value):
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(mutate(path, value))


@pytest.mark.parametrize("path", ["m.gguf", "TheBloke/Mixtral-8x7B-GGUF/mixtral-8x7b.Q4_K_M.gguf"])
def test_experts_gguf_is_a_relative_gguf_path(path):
    VALIDATOR.validate(mutate("spec.experts.gguf", path))


def test_conversion_closes_records_and_keeps_open_fields_open():
    # The volume source is a Kubernetes type in the CRD: closed at every level, like any record.
    example = mutate("spec.model.volume", {"nfs": {"server": "nas", "path": "/models", "readOnly": True}})
    VALIDATOR.validate(example)
    volume = SCHEMA["properties"]["spec"]["properties"]["model"]["properties"]["volume"]
    assert SCHEMA["properties"]["spec"]["additionalProperties"] is False
    assert volume["additionalProperties"] is False and volume["properties"]["nfs"]["additionalProperties"] is False
    # A field left free-form (x-kubernetes-preserve-unknown-fields) stays open.
    open_field = {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                  "properties": {"a": {"type": "string"}}}
    assert crd_schema.to_json_schema(open_field) == {"type": "object", "properties": {"a": {"type": "string"}}}


def test_conversion_of_openapi_only_keywords():
    openapi = {"type": "object", "x-kubernetes-validations": [{"rule": "true"}], "properties": {
        "fraction": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1},
        "note": {"type": "string", "nullable": True},
    }}
    assert crd_schema.to_json_schema(openapi) == {"type": "object", "additionalProperties": False, "properties": {
        "fraction": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "note": {"type": ["string", "null"]},
    }}
    with pytest.raises(ValueError, match="exclusiveMinimum"):
        crd_schema.to_json_schema({"type": "number", "exclusiveMinimum": True})
    with pytest.raises(ValueError, match="no version 'v2'"):
        crd_schema.crd_version_schema(CRD, "v2")
