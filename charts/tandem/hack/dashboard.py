"""Write the Grafana dashboard the chart ships (files/grafana-dashboard.json) from the panels below.

    python charts/tandem/hack/dashboard.py          # rewrite
    python charts/tandem/hack/dashboard.py --check  # exit 1 if the file would change

One dashboard for every HybridModel: variables pick the namespace and the model (the
`tandem_dev_hybridmodel` label the chart's ServiceMonitor gives every series); the panels read the
series both processes of a model's pods export (tandem.contract's names).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "files" / "grafana-dashboard.json"
UID = "tandem-models"
MODEL = "tandem_dev_hybridmodel"
SELECTOR = f'namespace="$namespace", {MODEL}="$model"'
RATE = "$__rate_interval"


def rate(name: str, by: str = "", match: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({name}{{{SELECTOR}{match}}}[{RATE}]))"


def quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, {rate(histogram + '_bucket', 'le')})"


def gauge(name: str, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} ({name}{{{SELECTOR}}})"


# (title, unit, [(legend, PromQL)]), two panels a row
PANELS = [
    ("Requests by outcome", "reqps", [("{{outcome}}", rate("tandem_requests_total", "outcome"))]),
    ("Tokens", "short", [("prompt /s", rate("tandem_prompt_tokens_total")),
                         ("generated /s", rate("tandem_generated_tokens_total")),
                         ("prompt, from the prefix cache /s", rate("tandem_prefix_cached_tokens_total"))]),
    ("Time to first token", "s", [("p50", quantile(0.5, "tandem_time_to_first_token_seconds")),
                                  ("p95", quantile(0.95, "tandem_time_to_first_token_seconds"))]),
    ("Inter-token latency", "s", [("p50", quantile(0.5, "tandem_inter_token_latency_seconds")),
                                  ("p95", quantile(0.95, "tandem_inter_token_latency_seconds"))]),
    ("Queue time and request latency (p95)", "s", [
        ("queue", quantile(0.95, "tandem_request_queue_time_seconds")),
        ("end to end", quantile(0.95, "tandem_e2e_request_latency_seconds"))]),
    ("Requests in the engine", "short", [("running", gauge("tandem_running_requests")),
                                         ("waiting", gauge("tandem_waiting_requests")),
                                         ("running on the CPU KV tier", gauge("tandem_offloaded_requests"))]),
    ("KV cache blocks in use", "percentunit", [
        ("{{tier}}", f"{gauge('tandem_kv_blocks_used', 'tier')} / {gauge('tandem_kv_blocks_capacity', 'tier')}")]),
    ("Preemptions", "short", [("/s", rate("tandem_preemptions_total"))]),
    ("Routed experts: call latency (p95)", "s", [
        ("attention side, a call", quantile(0.95, "tandem_expert_call_latency_seconds")),
        ("experts process, computing", quantile(0.95, "tandem_experts_forward_latency_seconds"))]),
    ("Routed experts: work", "short", [
        ("tokens computed /s (once a MoE layer)", rate("tandem_experts_forward_tokens_total")),
        ("prefill layer calls on the GPU /s", rate("tandem_gpu_prefill_expert_calls_total"))]),
    ("Attention over the CPU KV tier (p95)", "s", [
        ("attention side, a call", quantile(0.95, "tandem_cpu_attention_latency_seconds")),
        ("experts process, computing", quantile(0.95, "tandem_experts_cpu_attention_latency_seconds"))]),
]


def variable(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": {"type": "prometheus", "uid": "$datasource"},
            "query": {"query": query, "refId": name}, "definition": query, "refresh": 2, "sort": 1,
            "includeAll": False, "multi": False}


def dashboard() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "datasource": {"type": "prometheus", "uid": "$datasource"},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend}
                        for j, (legend, expr) in enumerate(targets)],
        })
    return {
        "uid": UID, "title": "Tandem: hybrid MoE models", "tags": ["tandem"], "timezone": "browser",
        "schemaVersion": 39, "editable": True, "refresh": "30s", "time": {"from": "now-3h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus"},
            variable("namespace", "Namespace", "label_values(tandem_requests_total, namespace)"),
            variable("model", "HybridModel", f'label_values(tandem_requests_total{{namespace="$namespace"}}, {MODEL})'),
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python charts/tandem/hack/dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
