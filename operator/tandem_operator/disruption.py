"""The PodDisruptionBudget: node drains take a HybridModel's replicas down one at a time."""

from __future__ import annotations

from . import names
from .spec import HybridModelSpec


def build_pod_disruption_budget(spec: HybridModelSpec, name: str, namespace: str) -> dict:
    """At most one pod voluntarily disrupted at once; broken pods may always be evicted."""
    del spec
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": namespace, "labels": names.common_labels(name)},
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": names.selector_labels(name)},
            # A crash-looping pod must not block a node drain.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
