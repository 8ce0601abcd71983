"""The Deployment that runs a HybridModel's replicas."""

from __future__ import annotations

from . import names
from .pod import build_pod_template
from .spec import HybridModelSpec


def build_deployment(spec: HybridModelSpec, name: str, namespace: str) -> dict:
    """One pod per replica; rolls out one pod at a time without surging.

    No surge: with one pod per node and GPUs scarce, a surge pod usually has nowhere to go and
    would stall the rollout.
    """
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": names.common_labels(name)},
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": names.selector_labels(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "revisionHistoryLimit": 5,
            "template": build_pod_template(spec, name),
        },
    }
