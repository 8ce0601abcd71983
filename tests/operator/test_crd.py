"""The CRD: its openAPIV3Schema accepts good specs and rejects bad ones, as parse_spec does,
and its defaults equal the operator's."""

from __future__ import annotations

import copy
import re

import jsonschema
import pytest
from hm_cluster import crd_schema, hybrid_model, load_crd

from tandem_operator import names
from tandem_operator.placement import PREFERRED, REQUIRED
from tandem_operator.prometheus_spec import PrometheusAuth, PrometheusTLS, SecretRef
from tandem_operator.spec import (AttentionSpec, AutoscalingSpec, ExpertsSpec, KVCacheSpec, PlacementSpec,
                                  SpecError, TLSSpec, check_name, parse_spec)
from tandem_operator.spec_fields import ConfigMapKeyRef, SecretKeyRef

def _prometheus(url: str = "https://prom:9090", **fields) -> dict:
    return {"autoscaling": {"metrics": {"source": "Prometheus", "prometheus": {"url": url, **fields}}}}


GOOD = {
    "minimal": {},
    "hostpath": {"model": {"path": "", "volume": {"hostPath": {"path": "/srv/m"}}}},
    "autoscaled-pods": {"autoscaling": {"enabled": True, "maxReplicas": 4, "targetP95InterTokenLatencyMs": 80}},
    "autoscaled-prometheus": {"autoscaling": {"enabled": True, "maxReplicas": 2, "targetP95InterTokenLatencyMs": 5.5,
                                              "metrics": {"source": "Prometheus",
                                                          "prometheus": {"url": "http://prom:9090"}}}},
    "prometheus-tls-bearer": {"autoscaling": {"metrics": {"prometheus": {
        "url": "https://thanos.monitoring.svc:9091",
        "tls": {"caSecret": {"name": "prometheus-ca", "key": "ca.crt"}, "serverName": "thanos.monitoring.svc"},
        "auth": {"bearerTokenSecret": {"name": "prometheus-token", "key": "token"}},
        "headers": {"X-Scope-OrgID": "team-a"}}}}},
    "prometheus-basic-auth": {"autoscaling": {"metrics": {"prometheus": {
        "url": "https://prom:9090", "tls": {"insecureSkipVerify": True},
        "auth": {"basicAuthSecret": {"name": "prometheus.basic-auth"}, "serviceAccountToken": False}}}}},
    "prometheus-mutual-tls": {"autoscaling": {"metrics": {"prometheus": {
        "url": "https://thanos-querier.openshift-monitoring.svc:9091",
        "tls": {"caConfigMap": {"name": "openshift-service-ca.crt", "key": "service-ca.crt"},
                "certSecret": {"name": "tandem-operator-client"}}}}}},
    "prometheus-service-account": {"autoscaling": {"metrics": {"prometheus": {
        "url": "https://thanos-querier.openshift-monitoring.svc:9091", "auth": {"serviceAccountToken": True}}}}},
    "tuned": {"kvCache": {"blockSize": 64, "gpuMemoryFraction": 1, "cpuTierGiB": 0},
              "experts": {"cpus": 1, "memory": "1.5Gi", "threads": 2, "quantization": "int4",
                          "spinMicroseconds": 20000}},
    "multi-step": {"attention": {"numSchedulerSteps": 64}},
    "priority-scheduling": {"attention": {"schedulingPolicy": "priority"}},
    "no-prefix-caching": {"kvCache": {"prefixCaching": False}},
    "fp8-kv-cache": {"kvCache": {"dtype": "fp8", "cpuTierGiB": 64}, "attention": {"memory": "96Gi"}},
    "gguf": {"experts": {"gguf": "DeepSeek-R1-GGUF/Q4_K_M/DeepSeek-R1-Q4_K_M-00001-of-00009.gguf"}},
    "gguf-at-the-root": {"experts": {"gguf": "m.gguf", "quantization": "none"}},
    "tls": {"tls": {"certSecret": {"name": "mixtral-8x7b-tls"}}},
    "mutual-tls-secret": {"tls": {"certSecret": {"name": "mixtral-8x7b-tls"},
                                  "clientCASecret": {"name": "mixtral-8x7b-tls", "key": "ca.crt"}}},
    "mutual-tls-config-map": {"tls": {"certSecret": {"name": "serving.tls"},
                                      "clientCAConfigMap": {"name": "clients-ca-bundle", "key": "trust-bundle.pem"}}},
    "api-key": {"apiKeySecret": {"name": "mixtral-8x7b-api-key"}},
    "api-key-named-key-and-tls": {"apiKeySecret": {"name": "gateway.keys", "key": "TANDEM_API_KEY"},
                                  "tls": {"certSecret": {"name": "mixtral-8x7b-tls"}}},
    # The Kubernetes docs' examples (Assigning Pods to Nodes; Taints and Tolerations).
    "placement": {"placement": {
        "nodeAffinity": {
            REQUIRED: {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["antarctica-east1"]}]}]},
            PREFERRED: [{"weight": 1, "preference": {"matchExpressions": [
                {"key": "another-node-label-key", "operator": "In", "values": ["another-node-label-value"]}]}}]},
        "tolerations": [{"key": "key1", "operator": "Equal", "value": "value1", "effect": "NoSchedule"},
                        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
                         "tolerationSeconds": 6000},
                        {"operator": "Exists"}]}},
}
# Each breaks one rule the schema itself can express (CEL rules are checked in parse_spec).
BAD = {
    "no-image": ({"image": None}, "image"),
    "absolute-path": ({"model": {"path": "/etc", "volume": {"emptyDir": {}}}}, "path"),
    "escaping-path": ({"model": {"path": "a/../../etc", "volume": {"emptyDir": {}}}}, "path"),
    "two-volume-sources": ({"model": {"volume": {"emptyDir": {}, "hostPath": {"path": "/x"}}}}, "volume"),
    "negative-replicas": ({"replicas": -1}, "replicas"),
    "fractional-cpus": ({"experts": {"cpus": 1.5}}, "cpus"),
    "bad-memory": ({"experts": {"memory": "lots"}}, "memory"),
    "zero-gpus": ({"attention": {"gpus": 0}}, "gpus"),
    "zero-gpu-fraction": ({"kvCache": {"gpuMemoryFraction": 0}}, "gpuMemoryFraction"),
    "unknown-quant": ({"experts": {"quantization": "fp4"}}, "quantization"),
    "negative-spin": ({"experts": {"spinMicroseconds": -1}}, "spinMicroseconds"),
    "second-long-spin": ({"experts": {"spinMicroseconds": 2_000_000}}, "spinMicroseconds"),
    "zero-scheduler-steps": ({"attention": {"numSchedulerSteps": 0}}, "numSchedulerSteps"),
    "unknown-scheduling-policy": ({"attention": {"schedulingPolicy": "lifo"}}, "schedulingPolicy"),
    "negative-scheduler-steps": ({"attention": {"numSchedulerSteps": -8}}, "numSchedulerSteps"),
    "too-many-scheduler-steps": ({"attention": {"numSchedulerSteps": 65}}, "numSchedulerSteps"),
    "fractional-scheduler-steps": ({"attention": {"numSchedulerSteps": 2.5}}, "numSchedulerSteps"),
    "string-scheduler-steps": ({"attention": {"numSchedulerSteps": "8"}}, "numSchedulerSteps"),
    "unknown-kv-cache-dtype": ({"kvCache": {"dtype": "fp8_e5m2"}}, "dtype"),
    "string-prefix-caching": ({"kvCache": {"prefixCaching": "false"}}, "prefixCaching"),
    "bad-source": ({"autoscaling": {"metrics": {"source": "Datadog"}}}, "source"),
    "bad-url": ({"autoscaling": {"metrics": {"prometheus": {"url": "prom:9090"}}}}, "url"),
    "ca-secret-without-key": (_prometheus(tls={"caSecret": {"name": "ca"}}), "tls.caSecret.key is required"),
    "ca-config-map-without-key": (_prometheus(tls={"caConfigMap": {"name": "ca"}}), "tls.caConfigMap.key is required"),
    "bad-config-map-name": (_prometheus(tls={"caConfigMap": {"name": "CA", "key": "ca.crt"}}),
                            "must be a ConfigMap's name"),
    "bad-cert-secret-name": (_prometheus(tls={"certSecret": {"name": "client/cert"}}), "must be a Secret's name"),
    "bad-secret-name": (_prometheus(auth={"bearerTokenSecret": {"name": "Prom_Token", "key": "t"}}),
                        "must be a Secret's name"),
    "bad-secret-key": (_prometheus(auth={"bearerTokenSecret": {"name": "t", "key": "a/b"}}), "must be a Secret's key"),
    "string-skip-verify": (_prometheus(tls={"insecureSkipVerify": "true"}), "insecureSkipVerify"),
    "header-injection": (_prometheus(headers={"X-Scope-OrgID": "a\r\nAuthorization: Bearer x"}),
                         "without control characters"),
    "too-many-headers": (_prometheus(headers={f"X-{i}": "v" for i in range(17)}), "at most 16 headers"),
    "empty-gguf": ({"experts": {"gguf": ""}}, "spec.experts.gguf"),
    "absolute-gguf": ({"experts": {"gguf": "/models/m.gguf"}}, "spec.experts.gguf"),
    "escaping-gguf": ({"experts": {"gguf": "../m.gguf"}}, "spec.experts.gguf"),
    "inner-escaping-gguf": ({"experts": {"gguf": "a/../../etc/m.gguf"}}, "spec.experts.gguf"),
    "hidden-gguf": ({"experts": {"gguf": "a/.m.gguf"}}, "spec.experts.gguf"),
    "empty-segment-gguf": ({"experts": {"gguf": "a//m.gguf"}}, "spec.experts.gguf"),
    "not-a-gguf": ({"experts": {"gguf": "model.safetensors"}}, "spec.experts.gguf"),
    "gguf-directory": ({"experts": {"gguf": "m.gguf/"}}, "spec.experts.gguf"),
    "bare-suffix-gguf": ({"experts": {"gguf": ".gguf"}}, "spec.experts.gguf"),
    "too-long-gguf": ({"experts": {"gguf": "a" * 1020 + ".gguf"}}, "spec.experts.gguf"),
    "number-gguf": ({"experts": {"gguf": 8}}, "spec.experts.gguf"),
    "tls-without-cert-secret": ({"tls": {}}, "spec.tls.certSecret is required"),
    "tls-only-a-client-ca": ({"tls": {"clientCASecret": {"name": "ca"}}}, "spec.tls.certSecret is required"),
    "bad-tls-secret-name": ({"tls": {"certSecret": {"name": "Mixtral_TLS"}}},
                            "spec.tls.certSecret.name 'Mixtral_TLS' must be a Secret's name"),
    "bad-client-ca-secret-key": ({"tls": {"certSecret": {"name": "t"}, "clientCASecret": {"name": "ca", "key": "a/b"}}},
                                 "spec.tls.clientCASecret.key 'a/b' must be a Secret's key"),
    "bad-client-ca-config-map-name": ({"tls": {"certSecret": {"name": "t"}, "clientCAConfigMap": {"name": "-ca"}}},
                                      "spec.tls.clientCAConfigMap.name '-ca' must be a ConfigMap's name"),
    "client-ca-without-name": ({"tls": {"certSecret": {"name": "t"}, "clientCAConfigMap": {"key": "ca.crt"}}},
                               "spec.tls.clientCAConfigMap.name is required"),
    "api-key-without-name": ({"apiKeySecret": {"key": "api-key"}}, "spec.apiKeySecret.name is required"),
    "bad-api-key-secret-name": ({"apiKeySecret": {"name": "Keys"}},
                                "spec.apiKeySecret.name 'Keys' must be a Secret's name"),
    "bad-api-key-key": ({"apiKeySecret": {"name": "keys", "key": "a b"}},
                        "spec.apiKeySecret.key 'a b' must be a Secret's key"),
    "api-key-as-a-string": ({"apiKeySecret": "keys"}, "spec.apiKeySecret"),
}
# Kubernetes types (placement, the model's volume) carry Kubernetes' schemas; parse_spec passes
# them through to the pod template, so the schema alone checks them.
BAD_KUBERNETES = {
    "toleration-effect": ({"placement": {"tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedul"}]}},
                          ["spec", "placement", "tolerations", 0, "effect"]),
    "toleration-operator": ({"placement": {"tolerations": [{"key": "gpu", "operator": "exists"}]}},
                            ["spec", "placement", "tolerations", 0, "operator"]),
    "selector-operator": ({"placement": {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "gpu", "operator": "in"}]}]}}}},
        ["spec", "placement", "nodeAffinity", REQUIRED, "nodeSelectorTerms", 0, "matchExpressions", 0, "operator"]),
    "no-terms": ({"placement": {"nodeAffinity": {REQUIRED: {}}}}, ["spec", "placement", "nodeAffinity", REQUIRED]),
    "string-weight": ({"placement": {"nodeAffinity": {PREFERRED: [{"weight": "1", "preference": {}}]}}},
                      ["spec", "placement", "nodeAffinity", PREFERRED, 0, "weight"]),
    "string-claim-readonly": ({"model": {"volume": {"persistentVolumeClaim": {"claimName": "m", "readOnly": "yes"}}}},
                              ["spec", "model", "volume", "persistentVolumeClaim", "readOnly"]),
}
# Cross-field rules: CEL in the CRD (x-kubernetes-validations), enforced again by parse_spec.
BAD_CEL = {
    "enabled-without-target": ({"autoscaling": {"enabled": True, "maxReplicas": 3}}, "autoscaling"),
    "min-above-max": ({"autoscaling": {"minReplicas": 5, "maxReplicas": 3}}, "autoscaling"),
    "prometheus-without-url": ({"autoscaling": {"metrics": {"source": "Prometheus"}}}, "metrics"),
    "tls-over-http": (_prometheus(url="http://prom:9090", tls={"insecureSkipVerify": False}),
                      "tls needs an https:// url"),
    "bearer-and-basic-auth": (_prometheus(auth={"bearerTokenSecret": {"name": "t", "key": "t"},
                                                "basicAuthSecret": {"name": "b"}}), "at most one of"),
    "bearer-and-service-account": (_prometheus(auth={"bearerTokenSecret": {"name": "t", "key": "t"},
                                                     "serviceAccountToken": True}), "at most one of"),
    "ca-secret-and-config-map": (_prometheus(tls={"caSecret": {"name": "a", "key": "ca.crt"},
                                                  "caConfigMap": {"name": "b", "key": "ca.crt"}}),
                                 "tls takes at most one of caSecret and caConfigMap"),
    "gguf-with-int8": ({"experts": {"gguf": "m.gguf", "quantization": "int8"}},
                       "spec.experts.gguf cannot be combined with spec.experts.quantization int8"),
    "gguf-with-int4": ({"experts": {"gguf": "m.gguf", "quantization": "int4"}},
                       "spec.experts.gguf cannot be combined with spec.experts.quantization int4"),
    "client-ca-secret-and-config-map": ({"tls": {"certSecret": {"name": "t"}, "clientCASecret": {"name": "a"},
                                                 "clientCAConfigMap": {"name": "b"}}},
                                        "spec.tls takes at most one of clientCASecret and clientCAConfigMap"),
}


