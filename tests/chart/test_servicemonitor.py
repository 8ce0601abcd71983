"""The ServiceMonitor: a custom resource kubernetes-validate has no schema for, so its shape is
checked against the subset of monitoring.coreos.com/v1 it uses, and its selector against the
Services the operator really builds."""

from __future__ import annotations

import copy
import re

import jsonschema
import pytest

from conftest import NON_DEFAULT_VALUES, by_kind, load_example, one, render_objects

# Prometheus duration, as the Prometheus Operator's CRD defines it.
DURATION = {"type": "string",
            "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def closed(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or [],
            "additionalProperties": False}


# Field names and types from the Prometheus Operator's ServiceMonitor CRD (v1), only those used.
SERVICE_MONITOR = closed({
    "apiVersion": {"const": "monitoring.coreos.com/v1"},
    "kind": {"const": "ServiceMonitor"},
    "metadata": closed({"name": {"type": "string", "maxLength": 253},
                        "namespace": {"type": "string"}, "labels": STRING_MAP}, ["name", "namespace"]),
    "spec": closed({
        "selector": closed({"matchLabels": STRING_MAP}, ["matchLabels"]),
        "namespaceSelector": closed({"any": {"type": "boolean"},
                                     "matchNames": {"type": "array", "items": {"type": "string"}}}),
        "targetLabels": {"type": "array", "items": {"type": "string"}},
        "endpoints": {"type": "array", "minItems": 1, "items": closed({
            "port": {"type": "string"}, "path": {"type": "string"},
            "interval": DURATION, "scrapeTimeout": DURATION}, ["port"])},
    }, ["selector", "endpoints"]),
}, ["apiVersion", "kind", "metadata", "spec"])


@pytest.mark.parametrize("values", [NON_DEFAULT_VALUES["namespaced"], NON_DEFAULT_VALUES["everything"],
                                    {"serviceMonitor": {"enabled": True}}], ids=["namespaced", "everything", "on"])
def test_service_monitor_shape(chart, values):
    jsonschema.validate(one(render_objects(chart, values), "ServiceMonitor"), SERVICE_MONITOR)


def test_the_shape_check_can_fail(chart):
    monitor = copy.deepcopy(one(render_objects(chart, {"serviceMonitor": {"enabled": True}}), "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, SERVICE_MONITOR)


def test_off_by_default(chart):
    assert not by_kind(render_objects(chart), "ServiceMonitor")


def test_namespaces_follow_the_operator(chart):
    clusterwide = one(render_objects(chart, {"serviceMonitor": {"enabled": True}}), "ServiceMonitor")
    assert clusterwide["spec"]["namespaceSelector"] == {"any": True}
    namespaced = one(render_objects(chart, NON_DEFAULT_VALUES["namespaced"]), "ServiceMonitor")
    assert namespaced["spec"]["namespaceSelector"] == {"matchNames": ["models", "research"]}
    assert namespaced["metadata"]["labels"]["release"] == "prometheus"


def test_selects_the_services_the_operator_builds(chart):
    spec_module = pytest.importorskip("tandem_operator.spec")
    service_module = pytest.importorskip("tandem_operator.service")
    spec = spec_module.parse_spec(load_example("mixtral-8x7b.yaml")["spec"])
    service = service_module.build_service(spec, "mixtral-8x7b", "models")
    monitor = one(render_objects(chart, {"serviceMonitor": {"enabled": True}}), "ServiceMonitor")
    labels = service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for label in monitor["spec"]["targetLabels"]:
        assert labels[label] == "mixtral-8x7b"
    port_names = {port["name"] for port in service["spec"]["ports"]}
    assert {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]} <= port_names


def _operator_pod_and_service(name: str = "mixtral-8x7b") -> tuple[dict, dict]:
    """The pod template and Service the operator builds for the example HybridModel."""
    spec_module = pytest.importorskip("tandem_operator.spec")
    children_module = pytest.importorskip("tandem_operator.children")
    spec = spec_module.parse_spec(load_example("mixtral-8x7b.yaml")["spec"])
    kids = {kid["kind"]: kid for kid in children_module.build_children(spec, name, "models")}
    return kids["Deployment"]["spec"]["template"]["spec"], kids["Service"]


@pytest.mark.parametrize("values", [{"serviceMonitor": {"enabled": True}}, NON_DEFAULT_VALUES["everything"]],
                         ids=["defaults", "everything"])
def test_scrapes_both_processes_of_a_pod_alike(chart, values):
    # The attention server (`metrics`) and the experts process (`expert-metrics`): the same path,
    # interval and timeout; targetLabels is the monitor's own, so both get the model label.
    endpoints = one(render_objects(chart, values), "ServiceMonitor")["spec"]["endpoints"]
    assert [endpoint["port"] for endpoint in endpoints] == ["metrics", "expert-metrics"]
    monitor_values = values["serviceMonitor"]
    for endpoint in endpoints:
        assert endpoint["path"] == "/metrics"
        assert endpoint["interval"] == monitor_values.get("interval", "15s")
        assert endpoint["scrapeTimeout"] == monitor_values.get("scrapeTimeout", "10s")


def test_each_endpoint_reaches_the_container_that_exports_its_series(chart):
    # Endpoint port name -> Service port -> named container port -> the process whose metrics port
    # it is, so a renamed port on either side cannot leave a target that Prometheus marks down.
    contract = pytest.importorskip("tandem.contract")
    pod_spec, service = _operator_pod_and_service()
    container_ports = {port["name"]: (container["name"], port["containerPort"])
                       for container in pod_spec["containers"] for port in container.get("ports", [])}
    target_ports = {port["name"]: port["targetPort"] for port in service["spec"]["ports"]}
    monitor = one(render_objects(chart, {"serviceMonitor": {"enabled": True}}), "ServiceMonitor")
    reached = {container_ports[target_ports[endpoint["port"]]] for endpoint in monitor["spec"]["endpoints"]}
    assert reached == {("attention", contract.METRICS_PORT), ("experts", contract.EXPERTS_METRICS_PORT)}


def test_does_not_select_the_operator_itself(chart):
    objects = render_objects(chart, {"serviceMonitor": {"enabled": True}})
    selector = one(objects, "ServiceMonitor")["spec"]["selector"]["matchLabels"]
    operator_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= operator_labels.items()


def test_the_operators_default_query_selects_on_the_label_the_monitor_adds(chart):
    # targetLabels copies the Service's label onto every series, its name made a valid Prometheus
    # label name ("." and "/" become "_"): that is what the default PromQL selects the model by.
    metrics_source = pytest.importorskip("tandem_operator.metrics_source")
    monitor = one(render_objects(chart, {"serviceMonitor": {"enabled": True}}), "ServiceMonitor")
    (label,) = monitor["spec"]["targetLabels"]
    series_label = re.sub(r"[^a-zA-Z0-9_]", "_", label)
    assert series_label == metrics_source.MODEL_SERIES_LABEL
    query = metrics_source.prometheus_query(None, "models", "mixtral", 60)
    assert f'{series_label}="mixtral"' in query and "pod=~" not in query
