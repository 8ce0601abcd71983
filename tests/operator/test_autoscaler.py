"""The autoscaler's arithmetic on recorded histograms: p95 from bucket deltas, the HPA rule,
tolerance, limits and stabilisation windows."""

from __future__ import annotations

import math

import pytest

from tandem import contract
from tandem_operator.autoscaler import Recommendation, decide, rule, stabilize
from tandem_operator.histogram import increase, merge, parse_histograms, quantile
from tandem_operator.metrics_source import PodWindow
from tandem_operator.spec import AutoscalingSpec

# Recorded from a prometheus_client histogram with contract.LATENCY_BUCKETS, 100 observations:
# 90 steps of 20 ms and 10 of 300 ms.
RECORDED = "\n".join([
    "# HELP tandem_inter_token_latency_seconds Time between tokens.",
    "# TYPE tandem_inter_token_latency_seconds histogram",
    *[f'tandem_inter_token_latency_seconds_bucket{{le="{le}"}} {0.0 if le < 0.02 else 90.0 if le < 0.3 else 100.0}'
      for le in contract.LATENCY_BUCKETS],
    'tandem_inter_token_latency_seconds_bucket{le="+Inf"} 100.0',
    "tandem_inter_token_latency_seconds_count 100.0",
    "tandem_inter_token_latency_seconds_sum 4.8",
    "",
])
SPEC = AutoscalingSpec(enabled=True, minReplicas=1, maxReplicas=10, targetP95InterTokenLatencyMs=100,
                       scaleUpStabilizationSeconds=0, scaleDownStabilizationSeconds=300)


def test_p95_interpolates_inside_the_bucket():
    (hist,) = parse_histograms(RECORDED, contract.INTER_TOKEN_LATENCY).values()
    # rank 95 lies in (0.2, 0.3], which holds observations 91..100: halfway through it.
    assert quantile(0.95, hist) == pytest.approx(0.2 + 0.1 * 0.5)
    assert quantile(0.5, hist) == pytest.approx(0.015 + 0.005 * (50 / 90))


def test_p95_of_the_window_uses_bucket_deltas():
    (before,) = parse_histograms(RECORDED, contract.INTER_TOKEN_LATENCY).values()
    after = dict(before)
    for le in after:  # 100 more observations, all of 3 ms
        if le >= 0.005:
            after[le] += 100
    delta = increase(after, before)
    assert delta[math.inf] == 100
    assert quantile(0.95, delta) == pytest.approx(0.0025 + 0.0025 * 0.95)


def test_counter_reset_counts_everything_as_new():
    old = {0.1: 50.0, math.inf: 60.0}
    new = {0.1: 5.0, math.inf: 6.0}  # the pod restarted
    assert increase(new, old) == new


def test_no_observations_means_no_p95():
    assert quantile(0.95, {0.1: 0.0, math.inf: 0.0}) is None
    assert quantile(0.95, {}) is None


def test_above_the_largest_bucket_reports_its_bound():
    assert quantile(0.95, {1.0: 0.0, 10.0: 0.0, math.inf: 10.0}) == 10.0


def test_pods_are_summed_and_window_needs_two_scrapes():
    window = PodWindow()
    window.record(0.0, {"a": {0.1: 1.0, math.inf: 1.0}}, 60)
    assert window.increase() is None
    window.record(10.0, {"a": {0.1: 3.0, math.inf: 5.0}, "b": {0.1: 2.0, math.inf: 2.0}}, 60)
    # a: +2 below 0.1 and +4 overall; b started inside the window so all of it is new.
    assert window.increase() == {0.1: 4.0, math.inf: 6.0}
    assert merge([{1.0: 1.0}, {1.0: 2.0, 2.0: 3.0}]) == {1.0: 3.0, 2.0: 3.0}


def test_window_baseline_moves_forward():
    window = PodWindow()
    for t in range(0, 100, 10):
        window.record(float(t), {"a": {math.inf: float(t)}}, 30)
    # Baseline is the newest scrape at or before 90 - 30 = 60.
    assert window.scrapes[0][0] == 60.0
    assert window.increase() == {math.inf: 30.0}


@pytest.mark.parametrize("current,measured,target,expected", [
    (2, 0.2, 0.1, 4),      # twice the target: double
    (3, 0.105, 0.1, 3),    # within 10%: no change
    (3, 0.111, 0.1, 4),    # just outside: ceil(3.33)
    (4, 0.05, 0.1, 2),     # half the target: halve
    (4, 0.08, 0.1, 4),     # ceil(3.2) = 4: HPA rounds up
    (3, 0.11, 0.1, 3),     # exactly 10% above: tolerance is inclusive
])
def test_hpa_rule(current, measured, target, expected):
    assert rule(current, measured, target, 0.1) == expected


def test_decide_clamps_to_limits():
    decision, _ = decide(2, 10.0, SPEC, [], now=0.0)
    assert (decision.replicas, decision.reason) == (10, "ScaleUp")
    decision, _ = decide(2, 0.001, SPEC, [], now=0.0)
    assert decision.replicas == 1


