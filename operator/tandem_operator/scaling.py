"""One autoscaling step for one HybridModel: measure p95 decode latency, decide, set replicas.

Called periodically (tandem_operator.periodic). The memo carries the pod scrapes and the past
recommendations from one step to the next. Scaling writes `.spec.replicas`, as an HPA writes
the scale subresource; the update handler then rolls that out to the Deployment.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import kopf

from . import autoscaler, kube, names, prometheus_access
from .histogram import quantile
from .metrics_source import (MetricsError, PodWindow, Reading, prometheus_query, read_pods, read_prometheus,
                             ready_pods)
from .reconcile import live
from .spec import HybridModelSpec, SpecError, parse_spec
from .status import SCALING_ACTIVE, condition, now_iso
from .status_store import write_status

P95 = 0.95


@dataclass(frozen=True)
class Measurement:
    """The p95 over the window, or why there is none."""

    p95_s: float | None
    idle: bool = False  # a whole window without decode steps: no traffic, not missing data
    skipped: tuple[str, ...] = ()  # Ready pods left out because their metrics could not be read


def autoscale_step(body: dict, memo: Any, logger: logging.Logger | logging.LoggerAdapter,
                   clock: Callable[[], float] = time.monotonic) -> autoscaler.Decision | None:
    """Measure, decide and apply; returns the decision, or None when none was made (and why is in status)."""
    if not _enabled(body):
        retire(body, memo)
        return None
    # The caller's body can lag behind our own last scaling patch: act on the server's copy.
    body = live(body)
    spec = _autoscaled_spec(body)
    if spec is None:
        return None
    try:
        return _step(body, spec, memo, clock(), logger)
    except kube.KubeError as e:
        if e.status != 409:
            raise
        logger.info("replicas not set: the HybridModel changed since it was read; deciding again next round")
        return None


def _step(body: dict, spec: HybridModelSpec, memo: Any, now: float,
          logger: logging.Logger | logging.LoggerAdapter) -> autoscaler.Decision | None:
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    if (bounded := keep_bounds(body, spec, memo, now, logger)) is not None:
        return bounded
    pods = kube.list_labelled(kube.PODS, namespace, names.selector_labels(name))
    ready = len(ready_pods(pods))
    if not ready:
        _report(body, False, "NoReadyPods", "no Ready pods to measure and scale from")
        return None
    try:
        measured = measure(spec, namespace, name, memo, now, pods)
    except MetricsError as e:
        if _report(body, False, "FailedGetMetrics", str(e)):
            kopf.warn(body, reason="FailedGetMetrics", message=str(e))
        logger.warning("no scaling decision: %s", e)
        return None
    if measured.p95_s is None and not measured.idle:
        _report(body, False, "NoSamples", f"no decode steps observed in the last {spec.autoscaling.windowSeconds}s")
        return None

    # As the HPA does, a model first seen at N replicas counts as recommended N: an operator
    # restart does not scale every idle model down at once.
    history = getattr(memo, "recommendations", None) or [autoscaler.Recommendation(now, spec.replicas)]
    decision, memo.recommendations = autoscaler.decide(spec.replicas, measured.p95_s, spec.autoscaling,
                                                       history, now, ready=ready)
    apply_decision(body, spec, decision, measured, logger)
    return decision


def keep_bounds(body: dict, spec: HybridModelSpec, memo: Any, now: float,
                logger: logging.Logger | logging.LoggerAdapter) -> autoscaler.Decision | None:
    """Bring replicas outside [minReplicas, maxReplicas] inside; None when they are inside.

    As the HPA does, before and whatever the metrics: lowering maxReplicas while Prometheus is
    down, or raising minReplicas while no pod is Ready, must still take effect.
    """
    scaling = spec.autoscaling
    replicas = autoscaler.clamp(spec.replicas, scaling.minReplicas, scaling.maxReplicas)
    if replicas == spec.replicas:
        return None
    reason, why = (("TooFewReplicas", f"below minReplicas {scaling.minReplicas}") if replicas > spec.replicas
                   else ("TooManyReplicas", f"above maxReplicas {scaling.maxReplicas}"))
    fields = set_replicas(body, spec, replicas, why, logger)
    # The past recommendations were bounded by the old limits.
    memo.recommendations = [autoscaler.Recommendation(now, replicas)]
    meta = body["metadata"]
    write_status(meta["namespace"], meta["name"], fields, [condition(
        SCALING_ACTIVE, True, reason, f"spec.replicas {spec.replicas} was {why}: set to {replicas}",
        meta.get("generation"))])
    return autoscaler.Decision(replicas, replicas, reason)


def set_replicas(body: dict, spec: HybridModelSpec, replicas: int, why: str,
                 logger: logging.Logger | logging.LoggerAdapter) -> dict:
    """Write `.spec.replicas` (with an event saying `why`); the status fields that record it."""
    meta = body["metadata"]
    patch: dict = {"spec": {"replicas": replicas}}
    if meta.get("resourceVersion"):
        # Decided from this read: a change since (`kubectl scale`, an edit) fails the write with 409
        # instead of being overwritten, and the next round decides from the new spec.
        patch["metadata"] = {"resourceVersion": meta["resourceVersion"]}
    kube.patch(kube.HYBRIDMODELS, meta["namespace"], meta["name"], patch)
    message = f"{spec.replicas} -> {replicas} replicas: {why}"
    kopf.event(body, type="Normal", reason="ScaledUp" if replicas > spec.replicas else "ScaledDown", message=message)
    logger.info("%s", message)
    return {"lastScaleTime": now_iso(), "desiredReplicas": replicas}


def apply_decision(body: dict, spec: HybridModelSpec, decision: autoscaler.Decision, measured: Measurement,
                   logger: logging.Logger | logging.LoggerAdapter) -> None:
    """Set the new replica count (with an event) and report the step in status."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    # None takes a stale p95 out of status while the model is idle.
    fields: dict = {"p95InterTokenLatencyMs": None if measured.p95_s is None else _ms(measured.p95_s)}
    if decision.replicas != spec.replicas:
        why = _observed(spec, measured, "p95 inter-token latency")
        fields.update(set_replicas(body, spec, decision.replicas, why, logger))
    message = f"{_observed(spec, measured)}, recommended {decision.recommended}"
    if measured.skipped:
        message += f"; {len(measured.skipped)} Ready pod(s) left out, metrics unreadable: {measured.skipped[0]}"
    write_status(namespace, name, fields, [condition(SCALING_ACTIVE, True, decision.reason, message,
                                                     body["metadata"].get("generation"))])


