"""The Deployment that runs a HybridModel's replicas."""

from __future__ import annotations

from . import names
from .containers import STARTUP_BUDGET_SECONDS
from .pod import build_pod_template
from .spec import HybridModelSpec

# A pod may take the startup probe's whole budget to load; on top of it, time to schedule the pod
# and pull a multi-GB CUDA image. The default 600 s would mark a healthy load as stuck.
PROGRESS_MARGIN_SECONDS = 900
PROGRESS_DEADLINE_SECONDS = STARTUP_BUDGET_SECONDS + PROGRESS_MARGIN_SECONDS


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
            "progressDeadlineSeconds": PROGRESS_DEADLINE_SECONDS,
            "template": build_pod_template(spec, name),
        },
    }