def body(overrides: dict) -> dict:
    model = hybrid_model("m")
    for key, value in overrides.items():
        if value is None:
            model["spec"].pop(key, None)
        else:
            model["spec"][key] = value
    return model


@pytest.mark.parametrize("name", GOOD)
def test_good_specs_pass_schema_and_parser(name):
    model = body(GOOD[name])
    jsonschema.Draft4Validator(crd_schema()).validate(model)
    parse_spec(model["spec"])


@pytest.mark.parametrize("name", BAD)
def test_bad_specs_fail_schema_and_parser(name):
    overrides, field = BAD[name]
    model = body(overrides)
    errors = list(jsonschema.Draft4Validator(crd_schema()).iter_errors(model))
    assert errors, f"the CRD schema accepted {name}"
    with pytest.raises(SpecError, match=field):
        parse_spec(model["spec"])


@pytest.mark.parametrize("name", BAD_KUBERNETES)
def test_kubernetes_typed_fields_reject_bad_values_at_the_field(name):
    overrides, path = BAD_KUBERNETES[name]
    errors = list(jsonschema.Draft4Validator(crd_schema()).iter_errors(body(overrides)))
    assert [list(error.absolute_path) for error in errors] == [path]


def test_kubernetes_typed_fields_declare_their_fields():
    # The API server prunes what a schema does not declare (kubectl's strict field validation
    # rejects it): declared, a typo such as `operater` or `...Executions` fails `kubectl apply`
    # rather than vanishing from the pods' template.
    spec = crd_schema()["properties"]["spec"]["properties"]
    placement = spec["placement"]["properties"]
    assert set(placement["nodeAffinity"]["properties"]) == {REQUIRED, PREFERRED}
    assert set(placement["tolerations"]["items"]["properties"]) == {"key", "operator", "value", "effect",
                                                                    "tolerationSeconds"}
    assert {"persistentVolumeClaim", "hostPath", "nfs"} <= set(spec["model"]["properties"]["volume"]["properties"])
    assert "x-kubernetes-preserve-unknown-fields" not in str(crd_schema())


