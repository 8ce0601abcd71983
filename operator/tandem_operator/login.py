"""Credentials for both kopf and the `kubernetes` client the children are applied with.

In a cluster: the pod's ServiceAccount. Outside: the kubeconfig named by $KUBECONFIG (read at
login time, not import time) or ~/.kube/config, as kubectl and `kopf run` do.
"""

from __future__ import annotations

import os
from typing import Any

import kopf
import kubernetes.client
import kubernetes.config


def configure_client() -> kubernetes.client.Configuration:
    """Load in-cluster or kubeconfig credentials into the client's default configuration."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        try:
            kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
        except (kubernetes.config.ConfigException, OSError) as e:
            raise kopf.LoginError(f"no in-cluster ServiceAccount and no usable kubeconfig: {e}") from None
    return kubernetes.client.Configuration.get_default_copy()


def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    """kopf's login handler: the same credentials for kopf's own API calls."""
    config = configure_client()
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0] if parts else None)
    return kopf.ConnectionInfo(
        server=config.host,
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl,
        username=config.username or None,
        password=config.password or None,
        scheme=scheme,
        token=token,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
        trust_env=settings.networking.trust_env,
    )
