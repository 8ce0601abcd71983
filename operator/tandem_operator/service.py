"""The Service in front of a HybridModel's pods: gRPC for clients, metrics for Prometheus."""

from __future__ import annotations

from tandem import contract

from . import names
from .spec import HybridModelSpec


def build_service(spec: HybridModelSpec, name: str, namespace: str) -> dict:
    """A ClusterIP Service with the gRPC and metrics ports, selecting only Ready pods."""
    del spec  # the same ports for every spec; the parameter keeps all builders alike
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": names.common_labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": names.selector_labels(name),
            "ports": [
                {"name": "grpc", "port": contract.GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
                 "appProtocol": "kubernetes.io/h2c"},
                {"name": "metrics", "port": contract.METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }
