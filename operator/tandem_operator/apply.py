"""Apply desired child objects idempotently: create what is missing, patch what drifted.

"Drifted" means a field the operator sets has another value on the server. Fields the server
adds (defaults, status, uid) are not drift, so a repeated apply of an unchanged child is a no-op.
A field a builder sets to None is one the operator owns but leaves out for this spec: the server
must not have it, and the patch's null deletes it (RFC 7386), so removing a setting from the spec
removes it from the child.

An object of the same name that another owner controls (or that nobody does and that is not
labelled as this HybridModel's) is never taken over: patching it would overwrite someone else's
workload, and the owner reference would have the garbage collector delete it with the HybridModel.
"""

from __future__ import annotations

import copy
import enum
from typing import Any

from kubernetes.utils import parse_quantity

from . import kube, names


class Outcome(enum.Enum):
    CREATED = "created"
    PATCHED = "patched"
    UNCHANGED = "unchanged"


class NotOwned(Exception):
    """The child's name is taken by an object this HybridModel does not control; the message says whose."""


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
            kube.create(resource, meta["namespace"], without_nulls(child))
            return Outcome.CREATED
        except kube.KubeError as e:
            if e.status != 409:
                raise
            # Another handler of the same owner created it a moment ago.
            current = kube.get(resource, meta["namespace"], meta["name"]) or {}
    check_owned(current, child)
    if contains(current, child):
        return Outcome.UNCHANGED
    kube.patch(resource, meta["namespace"], meta["name"], _patch_body(child))
    return Outcome.PATCHED


def check_owned(current: dict, child: dict) -> None:
    """Raise NotOwned unless the server's `current` may be made into `child`.

    It may when its controller is the child's owner, or when it has no controller and carries the
    child's model label (the operator's own child, orphaned, e.g. by `kubectl delete --cascade=orphan`).
    """
    desired = _controller((child.get("metadata") or {}).get("ownerReferences"))
    if desired is None:
        return
    meta = current.get("metadata") or {}
    actual = _controller(meta.get("ownerReferences"))
    if actual is not None and actual.get("uid") == desired.get("uid"):
        return
    model = ((child.get("metadata") or {}).get("labels") or {}).get(names.MODEL_LABEL)
    if actual is None and model is not None and (meta.get("labels") or {}).get(names.MODEL_LABEL) == model:
        return
    whose = (f"controlled by {actual.get('kind')} {actual.get('name')} (uid {actual.get('uid')})" if actual
             else f"not labelled {names.MODEL_LABEL}={model}")
    raise NotOwned(f"{child['kind']} {meta.get('name')} already exists and is {whose}, not this "
                   f"HybridModel's; delete or rename it, or rename the HybridModel")


def _controller(references: list | None) -> dict | None:
    return next((ref for ref in references or [] if ref.get("controller")), None)


def contains(actual: Any, desired: Any) -> bool:
    """Whether `actual` has every field of `desired` with an equal value.

    Dicts may hold extra keys; lists must have the same length and match item by item;
    quantities compare by value ("1Gi" equals "1024Mi"), as the server may rewrite them.
    A key the server lacks equals a zero value (False, "", 0, [], {}, None): the server omits
    those (omitempty), and a desired None means the key must be absent.
    """
    if desired is None:
        return is_zero(actual)
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(
            contains(actual[key], value) if key in actual else is_zero(value) for key, value in desired.items())
    if isinstance(desired, list):
        return (isinstance(actual, list) and len(actual) == len(desired)
                and all(contains(a, d) for a, d in zip(actual, desired)))
    if actual == desired:
        return True
    return isinstance(actual, str) and isinstance(desired, str) and _same_quantity(actual, desired)


def is_zero(value: Any) -> bool:
    """None, False, 0, "", [] or {}: what the API server leaves out of the objects it returns."""
    return value is None or (isinstance(value, (bool, int, float, str, list, dict)) and not value)


def without_nulls(value: Any) -> Any:
    """`value` without the dict keys whose value is None, at any depth (what a create must send)."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


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