def retire(body: dict, memo: Any) -> None:
    """Autoscaling is off: forget the past, and say so where a ScalingActive condition remains."""
    for attribute in ("recommendations", "pod_window"):
        if hasattr(memo, attribute):
            delattr(memo, attribute)
    meta = body["metadata"]
    conditions = (body.get("status") or {}).get("conditions") or []
    active = next((c for c in conditions if c.get("type") == SCALING_ACTIVE), None)
    if active is not None and (active.get("reason"), active.get("observedGeneration")) != (
            "Disabled", meta.get("generation")):
        write_status(meta["namespace"], meta["name"], {}, [condition(
            SCALING_ACTIVE, False, "Disabled", "spec.autoscaling.enabled is false", meta.get("generation"))])


def measure(spec: HybridModelSpec, namespace: str, name: str, memo: Any, now: float,
            pods: list[dict] | None = None) -> Measurement:
    """The p95 inter-token latency over the window, from the model's `pods` or from Prometheus."""
    metrics = spec.autoscaling.metrics
    window_seconds = spec.autoscaling.windowSeconds
    if metrics.source == "Prometheus":
        query = prometheus_query(metrics.prometheus.query, namespace, name, window_seconds)
        access = prometheus_access.access(metrics.prometheus, namespace)
        result = read_prometheus(metrics.prometheus.url, query, access=access)
        # Buckets with no increase: the model's series exist and saw no decode step in the window.
        reading = Reading(result, covers_window=isinstance(result, dict))
    else:
        if not isinstance(getattr(memo, "pod_window", None), PodWindow):
            memo.pod_window = PodWindow()
        if pods is None:
            pods = kube.list_labelled(kube.PODS, namespace, names.selector_labels(name))
        reading = read_pods(pods, memo.pod_window, now, window_seconds)
    return _measurement(reading)


def measure_p95(spec: HybridModelSpec, namespace: str, name: str, memo: Any, now: float) -> float | None:
    """The p95 inter-token latency in seconds over the window; None without observations."""
    return measure(spec, namespace, name, memo, now).p95_s


def _measurement(reading: Reading) -> Measurement:
    observed = reading.observed
    if observed is None or isinstance(observed, float):
        return Measurement(observed, skipped=reading.skipped)
    p95 = quantile(P95, observed)
    return Measurement(p95, idle=p95 is None and reading.covers_window, skipped=reading.skipped)


def _observed(spec: HybridModelSpec, measured: Measurement, label: str = "p95") -> str:
    if measured.p95_s is None:
        return f"idle: no decode steps in the last {spec.autoscaling.windowSeconds}s"
    return f"{label} {_ms(measured.p95_s):g} ms, target {spec.autoscaling.targetP95InterTokenLatencyMs:g} ms"


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def _autoscaled_spec(body: dict | None) -> HybridModelSpec | None:
    """The spec of a live HybridModel to autoscale now; None (reported if it matters) otherwise."""
    if body is None or not _enabled(body):
        return None
    try:
        spec = parse_spec(body.get("spec"))
    except SpecError:
        return None  # the reconciler reports the invalid spec
    if spec.replicas == 0:
        _report(body, False, "ScalingDisabled", "replicas is 0; scale up by hand to resume autoscaling")
        return None
    return spec


def _enabled(body: dict) -> bool:
    return bool(((body.get("spec") or {}).get("autoscaling") or {}).get("enabled"))


def _report(body: dict, ok: bool, reason: str, message: str) -> bool:
    """Set the ScalingActive condition of HybridModel `body`; True when its reason changed (worth an event)."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    before = kube.get(kube.HYBRIDMODELS, namespace, name) or {}
    old = next((c for c in (before.get("status") or {}).get("conditions") or []
                if c.get("type") == SCALING_ACTIVE), {})
    write_status(namespace, name, {}, [condition(SCALING_ACTIVE, ok, reason, message, meta.get("generation"))])
    return old.get("reason") != reason
