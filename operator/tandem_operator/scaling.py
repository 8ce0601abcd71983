"""One autoscaling step for one HybridModel: measure p95 decode latency, decide, set replicas.

Called by a kopf timer. The memo (kopf's per-object memo) carries the pod scrapes and the past
recommendations from one step to the next. Scaling writes `.spec.replicas`, as an HPA writes
the scale subresource; the update handler then rolls that out to the Deployment.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import kopf

from . import autoscaler, kube, names
from .histogram import Histogram, quantile
from .metrics_source import MetricsError, PodWindow, prometheus_query, read_pods, read_prometheus
from .spec import HybridModelSpec, SpecError, parse_spec
from .status import SCALING_ACTIVE, condition, now_iso
from .status_store import write_status

P95 = 0.95


def autoscale_step(body: dict, memo: Any, logger: logging.Logger | logging.LoggerAdapter,
                   clock: Callable[[], float] = time.monotonic) -> autoscaler.Decision | None:
    """Measure, decide and apply; returns the decision, or None when none was made (and why is in status)."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    # The timer's body can lag behind our own last scaling patch: act on the server's copy.
    body = kube.get(kube.HYBRIDMODELS, namespace, name) or body
    try:
        spec = parse_spec(body.get("spec"))
    except SpecError:
        return None  # the reconciler reports the invalid spec
    if not spec.autoscaling.enabled:
        return None
    if spec.replicas == 0:
        _report(namespace, name, False, "ScalingDisabled", "replicas is 0; scale up by hand to resume autoscaling")
        return None

    now = clock()
    try:
        p95 = measure_p95(spec, namespace, name, memo, now)
    except MetricsError as e:
        if _report(namespace, name, False, "FailedGetMetrics", str(e)):
            kopf.warn(body, reason="FailedGetMetrics", message=str(e))
        logger.warning("no scaling decision: %s", e)
        return None
    if p95 is None:
        _report(namespace, name, False, "NoSamples",
                f"no decode steps observed in the last {spec.autoscaling.windowSeconds}s")
        return None

    history = getattr(memo, "recommendations", [])
    decision, memo.recommendations = autoscaler.decide(spec.replicas, p95, spec.autoscaling, history, now)
    measured_ms = round(p95 * 1000.0, 3)
    target_ms = spec.autoscaling.targetP95InterTokenLatencyMs
    fields: dict = {"p95InterTokenLatencyMs": measured_ms}
    if decision.replicas != spec.replicas:
        kube.patch(kube.HYBRIDMODELS, namespace, name, {"spec": {"replicas": decision.replicas}})
        fields.update(lastScaleTime=now_iso(), desiredReplicas=decision.replicas)
        message = (f"{spec.replicas} -> {decision.replicas} replicas: p95 inter-token latency "
                   f"{measured_ms:g} ms, target {target_ms:g} ms")
        kopf.event(body, type="Normal", reason="ScaledUp" if decision.replicas > spec.replicas else "ScaledDown",
                   message=message)
        logger.info("%s", message)
    write_status(namespace, name, fields, [condition(
        SCALING_ACTIVE, True, decision.reason,
        f"p95 {measured_ms:g} ms, target {target_ms:g} ms, recommended {decision.recommended}")])
    return decision


def measure_p95(spec: HybridModelSpec, namespace: str, name: str, memo: Any, now: float) -> float | None:
    """The p95 inter-token latency in seconds over the window; None without observations."""
    metrics = spec.autoscaling.metrics
    window_seconds = spec.autoscaling.windowSeconds
    if metrics.source == "Prometheus":
        query = prometheus_query(metrics.prometheus.query, namespace, name, window_seconds)
        result = read_prometheus(metrics.prometheus.url, query)
        return result if result is None or isinstance(result, float) else _p95(result)
    if not isinstance(getattr(memo, "pod_window", None), PodWindow):
        memo.pod_window = PodWindow()
    pods = kube.list_labelled(kube.PODS, namespace, names.selector_labels(name))
    return _p95(read_pods(pods, memo.pod_window, now, window_seconds))


def _p95(observed: Histogram | None) -> float | None:
    return None if observed is None else quantile(P95, observed)


def _report(namespace: str, name: str, ok: bool, reason: str, message: str) -> bool:
    """Set the ScalingActive condition; True when its reason changed (worth an event)."""
    before = kube.get(kube.HYBRIDMODELS, namespace, name) or {}
    old = next((c for c in (before.get("status") or {}).get("conditions") or []
                if c.get("type") == SCALING_ACTIVE), {})
    write_status(namespace, name, {}, [condition(SCALING_ACTIVE, ok, reason, message)])
    return old.get("reason") != reason
