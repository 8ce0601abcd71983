"""The HybridModel's status, computed from its Deployment and pods by pure functions.

Conditions follow the Kubernetes convention (type, status, reason, message,
lastTransitionTime): Ready, Progressing and Degraded come from here; ScalingActive comes from
the autoscaler. A condition keeps its lastTransitionTime while its status stays the same.
"""

from __future__ import annotations

import datetime as dt
from typing import Iterable

from . import names

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
SCALING_ACTIVE = "ScalingActive"

# Container waiting reasons that will not fix themselves.
_STUCK_REASONS = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError",
                  "CreateContainerError", "InvalidImageName")


def now_iso(now: dt.datetime | None = None) -> str:
    """RFC 3339 in UTC with a Z, as Kubernetes writes times."""
    now = now or dt.datetime.now(dt.timezone.utc)
    return now.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, ok: bool, reason: str, message: str = "", generation: int | None = None) -> dict:
    """A condition without its transition time (set by merge_conditions); `generation` is the
    HybridModel's metadata.generation it was computed from, as its observedGeneration."""
    cond = {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def merge_conditions(previous: Iterable[dict], updates: Iterable[dict], now: str,
                     generation: int | None = None) -> list[dict]:
    """`previous` with `updates` replacing conditions of the same type, in a stable order."""
    merged = {c["type"]: dict(c) for c in previous or ()}
    for update in updates:
        old = merged.get(update["type"])
        new = dict(update)
        same = old is not None and old.get("status") == new["status"]
        new["lastTransitionTime"] = old.get("lastTransitionTime", now) if same else now
        if generation is not None:
            new["observedGeneration"] = generation
        merged[new["type"]] = new
    order = [READY, PROGRESSING, DEGRADED, SCALING_ACTIVE]
    return sorted(merged.values(), key=lambda c: (order.index(c["type"]) if c["type"] in order else 99, c["type"]))


def compute_status(name: str, desired: int, deployment: dict | None, pods: list[dict],
                   mount_problem: tuple[str, str] | None = None) -> tuple[dict, list[dict]]:
    """The status fields and the Ready/Progressing/Degraded conditions for one HybridModel.

    `desired` is the spec's replica count; `deployment` is the server's Deployment (None when
    missing); `pods` are the model's pods; `mount_problem` is (reason, message) of something the
    pods mount that is missing, known before any pod shows it.
    """
    dep_status = (deployment or {}).get("status") or {}
    replicas = int(dep_status.get("replicas") or 0)
    ready = int(dep_status.get("readyReplicas") or 0)
    updated = int(dep_status.get("updatedReplicas") or 0)
    rolled_out = _deployment_observed(deployment) and updated >= desired and replicas == desired

    problem = mount_problem or find_problem(deployment, pods)
    degraded = condition(DEGRADED, True, *problem) if problem else condition(DEGRADED, False, "AsExpected")
    if desired == 0:
        ready_cond = condition(READY, False, "ScaledToZero", "spec.replicas is 0")
    elif ready >= desired:
        ready_cond = condition(READY, True, "AllReplicasReady", f"{ready}/{desired} replicas ready")
    else:
        ready_cond = condition(READY, False, "ReplicasNotReady", f"{ready}/{desired} replicas ready")
    if deployment is None:
        progressing = condition(PROGRESSING, True, "Creating", "creating the Deployment")
    elif rolled_out and ready >= desired:
        progressing = condition(PROGRESSING, False, "Complete", "all replicas updated and ready")
    else:
        progressing = condition(PROGRESSING, True, "RollingOut",
                                f"{updated}/{desired} updated, {ready}/{desired} ready")

    fields = {
        "phase": _phase(desired, ready, problem),
        "replicas": replicas,
        "readyReplicas": ready,
        "selector": names.selector_string(name),
    }
    return fields, [ready_cond, progressing, degraded]


def find_problem(deployment: dict | None, pods: list[dict]) -> tuple[str, str] | None:
    """(reason, message) of the first thing keeping replicas from running, or None."""
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                    and cond.get("reason") == "Unschedulable":
                return "Unschedulable", f"pod {_pod_name(pod)}: {cond.get('message') or 'no node fits'}"
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (container.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in _STUCK_REASONS:
                message = waiting.get("message") or waiting["reason"]
                return waiting["reason"], f"pod {_pod_name(pod)} container {container.get('name')}: {message}"
    for cond in ((deployment or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return "ProgressDeadlineExceeded", cond.get("message") or "the rollout is stuck"
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return cond.get("reason") or "ReplicaFailure", cond.get("message") or ""
    return None


def invalid_spec_status(message: str) -> tuple[dict, list[dict]]:
    """Status for a spec the operator cannot act on."""
    return {"phase": "Failed"}, [
        condition(READY, False, "InvalidSpec", message),
        condition(PROGRESSING, False, "InvalidSpec", message),
        condition(DEGRADED, True, "InvalidSpec", message),
    ]


def rejected_child_status(message: str, reason: str = "ChildRejected") -> tuple[dict, list[dict]]:
    """Status when a child the spec asks for cannot be applied (refused, or its name taken): no rollout."""
    return {"phase": "Degraded"}, [
        condition(PROGRESSING, False, reason, message),
        condition(DEGRADED, True, reason, message),
    ]


def _phase(desired: int, ready: int, problem: tuple[str, str] | None) -> str:
    if problem:
        return "Degraded"
    if desired == 0:
        return "Stopped"
    return "Running" if ready >= desired else "Pending"


def _deployment_observed(deployment: dict | None) -> bool:
    if deployment is None:
        return False
    generation = (deployment.get("metadata") or {}).get("generation")
    observed = (deployment.get("status") or {}).get("observedGeneration")
    return generation is None or observed is None or observed >= generation


def _pod_name(pod: dict) -> str:
    return (pod.get("metadata") or {}).get("name", "?")
