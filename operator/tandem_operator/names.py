"""Names shared by the CRD, the builders and the handlers: API coordinates, labels, child names."""

from __future__ import annotations

GROUP = "tandem.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "HybridModel"
PLURAL = "hybridmodels"

OPERATOR_NAME = "tandem-operator"

# The label that ties a child (and its pods) to its HybridModel. Also the selector: a name of
# its own, so it never collides with labels the Helm chart puts on the operator itself.
MODEL_LABEL = f"{GROUP}/hybridmodel"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"

# Container names, also what users see in `kubectl logs -c`.
ATTENTION = "attention"
EXPERTS = "experts"


def selector_labels(name: str) -> dict[str, str]:
    """The labels that select one HybridModel's pods (immutable once a Deployment exists)."""
    return {MODEL_LABEL: name}


def common_labels(name: str) -> dict[str, str]:
    """Labels on every child object and pod of one HybridModel."""
    return {
        "app.kubernetes.io/name": "tandem",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "hybridmodel",
        MANAGED_BY_LABEL: OPERATOR_NAME,
        **selector_labels(name),
    }


def selector_string(name: str) -> str:
    """The label selector as the scale subresource reports it (`.status.selector`)."""
    return ",".join(f"{key}={value}" for key, value in selector_labels(name).items())


def owner_reference(owner: dict) -> dict:
    """A controller owner reference to `owner` (a HybridModel body), for garbage collection."""
    meta = owner.get("metadata") or {}
    missing = [key for key in ("name", "uid") if not meta.get(key)]
    if missing:
        raise ValueError(f"cannot own children: the HybridModel has no metadata.{missing[0]}")
    return {
        "apiVersion": owner.get("apiVersion") or API_VERSION,
        "kind": owner.get("kind") or KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
