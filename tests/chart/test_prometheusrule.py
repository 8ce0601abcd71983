"""The PrometheusRule: its alerts, rendered by Helm, checked and run by Prometheus's own `promtool`
(`check rules`, then `test rules` over synthetic series of the names and labels the model servers
export and the ServiceMonitor gives them), so each alert fires for the model in trouble, after its
`for`, and for no other."""

from __future__ import annotations

import copy
import re

import jsonschema
import pytest
import yaml

from conftest import NON_DEFAULT_VALUES, by_kind, exported_series_names, one, render_objects, run_promtool as run

ON = {"prometheusRule": {"enabled": True}}
MODEL = "tandem_dev_hybridmodel"  # the ServiceMonitor's targetLabels entry, as a Prometheus label
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def closed(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


# Field names and types from the Prometheus Operator's PrometheusRule CRD (v1), only those used.
PROMETHEUS_RULE = closed({
    "apiVersion": {"const": "monitoring.coreos.com/v1"},
    "kind": {"const": "PrometheusRule"},
    "metadata": closed({"name": {"type": "string", "maxLength": 253}, "namespace": {"type": "string"},
                        "labels": STRING_MAP}, ["name", "namespace"]),
    "spec": closed({"groups": {"type": "array", "minItems": 1, "items": closed({
        "name": {"type": "string"},
        "rules": {"type": "array", "items": closed({
            "alert": {"type": "string"}, "expr": {"type": "string"}, "for": {"type": "string"},
            "labels": STRING_MAP, "annotations": STRING_MAP}, ["alert", "expr"])},
    }, ["name", "rules"])}}, ["groups"]),
}, ["apiVersion", "kind", "metadata", "spec"])


def groups(chart, values: dict) -> list[dict]:
    return one(render_objects(chart, values), "PrometheusRule")["spec"]["groups"]


@pytest.mark.parametrize("values", [ON, NON_DEFAULT_VALUES["everything"]], ids=["on", "everything"])
def test_prometheus_rule_shape(chart, values):
    jsonschema.validate(one(render_objects(chart, values), "PrometheusRule"), PROMETHEUS_RULE)


def test_the_shape_check_can_fail(chart):
    rule = copy.deepcopy(one(render_objects(chart, ON), "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["fro"] = "5m"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rule, PROMETHEUS_RULE)


def test_off_by_default(chart):
    assert not by_kind(render_objects(chart), "PrometheusRule")
    assert not by_kind(render_objects(chart, {"serviceMonitor": {"enabled": True}}), "PrometheusRule")


def test_every_series_the_rules_read_is_one_a_model_server_exports(chart):
    # A renamed metric would leave an alert that can never fire.
    exported = exported_series_names()
    exprs = [rule["expr"] for group in groups(chart, ON) for rule in group["rules"]]
    read = {name for expr in exprs for name in re.findall(r"\btandem_[a-z0-9_]+\b", expr)} - {MODEL}
    assert read and read <= exported, read - exported
    assert all(MODEL in expr for expr in exprs)  # each alert is per model


def write_rules(tmp_path, chart, values: dict):
    """The rendered groups as a rules file, and a copy without annotations for `promtool test rules`
    (which compares annotations whole: their templates are checked by `check rules`)."""
    rendered = groups(chart, values)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rendered}))
    bare = copy.deepcopy(rendered)
    for group in bare:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "bare.yaml").write_text(yaml.safe_dump({"groups": bare}))


@pytest.mark.parametrize("values", [ON, NON_DEFAULT_VALUES["everything"]], ids=["on", "everything"])
def test_promtool_accepts_the_rules_and_their_templates(chart, promtool, tmp_path, values):
    write_rules(tmp_path, chart, values)
    run(promtool, "check", "rules", "rules.yaml", cwd=tmp_path)


def test_promtool_can_refuse_a_rule(chart, promtool, tmp_path):
    broken = groups(chart, ON)
    broken[0]["rules"][1]["annotations"]["summary"] = "{{ $value | noSuchFunction }}"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": broken}))
    with pytest.raises(AssertionError, match="noSuchFunction"):
        run(promtool, "check", "rules", "rules.yaml", cwd=tmp_path)


def series(name: str, model: str, values: str, **labels: str) -> dict:
    labels = {"namespace": "models", MODEL: model, **labels}
    return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


