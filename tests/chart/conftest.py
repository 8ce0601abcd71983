"""Shared helpers for the chart tests: render with Helm's own engine, load the chart's tools."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

helm_python = pytest.importorskip("helm_python")

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "charts" / "tandem"
CRD_SOURCE = CHART_DIR / "crds" / "hybridmodels.tandem.dev.yaml"
EXAMPLES_DIR = REPO / "examples"
DOCKER_DIR = REPO / "docker"
RELEASE = "tandem"
NAMESPACE = "tandem-system"


@pytest.fixture(scope="session")
def promtool() -> str:
    """Prometheus's `promtool` (the Debian package `prometheus` ships it); skips without one, except
    in CI (.ci/run installs it), where it fails."""
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is not installed (apt-get install prometheus); CI must run this test")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return path


def run_promtool(promtool: str, *args: str, cwd) -> None:
    done = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def exported_series_names() -> set[str]:
    """Every series name the model servers export (both processes of a pair), as Prometheus reads them."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tandem.metrics import ExpertsMetrics, ServingMetrics

    return {sample.name for metrics in (ServingMetrics(), ExpertsMetrics())
            for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
            for sample in family.samples}


def load_hack(module: str):
    """Import a script from charts/tandem/hack (not a package: it is left out of the chart)."""
    path = CHART_DIR / "hack" / f"{module}.py"
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"tandem_chart_hack_{module}", path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


@pytest.fixture(scope="session")
def chart():
    with helm_python.Chart.load(CHART_DIR) as loaded:
        yield loaded


_RENDERED: dict[tuple[int, str, str, str], list[dict[str, Any]]] = {}


def render_objects(chart, values: dict[str, Any] | None = None, *, release: str = RELEASE,
                   namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """Every Kubernetes object the chart renders for `values` (NOTES.txt excluded).

    Renders are cached per values (the machine is shared; tests stay fast) and handed out as
    copies, so a test may change what it gets.
    """
    key = (id(chart), json.dumps(values or {}, sort_keys=True), release, namespace)
    if key not in _RENDERED:
        manifests = chart.render(values or {}, name=release, namespace=namespace)
        objects = []
        for path, text in sorted(manifests.items()):
            if not path.endswith(".txt"):
                objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
        _RENDERED[key] = objects
    return copy.deepcopy(_RENDERED[key])


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def load_example_documents(name: str) -> list[dict[str, Any]]:
    """Every object in examples/`name`, in order."""
    return [doc for doc in yaml.safe_load_all((EXAMPLES_DIR / name).read_text()) if doc]


def load_example(name: str) -> dict[str, Any]:
    """The one HybridModel in examples/`name` (beside it there may be what it needs, e.g. a Certificate)."""
    (model,) = [doc for doc in load_example_documents(name) if doc.get("kind") == "HybridModel"]
    return model


# Value sets that switch on every optional part of the chart, used by several test modules.
NON_DEFAULT_VALUES: dict[str, dict[str, Any]] = {
    "namespaced": {
        "operator": {"watchNamespaces": ["models", "research"], "logLevel": "debug",
                     "logFormat": "plain"},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    },
    "everything": {
        "fullnameOverride": "tandem-ops",
        "crds": {"enabled": True, "keep": False},
        "operator": {
            "image": {"repository": "registry.example.com/tandem/operator",
                      "digest": "sha256:" + "a" * 64, "pullPolicy": "Always"},
            "imagePullSecrets": [{"name": "regcred"}],
            "env": [{"name": "TANDEM_PROMETHEUS_URL", "value": "http://prometheus:9090"},
                    {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
            "podAnnotations": {"example.com/team": "ml-platform"},
            "podLabels": {"team": "ml-platform"},
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "node-role.kubernetes.io/control-plane", "operator": "DoesNotExist"},
                ]}]}}},
            "priorityClassName": "system-cluster-critical",
            "logLevel": "quiet",
            "replicas": 3,
            "leaderElection": {"enabled": True, "leaseDurationSeconds": 30, "renewDeadlineSeconds": 20,
                               "retryPeriodSeconds": 4},
        },
        "serviceAccount": {"create": True, "name": "tandem-sa",
                           "annotations": {"iam.example.com/role": "tandem"}},
        "serviceMonitor": {"enabled": True, "interval": "30s", "scrapeTimeout": "20s",
                           "namespaces": ["models"]},
        "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}, "additionalLabels": {"team": "ml"},
                           "for": "15m", "interTokenLatencyP95Seconds": 0.25, "failedRequestRatio": 0.01},
        "grafanaDashboard": {"enabled": True, "labels": {"grafana_dashboard": "tandem"},
                             "annotations": {"grafana_folder": "Tandem"}, "namespace": "monitoring"},
        "hybridModel": {"enabled": True, "name": "mixtral",
                        "spec": load_example("mixtral-8x7b.yaml")["spec"]},
    },
    "no-leader-election": {
        "operator": {"leaderElection": {"enabled": False}},
    },
    "bring-your-own": {
        "crds": {"enabled": False},
        "rbac": {"create": False},
        "serviceAccount": {"create": False, "name": "existing-operator"},
    },
}
