"""The Grafana dashboard: written by hack/dashboard.py (no drift), shipped in a ConfigMap for Grafana's
sidecar, and every panel's query valid PromQL (Prometheus's own `promtool` parses them, as recording
rules) over series the model servers really export."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from conftest import (CHART_DIR, NON_DEFAULT_VALUES, by_kind, exported_series_names, load_hack, one, render_objects,
                      run_promtool as run)

ON = {"grafanaDashboard": {"enabled": True}}
DASHBOARD = CHART_DIR / "files" / "grafana-dashboard.json"


def queries(board: dict) -> list[str]:
    return [target["expr"] for panel in board["panels"] for target in panel["targets"]]


def concrete(expr: str) -> str:
    """A panel's query as Grafana sends it: its variables replaced."""
    return expr.replace("$namespace", "models").replace("$model", "mixtral").replace("$__rate_interval", "1m")


def test_the_file_is_what_the_script_writes():
    done = subprocess.run([sys.executable, str(CHART_DIR / "hack" / "dashboard.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(DASHBOARD.read_text()) == load_hack("dashboard").dashboard()


def test_shipped_in_a_configmap_for_the_sidecar(chart):
    assert not [c for c in by_kind(render_objects(chart), "ConfigMap") if "tandem.json" in c.get("data", {})]
    config_map = one(render_objects(chart, ON), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "tandem-system"
    assert json.loads(config_map["data"]["tandem.json"]) == json.loads(DASHBOARD.read_text())
    elsewhere = one(render_objects(chart, NON_DEFAULT_VALUES["everything"]), "ConfigMap")
    assert elsewhere["metadata"]["namespace"] == "monitoring"
    assert elsewhere["metadata"]["labels"]["grafana_dashboard"] == "tandem"
    assert elsewhere["metadata"]["annotations"] == {"grafana_folder": "Tandem"}


def test_every_query_is_promql_promtool_accepts(promtool, tmp_path):
    board = json.loads(DASHBOARD.read_text())
    rules = [{"record": f"tandem:panel_query_{i}", "expr": concrete(expr)} for i, expr in enumerate(queries(board))]
    rules += [{"record": "tandem:variable", "expr": re.sub(r"label_values\((.*), [a-z_]+\)", r"\1",
                                                         concrete(v["query"]["query"]))}
              for v in board["templating"]["list"] if v["type"] == "query"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run(promtool, "check", "rules", "rules.yaml", cwd=tmp_path)
    rules[0]["expr"] = rules[0]["expr"].replace("sum by (outcome) (", "sum by (outcome (")  # and can refuse one
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    with pytest.raises(AssertionError):
        run(promtool, "check", "rules", "rules.yaml", cwd=tmp_path)


def test_every_series_a_panel_reads_is_one_a_model_server_exports():
    exported = exported_series_names()
    board = json.loads(DASHBOARD.read_text())
    read = {name for expr in queries(board) for name in re.findall(r"\btandem_[a-z0-9_]+\b", expr)}
    read -= {"tandem_dev_hybridmodel"}
    assert read and read <= exported, read - exported
    # every exported family has a panel, so a new metric is not forgotten here
    families = {re.sub(r"_(bucket|sum|count)$", "", name) for name in exported}
    shown = {re.sub(r"_bucket$", "", name) for name in read}
    assert families <= shown, families - shown
    assert all('tandem_dev_hybridmodel="$model"' in expr for expr in queries(board))


def test_panels_have_their_own_ids_and_places():
    board = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in board["panels"]]
    places = {(panel["gridPos"]["x"], panel["gridPos"]["y"]) for panel in board["panels"]}
    assert len(set(ids)) == len(ids) == len(places)
