"""The pod template of a HybridModel replica: two containers, shared volumes, placement, security.

The volumes: the model (any volume source from the spec, read-only) and emptyDirs: the experts'
Unix socket, /tmp, and two of medium Memory whose files both containers map: the CPU KV tier and
the experts' stored weights. With `spec.tls`, the Secret (and the client CA's Secret or ConfigMap)
the attention container serves TLS with.
"""

from __future__ import annotations

from tandem import contract

from . import names, placement
from .containers import (CLIENT_CA_FILE, CLIENT_CA_VOLUME, EXPERTS_VOLUME, KV_VOLUME, MODEL_VOLUME, SOCKET_VOLUME,
                         TLS_VOLUME, TMP_VOLUME, build_attention_container, build_experts_container)
from .spec import HybridModelSpec, TLSSpec
from .spec_fields import TLS_CERT_KEY, TLS_KEY_KEY

# A fixed unprivileged uid/gid (the distroless "nonroot" user), so runAsNonRoot holds even for
# images whose USER is a name the kubelet cannot check.
NONROOT_ID = 65532
TERMINATION_GRACE_SECONDS = 60
# The kubelet writes Secret and ConfigMap volumes' files owned by root, in group fsGroup: readable by
# the group, the servers' NONROOT_ID, and by nobody else.
TLS_FILE_MODE = 0o440


def build_pod_template(spec: HybridModelSpec, name: str) -> dict:
    """The Deployment's pod template for HybridModel `name`."""
    pod_spec = {
        "containers": [build_attention_container(spec), build_experts_container(spec)],
        "volumes": build_volumes(spec),
        "affinity": placement.build_affinity(spec, name),
        "tolerations": placement.build_tolerations(spec),
        "securityContext": build_pod_security_context(),
        # The pods talk to nothing in the cluster's API, and service env vars are noise.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        # None when the spec has none: the key is still ours, so taking it out of the spec takes
        # it off the Deployment (tandem_operator.apply).
        "nodeSelector": placement.build_node_selector(spec) or None,
        "imagePullSecrets": [dict(secret) for secret in spec.imagePullSecrets] or None,
    }
    return {
        "metadata": {
            "labels": names.common_labels(name),
            # Read by the usual `kubernetes-pods` Prometheus scrape job.
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(contract.METRICS_PORT),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod_spec,
    }


def build_volumes(spec: HybridModelSpec) -> list[dict]:
    """The model volume (any volume source from the spec) and four emptyDirs."""
    kv_tier = {"medium": "Memory"}
    if spec.kvCache.cpuTierGiB > 0:
        # 1 MiB over the tier for its small layout file (tier.layout.json) beside it.
        kv_tier["sizeLimit"] = f"{spec.kvCache.cpuTierGiB * 1024 + 1}Mi"
    return [
        {"name": MODEL_VOLUME, **spec.model.volume},
        {"name": SOCKET_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        {"name": KV_VOLUME, "emptyDir": kv_tier},
        # The experts container writes the weights, so their tmpfs pages are charged to it: its
        # memory limit bounds them already, and bounds the volume.
        {"name": EXPERTS_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": spec.experts.memory}},
        {"name": TMP_VOLUME, "emptyDir": {"sizeLimit": "1Gi"}},
        *([] if spec.tls is None else build_tls_volumes(spec.tls)),
    ]


def build_tls_volumes(tls: TLSSpec) -> list[dict]:
    """The certificate's Secret and the client CA's Secret or ConfigMap, each with only the keys it serves."""
    volumes = [{"name": TLS_VOLUME, "secret": {
        "secretName": tls.certSecret.name, "items": [_item(TLS_CERT_KEY), _item(TLS_KEY_KEY)],
        "defaultMode": TLS_FILE_MODE}}]
    if tls.clientCASecret is not None:
        volumes.append({"name": CLIENT_CA_VOLUME, "secret": {
            "secretName": tls.clientCASecret.name, "items": [_item(tls.clientCASecret.key, CLIENT_CA_FILE)],
            "defaultMode": TLS_FILE_MODE}})
    if tls.clientCAConfigMap is not None:
        volumes.append({"name": CLIENT_CA_VOLUME, "configMap": {
            "name": tls.clientCAConfigMap.name, "items": [_item(tls.clientCAConfigMap.key, CLIENT_CA_FILE)],
            "defaultMode": TLS_FILE_MODE}})
    return volumes


def build_pod_security_context() -> dict:
    """Pod-wide: non-root user and group, the runtime's default seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": NONROOT_ID,
        "runAsGroup": NONROOT_ID,
        "fsGroup": NONROOT_ID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _item(key: str, path: str | None = None) -> dict:
    return {"key": key, "path": path or key}