def histogram(model: str, per_bucket: dict[str, int]) -> list[dict]:
    """A cumulative inter-token latency histogram growing by `per_bucket` observations a minute."""
    out, total = [], 0
    for le in ("0.1", "1", "2.5", "+Inf"):
        total += per_bucket.get(le, 0)
        out.append(series("tandem_inter_token_latency_seconds_bucket", model, f"0+{total}x40", le=le))
    return out


# One model in each kind of trouble, beside a healthy one; counters grow by the given amount a minute.
INPUT = [
    series("up", "down", "1x5 0x40", instance="10.0.0.1:9400", endpoint="metrics"),
    series("up", "healthy", "1x42", instance="10.0.0.2:9400", endpoint="metrics"),
    {"series": 'up{job="node-exporter",instance="10.0.0.3:9100"}', "values": "0x42"},  # not a model's
    *histogram("slow", {"2.5": 10}),  # p95 2.425 s
    *histogram("healthy", {"0.1": 10}),
    series("tandem_requests_total", "failing", "0+2x40", outcome="error"),
    series("tandem_requests_total", "failing", "0+8x40", outcome="stop"),  # 20% fail
    series("tandem_requests_total", "healthy", "0+10x40", outcome="stop"),
    series("tandem_requests_total", "healthy", "0+0x40", outcome="error"),
    series("tandem_requests_total", "busy", "0+1x40", outcome="resource_exhausted"),
    series("tandem_preemptions_total", "tight", "0+1x40"),
    series("tandem_preemptions_total", "healthy", "0+0x40"),
]


def alerts_test(expected: dict[str, str | None], extra_labels: dict[str, str], early: str, late: str) -> dict:
    """`expected`: alert -> the one model it fires for by `late` (None: it fires for none); at `early`
    (inside its `for`) none fires. The server-down alert's `for` is 5m whatever the values: its
    target is down from 5m on, so it is pending at 8m and firing at 12m."""
    severity = {"TandemModelServerDown": "critical", "TandemRequestsFailing": "critical"}
    checks = []
    for alert, model in expected.items():
        pending, firing = ("8m", "12m") if alert == "TandemModelServerDown" else (early, late)
        checks.append({"eval_time": pending, "alertname": alert, "exp_alerts": []})
        fired = [] if model is None else [{"exp_labels": {
            "namespace": "models", MODEL: model, "severity": severity.get(alert, "warning"), **extra_labels,
            **({"instance": "10.0.0.1:9400", "endpoint": "metrics"} if alert == "TandemModelServerDown" else {})}}]
        checks.append({"eval_time": firing, "alertname": alert, "exp_alerts": fired})
    return {"interval": "1m", "input_series": INPUT, "alert_rule_test": checks}


ALERTS = {"TandemModelServerDown": "down", "TandemInterTokenLatencyHigh": "slow", "TandemRequestsFailing": "failing",
          "TandemRequestsRejected": "busy", "TandemKVCachePreempting": "tight"}


@pytest.mark.parametrize("values, expected, early, late", [
    (ON, ALERTS, "8m", "20m"),
    # thresholds and `for` from the values: 2.425 s is under 3 s, 20% under 25%; 10m -> 3m
    ({"prometheusRule": {"enabled": True, "interTokenLatencyP95Seconds": 3, "failedRequestRatio": 0.25, "for": "3m",
                         "additionalLabels": {"team": "ml-platform"}}},
     ALERTS | {"TandemInterTokenLatencyHigh": None, "TandemRequestsFailing": None}, "2m", "8m"),
], ids=["defaults", "values"])
def test_each_alert_fires_for_the_model_in_trouble_after_its_for(chart, promtool, tmp_path, values, expected, early,
                                                                 late):
    write_rules(tmp_path, chart, values)
    extra = values["prometheusRule"].get("additionalLabels", {})
    test = {"rule_files": ["bare.yaml"], "evaluation_interval": "1m",
            "tests": [alerts_test(expected, extra, early, late)]}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    run(promtool, "test", "rules", "test.yaml", cwd=tmp_path)


def test_the_alert_test_can_fail(chart, promtool, tmp_path):
    # the same test against a rule file whose latency threshold was raised past the slow model's
    write_rules(tmp_path, chart, {"prometheusRule": {"enabled": True, "interTokenLatencyP95Seconds": 3}})
    test = {"rule_files": ["bare.yaml"], "evaluation_interval": "1m", "tests": [alerts_test(ALERTS, {}, "8m", "20m")]}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    with pytest.raises(AssertionError, match="TandemInterTokenLatencyHigh"):
        run(promtool, "test", "rules", "test.yaml", cwd=tmp_path)
