"""The kopf handlers of the HybridModel operator. Registration only; the logic lives elsewhere.

`register(registry, ...)` puts every handler on a registry; importing this module registers
them on kopf's default registry, which is what `kopf run -m tandem_operator` uses. Tests build
their own registry with short intervals.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from . import names, reconcile, scaling
from .login import login

AUTOSCALE_INTERVAL_ENV = "TANDEM_OPERATOR_AUTOSCALE_INTERVAL"
RESYNC_INTERVAL_ENV = "TANDEM_OPERATOR_RESYNC_INTERVAL"
DEFAULT_AUTOSCALE_INTERVAL = 15.0
DEFAULT_RESYNC_INTERVAL = 300.0
CHILD_RESOURCES = (("apps", "v1", "deployments"), ("", "v1", "services"),
                   ("policy", "v1", "poddisruptionbudgets"), ("", "v1", "pods"))
MODEL = (names.GROUP, names.VERSION, names.PLURAL)


def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Keep kopf's bookkeeping in annotations under our group, out of the structural status."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{names.GROUP}/cleanup"
    # Only warnings become Events; scale decisions and repairs post their own.
    settings.posting.level = logging.WARNING


def on_spec(body: Mapping, logger: logging.Logger, **_: Any) -> None:
    reconcile.reconcile(plain(body), logger, trigger="spec")


# Timers are async shells around the blocking work: kopf stops async timers at once on exit,
# but waits out a sync timer's sleep.
async def on_resync(body: Mapping, logger: logging.Logger, **_: Any) -> None:
    await asyncio.to_thread(reconcile.reconcile, plain(body), logger, "drift")


def on_delete(body: Mapping, logger: logging.Logger, **_: Any) -> None:
    reconcile.delete_children(body["metadata"]["namespace"], body["metadata"]["name"], logger)


def on_child_event(body: Mapping, logger: logging.Logger, **_: Any) -> None:
    owner = reconcile.owner_of(plain(body))
    if owner is not None:
        try:
            reconcile.reconcile(owner, logger, trigger="drift")
        except kopf.PermanentError:
            pass  # already reported on the owner by its own handlers


async def on_autoscale(body: Mapping, memo: Any, logger: logging.Logger, **_: Any) -> None:
    await asyncio.to_thread(scaling.autoscale_step, plain(body), memo, logger)


def register(registry: kopf.OperatorRegistry, *, autoscale_interval: float = DEFAULT_AUTOSCALE_INTERVAL,
             resync_interval: float = DEFAULT_RESYNC_INTERVAL) -> kopf.OperatorRegistry:
    """Register every handler on `registry` and return it."""
    kopf.on.startup(registry=registry)(configure)
    kopf.on.login(registry=registry)(login)
    kopf.on.create(*MODEL, registry=registry, id="reconcile")(on_spec)
    kopf.on.update(*MODEL, registry=registry, id="reconcile")(on_spec)
    kopf.on.resume(*MODEL, registry=registry, id="reconcile")(on_spec)
    kopf.on.delete(*MODEL, registry=registry, id="cleanup")(on_delete)
    kopf.timer(*MODEL, registry=registry, id="resync", interval=resync_interval,
               initial_delay=resync_interval)(on_resync)
    kopf.timer(*MODEL, registry=registry, id="autoscale", interval=autoscale_interval,
               when=_autoscaling_enabled)(on_autoscale)
    for group, version, plural in CHILD_RESOURCES:
        kopf.on.event(group, version, plural, registry=registry, id="child",
                      labels={names.MANAGED_BY_LABEL: names.OPERATOR_NAME})(on_child_event)
    return registry


def plain(value: Any) -> Any:
    """kopf's read-only body views as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def _autoscaling_enabled(spec: Mapping, **_: Any) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled"))


def _interval(variable: str, default: float) -> float:
    raw = os.environ.get(variable)
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{variable} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{variable} must be > 0, got {raw!r}")
    return value


register(kopf.get_default_registry(),
         autoscale_interval=_interval(AUTOSCALE_INTERVAL_ENV, DEFAULT_AUTOSCALE_INTERVAL),
         resync_interval=_interval(RESYNC_INTERVAL_ENV, DEFAULT_RESYNC_INTERVAL))