@pytest.mark.parametrize("name", BAD_CEL)
def test_cross_field_rules_are_declared_and_enforced(name):
    rules = [r["rule"] for r in _walk_validations(crd_schema()["properties"]["spec"])]
    assert len(rules) == 8
    overrides, message = BAD_CEL[name]
    with pytest.raises(SpecError, match=message):
        parse_spec(body(overrides)["spec"])


# The name also names the Service and is a label value: a DNS-1035 label (not just a DNS subdomain).
NAMES = {"mixtral": True, "mixtral-8x7b": True, "a": True, "a" * 63: True, "a" * 64: False, "9lives": False,
         "Mixtral": False, "mixtral.v2": False, "mixtral-": False, "-mixtral": False, "mixtral_8x7b": False}


@pytest.mark.parametrize("name", NAMES)
def test_the_name_rule_is_declared_at_the_root_and_enforced(name):
    # A rule at the root may read metadata.name. No CEL evaluator here: its two checks are run
    # with Python's re, which reads this anchored pattern as RE2 (CEL's `matches`) does.
    (rule,) = crd_schema()["x-kubernetes-validations"]
    pattern = re.search(r"matches\('(.+?)'\)", rule["rule"]).group(1)
    limit = int(re.search(r"size\(self\.metadata\.name\) <= (\d+)", rule["rule"]).group(1))
    assert (len(name) <= limit and re.search(pattern, name) is not None) is NAMES[name]
    if NAMES[name]:
        check_name(name)
    else:
        with pytest.raises(SpecError, match="metadata.name .* must be a DNS-1035 label"):
            check_name(name)


