"""Reconcile one HybridModel: build its children from the spec, apply them, report status.

Idempotent: every handler (create, update, resume, a child's event, the resync timer) calls the
same function, and calling it twice in a row changes nothing the second time.
"""

from __future__ import annotations

import logging

import kopf

from . import kube, names
from .apply import Outcome, adopt, apply
from .children import build_children
from .spec import HybridModelSpec, SpecError, parse_spec
from .status import compute_status, invalid_spec_status
from .status_store import write_status

CHILDREN = (kube.DEPLOYMENTS, kube.SERVICES, kube.PDBS)


def reconcile(body: dict, logger: logging.Logger | logging.LoggerAdapter, trigger: str) -> dict[str, Outcome]:
    """Bring the children and the status of HybridModel `body` in line with its spec.

    `trigger` names what started it, for events: "spec" (created or changed) or "drift".
    Raises kopf.PermanentError for an invalid spec (after reporting it in status and an event).
    """
    meta = body["metadata"]
    namespace, name, generation = meta["namespace"], meta["name"], meta.get("generation")
    spec = checked_spec(body)
    owner = names.owner_reference(body)
    outcomes = {}
    for child in build_children(spec, name, namespace):
        outcome = apply(adopt(child, owner))
        outcomes[child["kind"]] = outcome
        if outcome is not Outcome.UNCHANGED:
            logger.info("%s %s/%s %s", child["kind"], namespace, name, outcome.value)
            if trigger == "drift":
                kopf.warn(body, reason="DriftRepaired", message=f"{child['kind']} {name} {outcome.value} to match the spec")
    refresh_status(namespace, name, spec, generation)
    return outcomes


def checked_spec(body: dict) -> HybridModelSpec:
    """The parsed spec; an invalid one is reported in status and as an event, then raised."""
    meta = body["metadata"]
    try:
        return parse_spec(body.get("spec"))
    except SpecError as e:
        fields, conditions = invalid_spec_status(str(e))
        write_status(meta["namespace"], meta["name"], fields, conditions, meta.get("generation"))
        kopf.warn(body, reason="InvalidSpec", message=str(e))
        raise kopf.PermanentError(f"invalid spec: {e}") from None


def refresh_status(namespace: str, name: str, spec: HybridModelSpec, generation: int | None) -> dict | None:
    """Recompute replicas, phase and conditions from the Deployment and the pods."""
    # The autoscaler may have changed spec.replicas since this handler's body was read.
    latest = kube.get(kube.HYBRIDMODELS, namespace, name) or {}
    desired = (latest.get("spec") or {}).get("replicas", spec.replicas)
    deployment = kube.get(kube.DEPLOYMENTS, namespace, name)
    pods = kube.list_labelled(kube.PODS, namespace, names.selector_labels(name))
    fields, conditions = compute_status(name, desired, deployment, pods)
    fields["desiredReplicas"] = desired
    return write_status(namespace, name, fields, conditions, generation)


def owner_of(child: dict) -> dict | None:
    """The live HybridModel a child belongs to; None if it is gone or being deleted."""
    meta = child.get("metadata") or {}
    name = (meta.get("labels") or {}).get(names.MODEL_LABEL)
    if not name or not meta.get("namespace"):
        return None
    owner = kube.get(kube.HYBRIDMODELS, meta["namespace"], name)
    if owner is None or (owner.get("metadata") or {}).get("deletionTimestamp"):
        return None
    return owner


def delete_children(namespace: str, name: str, logger: logging.Logger | logging.LoggerAdapter) -> None:
    """Delete the children now rather than wait for the garbage collector.

    Without permission to delete (403) the owner references still let the garbage collector
    remove them, so that is logged, not raised.
    """
    for resource in CHILDREN:
        try:
            if kube.delete(resource, namespace, name):
                logger.info("deleted %s %s/%s", resource.kind, namespace, name)
        except kube.KubeError as e:
            if e.status != 403:
                raise
            logger.warning("cannot delete %s %s/%s (%s); leaving it to the garbage collector",
                           resource.kind, namespace, name, e)
