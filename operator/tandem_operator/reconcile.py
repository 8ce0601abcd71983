"""Reconcile one HybridModel: build its children from the spec, apply them, report status.

Idempotent: every handler (create, update, resume, a child's event, the periodic resync) calls the
same function, and calling it twice in a row changes nothing the second time.
"""

from __future__ import annotations

import logging

import kopf

from . import kube, names
from .apply import NotOwned, Outcome, adopt, apply
from .children import build_children
from .spec import HybridModelSpec, SpecError, check_name, parse_spec
from .status import DEGRADED, compute_status, invalid_spec_status, rejected_child_status
from .status_store import write_status
from .pod_secrets import pod_secrets_problem

# After a throttled (429) or failed (5xx) request, kopf retries the handler this much later.
RETRY_DELAY_SECONDS = 30
# A child's name taken by someone else's object: retried this much later, as nothing the operator
# watches tells it when that object is gone.
CONFLICT_RETRY_SECONDS = 60


def reconcile(body: dict, logger: logging.Logger | logging.LoggerAdapter, trigger: str) -> dict[str, Outcome]:
    """Bring the children and the status of HybridModel `body` in line with its spec.

    `trigger` names what started it, for events: "spec" (created or changed) or "drift".
    Raises kopf.PermanentError for an invalid spec or a child the API server rejects (after
    reporting it in status and an event), kopf.TemporaryError when the server may accept later
    or a child's name is taken by an object this HybridModel does not own (reported likewise).
    """
    meta = body["metadata"]
    namespace, name, generation = meta["namespace"], meta["name"], meta.get("generation")
    spec = checked_spec(body)
    owner = names.owner_reference(body)
    # A generation not yet reconciled is a spec change on its way (a child's event can come first):
    # its rollout is no repair of a hand edit.
    drift = trigger == "drift" and (body.get("status") or {}).get("observedGeneration") == generation
    outcomes = {}
    for child in build_children(spec, name, namespace):
        outcome = apply_child(body, adopt(child, owner))
        outcomes[child["kind"]] = outcome
        if outcome is not Outcome.UNCHANGED:
            logger.info("%s %s/%s %s", child["kind"], namespace, name, outcome.value)
            if drift:
                kopf.warn(body, reason="DriftRepaired",
                          message=f"{child['kind']} {name} {outcome.value} to match the spec")
    refresh_status(namespace, name, spec, generation)
    return outcomes


def checked_spec(body: dict) -> HybridModelSpec:
    """The parsed spec; an invalid one (or name) is reported in status and as an event, then raised."""
    try:
        check_name(body["metadata"]["name"])
        return parse_spec(body.get("spec"))
    except SpecError as e:
        report_failure(body, "InvalidSpec", str(e), *invalid_spec_status(str(e)))
        raise kopf.PermanentError(f"invalid spec: {e}") from None


def apply_child(body: dict, child: dict) -> Outcome:
    """apply(child), with the API server's refusals reported on the HybridModel `body`.

    A rejected child (invalid, forbidden) will be rejected again until the spec or the cluster
    changes: kopf.PermanentError. Anything else the server may accept later: kopf.TemporaryError,
    as is a name taken by another owner's object (left untouched), once that object is gone.
    """
    try:
        return apply(child)
    except NotOwned as e:
        report_failure(body, "ChildConflict", str(e), *rejected_child_status(str(e), "ChildConflict"))
        raise kopf.TemporaryError(str(e), delay=CONFLICT_RETRY_SECONDS) from None
    except kube.KubeError as e:
        what = f"{child['kind']} {child['metadata']['name']}"
        if not e.rejected:
            raise kopf.TemporaryError(f"{what}: {e}", delay=RETRY_DELAY_SECONDS) from None
        message = f"the API server rejected {what} (HTTP {e.status}): {e.message}"
        report_failure(body, "ChildRejected", message, *rejected_child_status(message))
        raise kopf.PermanentError(message) from None


def report_failure(body: dict, reason: str, message: str, fields: dict, conditions: list[dict]) -> None:
    """Write a failure's status; post its warning event once per generation, not on every retry."""
    meta = body["metadata"]
    namespace, name, generation = meta["namespace"], meta["name"], meta.get("generation")
    if not _reported(namespace, name, generation, reason, message):
        kopf.warn(body, reason=reason, message=message)
    write_status(namespace, name, fields, conditions, generation)


def _reported(namespace: str, name: str, generation: int | None, reason: str, message: str) -> bool:
    status = (kube.get(kube.HYBRIDMODELS, namespace, name) or {}).get("status") or {}
    degraded = next((c for c in status.get("conditions") or [] if c.get("type") == DEGRADED), {})
    return (status.get("observedGeneration") == generation and degraded.get("reason") == reason
            and degraded.get("message") == message)


def refresh_status(namespace: str, name: str, spec: HybridModelSpec, generation: int | None) -> dict | None:
    """Recompute replicas, phase and conditions from the Deployment, the pods and what they mount."""
    # The autoscaler may have changed spec.replicas since this handler's body was read.
    latest = kube.get(kube.HYBRIDMODELS, namespace, name) or {}
    desired = (latest.get("spec") or {}).get("replicas", spec.replicas)
    deployment = kube.get(kube.DEPLOYMENTS, namespace, name)
    pods = kube.list_labelled(kube.PODS, namespace, names.selector_labels(name))
    fields, conditions = compute_status(name, desired, deployment, pods, pod_secrets_problem(spec, namespace))
    fields["desiredReplicas"] = desired
    return write_status(namespace, name, fields, conditions, generation)


def live(body: dict) -> dict | None:
    """The server's copy of HybridModel `body`; None if it is gone, replaced (another uid) or being deleted."""
    meta = body["metadata"]
    current = kube.get(kube.HYBRIDMODELS, meta["namespace"], meta["name"])
    current_meta = (current or {}).get("metadata") or {}
    if current is None or current_meta.get("deletionTimestamp") or current_meta.get("uid") != meta.get("uid"):
        return None
    return current


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