@pytest.mark.parametrize("memory, tier, ok", [("32Gi", 8, True), ("32Gi", 32, False), ("16Gi", 64, False),
                                               ("1Gi", 0, True), ("96Gi", 64, True)])
def test_the_attention_container_must_hold_the_cpu_kv_tier(memory, tier, ok):
    # The attention process writes the tier, so its shared memory counts against that container.
    spec = body({"attention": {"memory": memory}, "kvCache": {"cpuTierGiB": tier}})["spec"]
    if ok:
        assert parse_spec(spec).attention.memory == memory
    else:
        with pytest.raises(SpecError, match=f"spec.attention.memory {memory} must hold the {tier} GiB CPU KV tier"):
            parse_spec(spec)


def test_gguf_excludes_quantization_on_the_experts_object():
    # The JSON Schema check cannot see CEL: the rule must sit on `experts`, where both fields are.
    experts = crd_schema()["properties"]["spec"]["properties"]["experts"]
    (rule,) = experts["x-kubernetes-validations"]
    assert rule["rule"] == "!has(self.gguf) || !has(self.quantization) || self.quantization == 'none'"
    assert "experts.gguf" in rule["message"] and "quantization" in rule["message"]
    # What the rule lets through, parse_spec lets through too.
    assert parse_spec(body({"experts": {"gguf": "m.gguf", "quantization": "none"}})["spec"]).experts.gguf == "m.gguf"
    assert parse_spec(body({"experts": {"quantization": "int4"}})["spec"]).experts.gguf is None


