"""All child objects of one HybridModel, built from its spec by pure functions."""

from __future__ import annotations

from .deployment import build_deployment
from .disruption import build_pod_disruption_budget
from .service import build_service
from .spec import HybridModelSpec


def build_children(spec: HybridModelSpec, name: str, namespace: str) -> list[dict]:
    """The Deployment, Service and PodDisruptionBudget, in the order they are applied."""
    return [
        build_deployment(spec, name, namespace),
        build_service(spec, name, namespace),
        build_pod_disruption_budget(spec, name, namespace),
    ]
