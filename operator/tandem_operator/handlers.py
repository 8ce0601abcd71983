"""The kopf handlers of the HybridModel operator. Registration only; the logic lives elsewhere.

`register(registry, ...)` puts every handler on a registry; importing this module registers
them on kopf's default registry, which is what `kopf run -m tandem_operator` uses. Tests build
their own registry with short intervals.

No handler needs kopf's finalizer (no on.delete, no kopf timers: see tandem_operator.periodic),
so a HybridModel can be deleted while the operator is not running, e.g. after `helm uninstall`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from . import names, periodic, reconcile, scaling
from .login import login

AUTOSCALE_INTERVAL_ENV = "TANDEM_OPERATOR_AUTOSCALE_INTERVAL"
RESYNC_INTERVAL_ENV = "TANDEM_OPERATOR_RESYNC_INTERVAL"
DEFAULT_AUTOSCALE_INTERVAL = 15.0
DEFAULT_RESYNC_INTERVAL = 300.0
CHILD_RESOURCES = (("apps", "v1", "deployments"), ("", "v1", "services"),
                   ("policy", "v1", "poddisruptionbudgets"), ("", "v1", "pods"))
MODEL = (names.GROUP, names.VERSION, names.PLURAL)
CHILD_SELECTOR = f"{names.MANAGED_BY_LABEL}={names.OPERATOR_NAME}"


def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Keep kopf's bookkeeping in annotations under our group, out of the structural status."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.GROUP, key="last-handled-configuration")
    # Nothing asks for it now; named so that kopf removes the one older versions added.
    settings.persistence.finalizer = f"{names.GROUP}/cleanup"
    # Only warnings become Events; scale decisions and repairs post their own.
    settings.posting.level = logging.WARNING
    # The handlers' `labels=` filter is applied by kopf after it receives each event: without a
    # selector the operator would watch, and hold in memory, every pod and Service in the cluster.
    for group, version, plural in CHILD_RESOURCES:
        settings.watching.label_selectors[group, version, plural] = CHILD_SELECTOR


def on_spec(body: Mapping, logger: logging.Logger, **_: Any) -> None:
    reconcile.reconcile(plain(body), logger, trigger="spec")


def resync(body: dict, memo: Any, logger: logging.Logger) -> None:
    """The periodic safety net: drift that no watch event reported, and spec.tls's Secrets, which none can."""
    del memo  # nothing to keep between rounds
    current = reconcile.live(body)
    if current is None:  # deleted while the watch was down: no DELETED event came
        raise periodic.Gone()
    reconcile.reconcile(current, logger, trigger="drift")


async def on_model_event(loops: periodic.Loops, type: str | None, body: Mapping, logger: logging.Logger,
                         **_: Any) -> None:
    if type == "DELETED":
        loops.gone(plain(body))
    else:
        loops.seen(plain(body), logger)


async def on_cleanup(loops: periodic.Loops, **_: Any) -> None:
    await loops.stop()


def on_child_event(body: Mapping, logger: logging.Logger, **_: Any) -> None:
    owner = reconcile.owner_of(plain(body))
    if owner is not None:
        try:
            reconcile.reconcile(owner, logger, trigger="drift")
        except (kopf.PermanentError, kopf.TemporaryError) as e:
            # Reported on the owner's status and events; kopf never retries an event handler (the
            # owner's own handlers and the resync do), so raising would only log it again.
            logger.info("drift repair of HybridModel %s deferred: %s", owner["metadata"]["name"], e)


def register(registry: kopf.OperatorRegistry, *, autoscale_interval: float = DEFAULT_AUTOSCALE_INTERVAL,
             resync_interval: float = DEFAULT_RESYNC_INTERVAL) -> kopf.OperatorRegistry:
    """Register every handler on `registry` and return it."""
    loops = periodic.Loops([
        periodic.Every(resync, resync_interval, initial_delay=resync_interval),
        periodic.Every(scaling.autoscale_step, autoscale_interval),
    ])
    kopf.on.startup(registry=registry)(configure)
    kopf.on.login(registry=registry)(login)
    kopf.on.cleanup(registry=registry, id="periodic")(functools.partial(on_cleanup, loops))
    kopf.on.create(*MODEL, registry=registry, id="reconcile")(on_spec)
    kopf.on.update(*MODEL, registry=registry, id="reconcile")(on_spec)
    kopf.on.resume(*MODEL, registry=registry, id="reconcile")(on_spec)
    kopf.on.event(*MODEL, registry=registry, id="periodic")(functools.partial(on_model_event, loops))
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