def test_prometheus_rules_sit_on_the_objects_they_read():
    # The JSON Schema check cannot see CEL: each rule must sit where all the fields it reads are.
    prometheus = crd_schema()["properties"]["spec"]["properties"]["autoscaling"]["properties"]["metrics"][
        "properties"]["prometheus"]
    (tls_rule,) = prometheus["x-kubernetes-validations"]
    assert tls_rule["rule"] == "!has(self.tls) || self.url.startsWith('https://')"
    (auth_rule,) = prometheus["properties"]["auth"]["x-kubernetes-validations"]
    assert auth_rule["rule"] == ("(has(self.bearerTokenSecret) ? 1 : 0) + (has(self.basicAuthSecret) ? 1 : 0) + "
                                 "(has(self.serviceAccountToken) && self.serviceAccountToken ? 1 : 0) <= 1")
    assert "at most one" in auth_rule["message"]
    # What the rules let through, parse_spec lets through too: one source, or a false serviceAccountToken.
    auth = {"basicAuthSecret": {"name": "b"}, "serviceAccountToken": False}
    parsed = parse_spec(body(_prometheus(auth=auth))["spec"]).autoscaling.metrics.prometheus
    assert parsed.auth == PrometheusAuth(basicAuthSecret=SecretRef("b"))
    assert parsed.auth.source == "auth.basicAuthSecret b"
    assert parse_spec(body(_prometheus(url="https://p", tls={}))["spec"]).autoscaling.metrics.prometheus.tls == \
        PrometheusTLS()


