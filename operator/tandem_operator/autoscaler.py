"""The autoscaler's arithmetic: the HPA rule with tolerance, limits and stabilisation windows.

Pure functions of numbers and a list of past recommendations, so every case is a unit test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .spec import AutoscalingSpec


@dataclass(frozen=True)
class Recommendation:
    """What the rule asked for at one moment (seconds on any monotonic clock)."""

    time: float
    replicas: int


@dataclass(frozen=True)
class Decision:
    replicas: int  # what to set now
    recommended: int  # the rule's answer before stabilisation
    # ScaleUp, ScaleDown, WithinTolerance, Stabilized, AtLimit, PodsNotReady, Idle; TooFewReplicas and
    # TooManyReplicas when replicas were outside the bounds (tandem_operator.scaling.keep_bounds).
    reason: str


def rule(current: int, measured: float, target: float, tolerance: float, ready: int | None = None) -> int:
    """The HPA rule: ceil(ready × measured / target), unless within 1 ± tolerance of target.

    `ready` (default `current`) is the number of pods measured. As the HPA does, the answer is
    `current` within tolerance, and never fewer replicas for a latency above target (or more for
    one below), which a count of ready pods below `current` could otherwise give.
    """
    ready = current if ready is None else ready
    if current < 0 or ready < 0 or not math.isfinite(measured) or measured < 0 or target <= 0:
        raise ValueError(f"bad inputs: current={current}, ready={ready}, measured={measured}, target={target}")
    ratio = measured / target
    if abs(ratio - 1.0) <= tolerance:
        return current
    # The epsilon keeps 3 × (1.1/1.1) from rounding up to 4 through float error.
    proposal = math.ceil(ready * ratio - 1e-9)
    return max(proposal, current) if ratio > 1.0 else min(proposal, current)


def clamp(replicas: int, minimum: int, maximum: int) -> int:
    return max(minimum, min(maximum, replicas))


def stabilize(current: int, recommended: int, history: list[Recommendation], now: float,
              up_window: float, down_window: float) -> int:
    """As the HPA does: scale up only to the lowest, and down only to the highest, recommendation
    seen within the respective window (the current one included). Flapping load then moves
    replicas in one direction per window at most.
    """
    up_limit = down_limit = recommended
    for past in history:
        if past.time > now - up_window:
            up_limit = min(up_limit, past.replicas)
        if past.time > now - down_window:
            down_limit = max(down_limit, past.replicas)
    replicas = current
    if replicas < up_limit:
        replicas = up_limit
    if replicas > down_limit:
        replicas = down_limit
    return replicas


def decide(current: int, measured_s: float | None, spec: AutoscalingSpec, history: list[Recommendation],
           now: float, ready: int | None = None) -> tuple[Decision, list[Recommendation]]:
    """The replicas to set from a measured p95 (seconds), and the history to keep for next time.

    As the HPA does, the rule scales the `ready` pods the p95 was measured on (default: all
    `current`), not replicas still loading, and proposes no scale-up while some are: their
    capacity is on its way, and the p95 of the others cannot show it yet. `measured_s` None means
    a whole window without decode steps: idle, so the recommendation is minReplicas.
    """
    if spec.maxReplicas is None or spec.targetP95InterTokenLatencyMs is None:
        raise ValueError("autoscaling needs maxReplicas and targetP95InterTokenLatencyMs")
    ready = current if ready is None else ready
    if measured_s is not None and ready < 1:
        raise ValueError("a measured p95 needs at least one Ready pod to scale from")
    idle = measured_s is None
    target_s = spec.targetP95InterTokenLatencyMs / 1000.0
    raw = spec.minReplicas if idle else rule(current, measured_s, target_s, spec.tolerance, ready)
    loading = not idle and ready < current and measured_s / target_s > 1.0 + spec.tolerance
    recommended = clamp(current if loading else raw, spec.minReplicas, spec.maxReplicas)
    # Stabilisation moves `current` only towards the window's recommendations: from outside the
    # bounds (lowered maxReplicas, a hand scale) it could stay there. The bounds hold regardless.
    replicas = clamp(stabilize(current, recommended, history, now, spec.scaleUpStabilizationSeconds,
                               spec.scaleDownStabilizationSeconds), spec.minReplicas, spec.maxReplicas)
    keep = max(spec.scaleUpStabilizationSeconds, spec.scaleDownStabilizationSeconds)
    history = [r for r in history if r.time > now - keep] + [Recommendation(now, recommended)]
    return Decision(replicas, recommended, _reason(current, raw, recommended, replicas, loading, idle)), history


def _reason(current: int, raw: int, recommended: int, replicas: int, loading: bool, idle: bool) -> str:
    if replicas > current:
        return "ScaleUp"
    if replicas < current:
        return "ScaleDown"
    if loading:
        return "PodsNotReady"
    if idle:
        return "Idle"
    if raw == current:
        return "WithinTolerance"
    if recommended == current:
        return "AtLimit"
    return "Stabilized"
