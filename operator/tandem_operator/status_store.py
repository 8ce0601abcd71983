"""Writes a HybridModel's status subresource, one writer at a time per object.

The reconciler and the autoscaler both write status (each its own fields and conditions), from
different handler threads; a lock per object and a fresh read before each write keep one from
undoing the other.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from . import kube
from .status import merge_conditions, now_iso

_locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
_locks_guard = threading.Lock()


def lock_for(namespace: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks[(namespace, name)]


def write_status(namespace: str, name: str, fields: dict, conditions: list[dict] = (),
                 generation: int | None = None) -> dict | None:
    """Merge `fields` and `conditions` into the status; patch only if something changed.

    Returns the new status, or None when the HybridModel is gone or being deleted.
    """
    with lock_for(namespace, name):
        current = kube.get(kube.HYBRIDMODELS, namespace, name)
        if current is None or (current.get("metadata") or {}).get("deletionTimestamp"):
            return None
        old = current.get("status") or {}
        new = dict(fields)
        if conditions:
            new["conditions"] = merge_conditions(old.get("conditions") or [], conditions, now_iso(), generation)
        if generation is not None:
            new["observedGeneration"] = generation
        if all(old.get(key) == value for key, value in new.items()):
            return old
        kube.patch(kube.HYBRIDMODELS, namespace, name, {"status": new}, subresource="status")
        return {**old, **new}
