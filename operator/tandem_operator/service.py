"""The Service in front of a HybridModel's pods: gRPC for clients, metrics for Prometheus.

Both processes of a pod export metrics, each on a port of its own: the attention server on
`metrics` and the experts process on `expert-metrics`. The chart's ServiceMonitor scrapes both
ports by name; every pod the operator renders has both containers, so neither port is ever an
endpoint without a target (tests/operator/test_builders.py checks each names a container port).

The gRPC port is HTTP/2 over cleartext (`kubernetes.io/h2c`, which Gateway API implementations
read), or with `spec.tls` over TLS, for which Kubernetes defines no appProtocol: it is left out, and
a gateway in front needs a BackendTLSPolicy for it.
"""

from __future__ import annotations

from tandem import contract

from . import names
from .containers import EXPERTS_METRICS_PORT_NAME
from .spec import HybridModelSpec


def build_service(spec: HybridModelSpec, name: str, namespace: str) -> dict:
    """A ClusterIP Service with the gRPC port and both containers' metrics ports, selecting only Ready pods."""
    # None, not missing, over TLS: the operator owns the key, so turning TLS on takes it off the Service.
    app_protocol = "kubernetes.io/h2c" if spec.tls is None else None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": names.common_labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": names.selector_labels(name),
            "ports": [
                {"name": "grpc", "port": contract.GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
                 "appProtocol": app_protocol},
                {"name": "metrics", "port": contract.METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
                {"name": EXPERTS_METRICS_PORT_NAME, "port": contract.EXPERTS_METRICS_PORT,
                 "targetPort": EXPERTS_METRICS_PORT_NAME, "protocol": "TCP"},
            ],
        },
    }