def test_the_client_ca_rule_sits_on_the_tls_object():
    # The JSON Schema check cannot see CEL: the rule must sit on `tls`, where both fields are.
    tls = crd_schema()["properties"]["spec"]["properties"]["tls"]
    (rule,) = tls["x-kubernetes-validations"]
    assert rule["rule"] == "!has(self.clientCASecret) || !has(self.clientCAConfigMap)"
    assert rule["message"] == "tls takes at most one of clientCASecret and clientCAConfigMap"
    assert tls["required"] == ["certSecret"]
    # What the rule lets through, parse_spec lets through too: either source alone, or none.
    for source, ref in (("clientCASecret", SecretKeyRef("ca", "bundle.pem")),
                        ("clientCAConfigMap", ConfigMapKeyRef("ca", "bundle.pem"))):
        parsed = parse_spec(body({"tls": {"certSecret": {"name": "t"}, source: {"name": "ca", "key": "bundle.pem"}}})[
            "spec"]).tls
        assert parsed.client_ca == ref and getattr(parsed, source) == ref
    assert parse_spec(body({"tls": {"certSecret": {"name": "t"}}})["spec"]).tls.client_ca is None


def test_every_tls_field_is_described():
    def undescribed(schema: dict, path: str):
        if "description" not in schema:
            yield path
        for key, sub in (schema.get("properties") or {}).items():
            yield from undescribed(sub, f"{path}.{key}")

    assert list(undescribed(crd_schema()["properties"]["spec"]["properties"]["tls"], "spec.tls")) == []


@pytest.mark.parametrize("fields, message", [
    ({"auth": {"basicAuthSecret": {"name": "b", "key": "password"}}}, "auth.basicAuthSecret has unknown field"),
    ({"tls": {"insecureSkipVerfy": True}}, "tls has unknown field"),
    ({"tls": {"ca": "-----BEGIN CERTIFICATE-----"}}, "tls has unknown field"),
])
def test_unknown_prometheus_fields_are_refused(fields, message):
    # The API server prunes them (kubectl's strict validation refuses them: tests/chart).
    with pytest.raises(SpecError, match=message):
        parse_spec(body(_prometheus(**fields))["spec"])


@pytest.mark.parametrize("tls, message", [
    ({"certSecret": {"name": "t", "key": "tls.crt"}}, "spec.tls.certSecret has unknown field"),
    ({"certSecret": {"name": "t"}, "clientCA": {"name": "ca"}}, "spec.tls has unknown field"),
    ({"certSecret": {"name": "t"}, "clientCASecret": {"name": "ca", "items": ["ca.crt"]}},
     "spec.tls.clientCASecret has unknown field"),
])
def test_unknown_tls_fields_are_refused(tls, message):
    # The API server prunes them (kubectl's strict validation refuses them): a misspelled clientCA
    # would otherwise serve without asking for client certificates.
    with pytest.raises(SpecError, match=message):
        parse_spec(body({"tls": tls})["spec"])


def test_prometheus_headers_may_not_carry_credentials():
    # Whoever may read the HybridModel could read them; credentials go in a Secret. Not in the
    # schema (no CEL over map keys, whose cost the API server cannot bound): parse_spec refuses them.
    for name in ("Authorization", "authorization"):
        with pytest.raises(SpecError, match="may not set Authorization"):
            parse_spec(body(_prometheus(headers={name: "Bearer abc"}))["spec"])
    with pytest.raises(SpecError, match="is not an HTTP header name"):
        parse_spec(body(_prometheus(headers={"X Scope": "a"}))["spec"])
    spec = parse_spec(body(_prometheus(headers={"X-Scope-OrgID": "team-a|team-b"}))["spec"])
    assert spec.autoscaling.metrics.prometheus.headers == {"X-Scope-OrgID": "team-a|team-b"}


