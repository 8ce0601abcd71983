"""The Service in front of a HybridModel's pods: gRPC for clients, metrics for Prometheus.

Both processes of a pod export metrics, each on a port of its own: the attention server on
`metrics` and the experts process on `expert-metrics`. The chart's ServiceMonitor scrapes both
ports by name; every pod the operator renders has both containers, so neither port is ever an
endpoint without a target (tests/operator/test_builders.py checks each names a container port).
"""

from __future__ import annotations

from tandem import contract

from . import names
from .containers import EXPERTS_METRICS_PORT_NAME
from .spec import HybridModelSpec


def build_service(spec: HybridModelSpec, name: str, namespace: str) -> dict:
    """A ClusterIP Service with the gRPC port and both containers' metrics ports, selecting only Ready pods."""
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
                {"name": EXPERTS_METRICS_PORT_NAME, "port": contract.EXPERTS_METRICS_PORT,
                 "targetPort": EXPERTS_METRICS_PORT_NAME, "protocol": "TCP"},
            ],
        },
    }
