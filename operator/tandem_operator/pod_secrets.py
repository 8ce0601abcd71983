"""Whether the Secrets (and ConfigMap) a HybridModel's pods take hold what they need: `spec.tls`'s
certificate and client CA, which the attention container mounts, and `spec.apiKeySecret`'s key, its
TANDEM_API_KEY.

The kubelet reads them; one missing, or missing a key, leaves new pods in ContainerCreating (or
CreateContainerConfigError), said only in the pods' Events. The reconciler checks them at every
reconcile, the periodic resync included, and reports what is missing as Degraded with reason
TLSSecretInvalid or APIKeySecretInvalid, which clears once they are fixed. Each is read one by name
(the operator may `get` Secrets and ConfigMaps, not list or watch them), and only its keys are
looked at: no message carries a value.
"""

from __future__ import annotations

from . import kube
from .spec import HybridModelSpec, TLSSpec
from .spec_fields import TLS_CERT_KEY, TLS_KEY_KEY, SecretKeyRef

REASON = "TLSSecretInvalid"
API_KEY_REASON = "APIKeySecretInvalid"

Getter = kube.ObjectGetter


def pod_secrets_problem(spec: HybridModelSpec, namespace: str) -> tuple[str, str] | None:
    """(reason, what is missing) for the first Secret, ConfigMap or key the pods cannot take; None when none is."""
    return tls_problem(spec.tls, namespace) or api_key_problem(spec.apiKeySecret, namespace)


def api_key_problem(ref: SecretKeyRef | None, namespace: str,
                    get_secret: Getter | None = None) -> tuple[str, str] | None:
    """(API_KEY_REASON, what is missing) when spec.apiKeySecret's Secret or key is; None when it is there."""
    if ref is None:
        return None
    message = _missing(get_secret or kube.get_secret, namespace, ref.name, (ref.key,),
                       f"spec.apiKeySecret: Secret {namespace}/{ref.name}")
    return None if message is None else (API_KEY_REASON, message)


def tls_problem(tls: TLSSpec | None, namespace: str, get_secret: Getter | None = None,
                get_config_map: Getter | None = None) -> tuple[str, str] | None:
    """(REASON, what is missing) for the first object or key the pods cannot mount; None when none is.

    A server error other than a refusal raises kube.KubeError: the check is retried with the reconcile.
    """
    if tls is None:
        return None
    get_secret = get_secret or kube.get_secret
    get_config_map = get_config_map or kube.get_config_map
    wanted = [("spec.tls.certSecret", "Secret", get_secret, tls.certSecret.name, (TLS_CERT_KEY, TLS_KEY_KEY))]
    if tls.clientCASecret is not None:
        ref = tls.clientCASecret
        wanted.append(("spec.tls.clientCASecret", "Secret", get_secret, ref.name, (ref.key,)))
    if tls.clientCAConfigMap is not None:
        ref = tls.clientCAConfigMap
        wanted.append(("spec.tls.clientCAConfigMap", "ConfigMap", get_config_map, ref.name, (ref.key,)))
    for where, noun, get, name, keys in wanted:
        message = _missing(get, namespace, name, keys, f"{where}: {noun} {namespace}/{name}")
        if message is not None:
            return REASON, message
    return None


def _missing(get: Getter, namespace: str, name: str, keys: tuple[str, ...], what: str) -> str | None:
    try:
        found = get(namespace, name)
    except kube.KubeError as e:
        if not e.rejected:
            raise
        return f"{what} cannot be read to check it (HTTP {e.status}: {e.message}): the operator needs `get` on it"
    if found is None:
        return f"{what} not found: new pods wait for it in ContainerCreating"
    # A Secret's and a ConfigMap's text in `data`; a ConfigMap's other bytes in `binaryData`.
    data = {**(found.get("binaryData") or {}), **(found.get("data") or {})}
    for key in keys:
        if key not in data:
            return f"{what} has no key {key!r} (its keys: {', '.join(sorted(data)) or 'none'})"
        if not data[key]:
            return f"{what} key {key!r} is empty"
    return None