def test_names_scale_and_printer_columns():
    crd = load_crd()
    assert crd["metadata"]["name"] == f"{names.PLURAL}.{names.GROUP}"
    spec = crd["spec"]
    assert (spec["group"], spec["names"]["kind"], spec["names"]["plural"]) == (names.GROUP, names.KIND, names.PLURAL)
    assert spec["names"]["shortNames"] == ["hm"] and spec["scope"] == "Namespaced"
    (version,) = spec["versions"]
    assert version["name"] == names.VERSION
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    assert "status" in version["subresources"]
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Phase", "Ready", "Desired", "P95-ITL-ms", "Age"} <= columns


def test_crd_defaults_equal_the_operators():
    """Apply the schema's defaults as the API server would, then compare with parse_spec's."""
    schema = crd_schema()["properties"]["spec"]
    minimal = {"model": {"volume": {"emptyDir": {}}}, "image": "x"}
    defaulted = _apply_defaults(schema, copy.deepcopy(minimal))
    assert parse_spec(defaulted) == parse_spec(minimal)
    assert defaulted["attention"]["memory"] == parse_spec(minimal).attention.memory
    assert defaulted["autoscaling"]["metrics"]["source"] == "Pods"
    # The dataclasses' own defaults are the same again.
    parsed = parse_spec(minimal)
    assert (parsed.attention, parsed.experts, parsed.kvCache, parsed.placement, parsed.autoscaling) == (
        AttentionSpec(), ExpertsSpec(), KVCacheSpec(), PlacementSpec(), AutoscalingSpec())
    # The same for the Prometheus objects' defaults, once present.
    prometheus = _prometheus(tls={}, auth={})["autoscaling"]
    defaulted = _apply_defaults(schema, copy.deepcopy({**minimal, "autoscaling": prometheus}))
    assert defaulted["autoscaling"]["metrics"]["prometheus"]["tls"] == {"insecureSkipVerify": False}
    assert defaulted["autoscaling"]["metrics"]["prometheus"]["auth"] == {"serviceAccountToken": False}
    parsed = parse_spec(defaulted).autoscaling.metrics.prometheus
    assert (parsed.tls, parsed.auth, parsed.headers) == (PrometheusTLS(), PrometheusAuth(), {})
    # No TLS unless asked for; a client CA's key defaults to ca.crt, where cert-manager writes it.
    assert "default" not in schema["properties"]["tls"] and parse_spec(minimal).tls is None
    for source, kind in (("clientCASecret", SecretKeyRef), ("clientCAConfigMap", ConfigMapKeyRef)):
        tls = {"certSecret": {"name": "t"}, source: {"name": "ca"}}
        defaulted = _apply_defaults(schema, copy.deepcopy({**minimal, "tls": tls}))
        assert defaulted["tls"][source] == {"name": "ca", "key": "ca.crt"}
        assert parse_spec(defaulted).tls == parse_spec({**minimal, "tls": tls}).tls == TLSSpec(
            SecretRef("t"), **{source: kind("ca", "ca.crt")})
    # No API key unless asked for; its key defaults to api-key.
    assert "default" not in schema["properties"]["apiKeySecret"] and parse_spec(minimal).apiKeySecret is None
    defaulted = _apply_defaults(schema, copy.deepcopy({**minimal, "apiKeySecret": {"name": "k"}}))
    assert defaulted["apiKeySecret"] == {"name": "k", "key": "api-key"}
    assert parse_spec(defaulted).apiKeySecret == parse_spec({**minimal, "apiKeySecret": {"name": "k"}}).apiKeySecret


def _apply_defaults(schema: dict, value):
    if schema.get("type") == "object" and isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _apply_defaults(sub, value[key])
    return value


def _walk_validations(schema: dict):
    yield from schema.get("x-kubernetes-validations", [])
    for sub in (schema.get("properties") or {}).values():
        yield from _walk_validations(sub)
    if isinstance(schema.get("items"), dict):
        yield from _walk_validations(schema["items"])
