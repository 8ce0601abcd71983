"""End to end: the chart's alerting rules, rendered by Helm, loaded by a real Prometheus that scrapes a
real `tandem serve` under load, labelled as the ServiceMonitor labels a model's series. Every rule
evaluates without error on the real series, the latency alert fires for the model once its threshold
(set below any real decode) is crossed, and the server-down alert does not.

Prometheus comes from the Debian package (installed by .ci/run); on CI a missing binary is a
failure, elsewhere a skip (conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from tandem_operator.metrics_source import MODEL_SERIES_LABEL

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from tandem_serve import drive_load, tandem_serve  # noqa: E402

from prometheus_process import prometheus_process, wait_until  # noqa: E402

helm_python = pytest.importorskip("helm_python")

CHART = Path(__file__).resolve().parents[2] / "charts" / "tandem"
NAMESPACE, NAME = "models", "mixtral"
# below any real decode step, and short `for`s: the alert fires within seconds of the load
RULE_VALUES = {"prometheusRule": {"enabled": True, "for": "1s", "interTokenLatencyP95Seconds": 1e-6}}


def rendered_rules() -> dict:
    with helm_python.Chart.load(CHART) as chart:
        manifests = chart.render(RULE_VALUES, name="tandem", namespace="tandem-system")
    [rule] = [doc for path, text in manifests.items() if not path.endswith(".txt")
              for doc in yaml.safe_load_all(text) if doc and doc.get("kind") == "PrometheusRule"]
    return {"groups": rule["spec"]["groups"]}


def api(url: str, path: str) -> dict:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{url}{path}", timeout=5) as r:
        return json.loads(r.read())["data"]


def test_the_charts_alerts_evaluate_on_real_series_and_fire(prometheus_binary, tmp_path):
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rendered_rules()))
    with tandem_serve(tmp_path / "serve") as server:
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(tmp_path / "rules.yaml")],
            "scrape_configs": [{"job_name": "tandem", "static_configs": [{
                "targets": [f"127.0.0.1:{server.metrics_port}"],
                "labels": {"namespace": NAMESPACE, MODEL_SERIES_LABEL: NAME}}]}],
        }

        def ready(url):
            try:
                return api(url, "/api/v1/targets")["activeTargets"][0]["health"] == "up"
            except (OSError, KeyError, IndexError, ValueError):
                return False

        with prometheus_process(prometheus_binary, tmp_path, config, ready=ready) as (url, process):
            assert asyncio.run(drive_load(server.address)) > 0

            def firing():
                alerts = api(url, "/api/v1/alerts")["alerts"]
                return [a for a in alerts if a["state"] == "firing"] or None

            fired = wait_until(firing, "an alert to fire", process, tmp_path / "prometheus.log")
            assert [a["labels"]["alertname"] for a in fired] == ["TandemInterTokenLatencyHigh"]
            assert fired[0]["labels"][MODEL_SERIES_LABEL] == NAME and fired[0]["labels"]["namespace"] == NAMESPACE
            assert float(fired[0]["value"]) > 1e-6
            rules = [r for g in api(url, "/api/v1/rules")["groups"] for r in g["rules"]]
            assert len(rules) == 5 and all(r["health"] == "ok" for r in rules), rules
