"""Apply desired child objects idempotently: create what is missing, patch what drifted.

"Drifted" means a field the operator sets has another value on the server. Fields the server
adds (defaults, status, uid) are not drift, so a repeated apply of an unchanged child is a no-op.
"""

from __future__ import annotations

import copy
import enum
from typing import Any

from kubernetes.utils import parse_quantity

from . import kube


class Outcome(enum.Enum):
    CREATED = "created"
    PATCHED = "patched"
    UNCHANGED = "unchanged"


def adopt(child: dict, owner_ref: dict) -> dict:
    """A copy of `child` with `owner_ref` as its controller, so Kubernetes collects it with its owner."""
    child = copy.deepcopy(child)
    child.setdefault("metadata", {})["ownerReferences"] = [owner_ref]
    return child


def apply(child: dict) -> Outcome:
    """Make the server's copy of `child` match it in every field `child` sets."""
    resource = kube.BY_KIND[child["kind"]]
    meta = child["metadata"]
    current = kube.get(resource, meta["namespace"], meta["name"])
    if current is None:
        try:
            kube.create(resource, meta["namespace"], child)
            return Outcome.CREATED
        except kube.KubeError as e:
            if e.status != 409:
                raise
            # Another handler of the same owner created it a moment ago.
            current = kube.get(resource, meta["namespace"], meta["name"]) or {}
    if contains(current, child):
        return Outcome.UNCHANGED
    kube.patch(resource, meta["namespace"], meta["name"], _patch_body(child))
    return Outcome.PATCHED


def contains(actual: Any, desired: Any) -> bool:
    """Whether `actual` has every field of `desired` with an equal value.

    Dicts may hold extra keys; lists must have the same length and match item by item;
    quantities compare by value ("1Gi" equals "1024Mi"), as the server may rewrite them.
    """
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(
            key in actual and contains(actual[key], value) for key, value in desired.items())
    if isinstance(desired, list):
        return (isinstance(actual, list) and len(actual) == len(desired)
                and all(contains(a, d) for a, d in zip(actual, desired)))
    if actual == desired:
        return True
    return isinstance(actual, str) and isinstance(desired, str) and _same_quantity(actual, desired)


def _same_quantity(a: str, b: str) -> bool:
    try:
        return parse_quantity(a) == parse_quantity(b)
    except ValueError:
        return False


def _patch_body(child: dict) -> dict:
    # apiVersion and kind are not patchable fields, and the name is in the URL.
    body = {key: value for key, value in child.items() if key not in ("apiVersion", "kind")}
    body["metadata"] = {key: value for key, value in child["metadata"].items()
                        if key in ("labels", "annotations", "ownerReferences")}
    return body