@pytest.mark.parametrize("current, bounds, expected", [(1, (3, 5), 3), (8, (1, 4), 4)])
def test_the_bounds_hold_through_the_stabilisation_windows(current, bounds, expected):
    # minReplicas raised (or maxReplicas lowered) after replicas settled: the windows remember the old
    # count, and stabilising towards it must not keep replicas outside the new bounds.
    spec = AutoscalingSpec(enabled=True, minReplicas=bounds[0], maxReplicas=bounds[1], targetP95InterTokenLatencyMs=100,
                           scaleUpStabilizationSeconds=300, scaleDownStabilizationSeconds=300)
    for measured in (0.1, 0.02, 0.5, None):  # within tolerance, low, high, idle
        decision, _ = decide(current, measured, spec, [Recommendation(0.0, current)], now=10.0)
        assert decision.replicas == expected, measured
        assert decision.reason == ("ScaleUp" if expected > current else "ScaleDown")


def test_scale_down_waits_for_the_stabilisation_window():
    history: list[Recommendation] = []
    decision, history = decide(4, 0.4, SPEC, history, now=0.0)  # load peak: 16 -> max 10
    assert decision.replicas == 10
    decision, history = decide(10, 0.02, SPEC, history, now=60.0)  # load gone: rule says 2
    assert (decision.replicas, decision.recommended, decision.reason) == (10, 2, "Stabilized")
    decision, history = decide(10, 0.02, SPEC, history, now=301.0)  # the peak left the window
    assert decision.replicas == 2


def test_flapping_load_does_not_flap_replicas():
    spec = AutoscalingSpec(enabled=True, minReplicas=1, maxReplicas=10, targetP95InterTokenLatencyMs=100,
                           scaleUpStabilizationSeconds=60, scaleDownStabilizationSeconds=60)
    replicas, history, seen = 4, [Recommendation(-1.0, 4)], []  # stable at 4 until now
    for step in range(20):
        measured = 0.2 if step % 2 else 0.05  # alternately double and half the target
        decision, history = decide(replicas, measured, spec, history, now=step * 10.0)
        replicas = decision.replicas
        seen.append(replicas)
    assert seen == [4] * 20


def test_stabilize_takes_min_up_and_max_down():
    history = [Recommendation(0.0, 3), Recommendation(50.0, 6)]
    assert stabilize(4, 8, history, now=60.0, up_window=100, down_window=0) == 4  # min(3,6,8)=3 < 4: stay
    assert stabilize(4, 8, history, now=60.0, up_window=20, down_window=0) == 6  # only the 6 counts
    assert stabilize(4, 1, history, now=60.0, up_window=0, down_window=100) == 4  # max(1,3,6)=6 > 4: stay
    assert stabilize(8, 1, history, now=60.0, up_window=0, down_window=100) == 6  # down only to 6


def test_bad_inputs_raise():
    with pytest.raises(ValueError):
        rule(1, 0.1, 0.0, 0.1)
    with pytest.raises(ValueError):
        quantile(1.5, {math.inf: 1.0})


def test_scale_up_waits_for_the_pods_it_asked_for():
    # p95 stays at twice the target while new pods load (10 min here): the rule scales the Ready
    # pods it measured, and asks for no more while some are still loading.
    spec = AutoscalingSpec(enabled=True, minReplicas=1, maxReplicas=64, targetP95InterTokenLatencyMs=100)
    replicas, history, seen = 1, [], []
    for step in range(8):
        now = step * 15.0
        ready = 1 if now < 600 else replicas
        decision, history = decide(replicas, 0.2, spec, history, now=now, ready=ready)
        replicas = decision.replicas
        seen.append((replicas, decision.reason))
    assert seen == [(2, "ScaleUp")] + [(2, "PodsNotReady")] * 7
    decision, _ = decide(2, 0.2, spec, history, now=600.0, ready=2)  # both loaded, still 2x the target
    assert (decision.replicas, decision.reason) == (4, "ScaleUp")


def test_the_rule_scales_the_ready_pods():
    # 4 replicas, 2 of them Ready, at half the target: ceil(2 x 0.5) = 1, not ceil(4 x 0.5) = 2.
    decision, _ = decide(4, 0.05, SPEC, [], now=0.0, ready=2)
    assert (decision.replicas, decision.reason) == (1, "ScaleDown")
    # Above target never means fewer replicas: ceil(1 x 1.5) = 2 of 4 is no scale-down.
    assert rule(4, 0.15, 0.1, 0.1, ready=1) == 4
    with pytest.raises(ValueError, match="Ready pod"):
        decide(2, 0.2, SPEC, [], now=0.0, ready=0)


def test_idle_scales_down_to_min_after_the_stabilisation_window():
    history = [Recommendation(0.0, 6)]  # the last busy moment
    decision, history = decide(6, None, SPEC, history, now=60.0)  # no decode steps in a whole window
    assert (decision.replicas, decision.recommended, decision.reason) == (6, 1, "Idle")
    decision, history = decide(6, None, SPEC, history, now=301.0)
    assert (decision.replicas, decision.reason) == (1, "ScaleDown")
    decision, _ = decide(1, None, SPEC, history, now=320.0)
    assert (decision.replicas, decision.reason) == (1, "Idle")


@pytest.mark.parametrize("measured", [math.nan, math.inf, -math.inf])
def test_non_finite_latency_is_refused(measured):
    with pytest.raises(ValueError):
        rule(2, measured, 0.1, 0.1)
