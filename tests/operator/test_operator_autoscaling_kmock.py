"""The operator's autoscaling timer against KMock, reading the metrics endpoint of a real `tandem serve`."""

from __future__ import annotations

import json
import math

import kmock

from fake_metrics import exposition, fake_server
from hm_cluster import DEPLOYMENT, core_path, hybrid_model, model_path, wait_for
from tandem_serve import drive_load, observed_bucket_range_ms, scrape
from test_operator_kmock import condition, pod

AUTOSCALING = {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetP95InterTokenLatencyMs": 50,
               "windowSeconds": 60, "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 300}
# A demo Mixtral decodes in well under a millisecond to tens of milliseconds a token on CPU; a
# 10 µs target is far below any of that, so the decision is a scale-up whatever the machine.
TINY_TARGET_MS = 0.01
SERVER_TIMEOUT = 60.0  # timer ticks every 0.2 s; the generous bound is for two shared CPU cores


async def scaling_reason(cluster, name):
    model = await cluster.get(model_path(name))
    return condition(model, "ScalingActive").get("reason")


async def test_scales_up_from_decode_latency_of_real_tandem_serve(cluster, operator, tandem_server):
    autoscaling = dict(AUTOSCALING, maxReplicas=3, targetP95InterTokenLatencyMs=TINY_TARGET_MS)
    await cluster.create_model(hybrid_model("auto", autoscaling=autoscaling))
    # A Ready pod of the model whose IP and metrics port are those of the real server.
    await cluster.create(core_path("pods"), pod("auto-1", "auto", metrics_port=tandem_server.metrics_port))
    # The first scrape is the window's baseline: no decode steps since, so no decision.
    await wait_for(lambda: _is(scaling_reason(cluster, "auto"), "NoSamples"), timeout=SERVER_TIMEOUT,
                   what="a baseline scrape")
    assert (await cluster.get(model_path("auto")))["spec"]["replicas"] == 1

    # Load: every decode step after a request's first token is an inter-token latency observation.
    assert await drive_load(tandem_server.address) > 0

    model = await wait_for(lambda: _with_status(cluster, "auto", "desiredReplicas", 3), timeout=SERVER_TIMEOUT,
                           what="desiredReplicas 3")
    assert model["spec"]["replicas"] == 3
    deployment = await wait_for(lambda: _replicas(cluster, "auto", 3), what="the Deployment at 3 replicas")
    assert deployment["spec"]["replicas"] == 3
    # The p95 the operator recorded is what the server measured: inside its observed buckets, and it
    # accounts for the decision (ceil(1 × p95 / target), clamped to maxReplicas).
    p95_ms = model["status"]["p95InterTokenLatencyMs"]
    lower, upper, count = observed_bucket_range_ms(scrape(tandem_server.metrics_port))
    assert count > 0 and lower <= p95_ms <= upper, (p95_ms, lower, upper, count)
    assert min(3, math.ceil(p95_ms / TINY_TARGET_MS)) == 3
    assert model["status"]["lastScaleTime"].endswith("Z")
    assert condition(model, "ScalingActive")["status"] == "True"
    (event,) = await wait_for(lambda: cluster.events("ScaledUp"), what="a ScaledUp event")
    assert "1 -> 3 replicas" in event["message"]


async def test_unreadable_metrics_make_no_decision(cluster, operator):
    await cluster.create_model(hybrid_model("blind", autoscaling=AUTOSCALING))
    # Ready, but nothing listens on its metrics port.
    await cluster.create(core_path("pods"), pod("blind-1", "blind", metrics_port=1))

    await wait_for(lambda: _is(scaling_reason(cluster, "blind"), "FailedGetMetrics"), what="FailedGetMetrics")
    model = await cluster.get(model_path("blind"))
    assert condition(model, "ScalingActive")["status"] == "False"
    assert "127.0.0.1:1/metrics" in condition(model, "ScalingActive")["message"]
    assert model["spec"]["replicas"] == 1
    await wait_for(lambda: cluster.events("FailedGetMetrics"), what="a FailedGetMetrics event")


async def test_lowered_max_replicas_holds_while_prometheus_is_down(cluster, operator):
    # Replicas settled at 5, then maxReplicas lowered to 3 (to free GPUs) while Prometheus is down.
    autoscaling = dict(AUTOSCALING, maxReplicas=3,
                       metrics={"source": "Prometheus", "prometheus": {"url": "http://127.0.0.1:1"}})
    await cluster.create_model(hybrid_model("capped", replicas=5, autoscaling=autoscaling))
    await cluster.create(core_path("pods"), pod("capped-1", "capped"))

    model = await wait_for(lambda: _with_status(cluster, "capped", "desiredReplicas", 3), what="desiredReplicas 3")
    assert model["spec"]["replicas"] == 3
    await wait_for(lambda: _replicas(cluster, "capped", 3), what="the Deployment at 3 replicas")
    (event,) = await wait_for(lambda: cluster.events("ScaledDown"), what="a ScaledDown event")
    assert event["message"] == "5 -> 3 replicas: above maxReplicas 3"
    # Then, within the bounds, no latency to act on: hold, and say why.
    await wait_for(lambda: _is(scaling_reason(cluster, "capped"), "FailedGetMetrics"), what="FailedGetMetrics")
    assert (await cluster.get(model_path("capped")))["spec"]["replicas"] == 3


async def test_replicas_changed_since_the_read_are_not_overwritten(cluster, operator):
    # The server answers 409 to every replicas write that names the version it was decided from,
    # as it does once someone (a `kubectl scale`) changed the HybridModel after the autoscaler read it.
    def stale(request) -> bool:
        sent = json.loads(request.text) if request.text else None  # as sent: request.data is as stored
        return isinstance(sent, dict) and "spec" in sent and bool((sent.get("metadata") or {}).get("resourceVersion"))

    cluster.kmock["patch", model_path("racy"), stale] << kmock.KubernetesError(
        status=409, reason="Conflict", message="the object has been modified; please apply your changes "
                                               "to the latest version and try again")
    autoscaling = dict(AUTOSCALING, maxReplicas=3)
    await cluster.create_model(hybrid_model("racy", replicas=5, autoscaling=autoscaling))

    # The write names the version it was decided from, and the server refuses it.
    await wait_for(lambda: [r for r in list(cluster.kmock) if r.method == "PATCH" and stale(r)],
                   what="a replicas write naming its resourceVersion")
    # KMock applies a patch even when a reaction answers an error: its Deployment follows, but the
    # operator took the 409 as a write that did not happen.
    await wait_for(lambda: _replicas(cluster, "racy", 3), what="KMock's copy rolled out")
    await wait_for(lambda: _is(scaling_reason(cluster, "racy"), "NoReadyPods"), what="the next round")
    assert "lastScaleTime" not in (await cluster.get(model_path("racy")))["status"]
    assert not await cluster.events("ScaledDown")


async def test_an_unreachable_pod_does_not_stop_scaling(cluster, operator):
    with fake_server() as metrics:
        metrics.metrics = exposition({0.05: 0.0, 0.1: 0.0, 0.25: 0.0})
        await cluster.create_model(hybrid_model("mixed", replicas=2, autoscaling=AUTOSCALING))
        await cluster.create(core_path("pods"), pod("mixed-1", "mixed", metrics_port=metrics.port))
        await cluster.create(core_path("pods"), pod("mixed-2", "mixed", metrics_port=1))  # nothing listens
        await wait_for(lambda: _is(scaling_reason(cluster, "mixed"), "NoSamples"), what="a baseline scrape")

        metrics.metrics = exposition({0.05: 0.0, 0.1: 0.0, 0.25: 100.0})  # p95 ~240 ms, target 50 ms
        model = await wait_for(lambda: _with_status(cluster, "mixed", "desiredReplicas", 4), what="desiredReplicas 4")
    active = condition(model, "ScalingActive")
    assert active["status"] == "True" and active["reason"] == "ScaleUp"
    assert "1 Ready pod(s) left out" in active["message"] and "127.0.0.1:1/metrics" in active["message"]


async def test_an_idle_model_scales_down_to_min_and_disabling_says_so(cluster, operator):
    autoscaling = dict(AUTOSCALING, windowSeconds=1, scaleDownStabilizationSeconds=0)
    with fake_server() as metrics:
        metrics.metrics = exposition({0.05: 40.0})  # served before: nothing new in any window from now
        await cluster.create_model(hybrid_model("quiet", replicas=3, autoscaling=autoscaling))
        await cluster.create(core_path("pods"), pod("quiet-1", "quiet", metrics_port=metrics.port))
        model = await wait_for(lambda: _with_status(cluster, "quiet", "desiredReplicas", 1),
                               what="scaled down to minReplicas")
    assert model["spec"]["replicas"] == 1 and "p95InterTokenLatencyMs" not in model["status"]
    (event,) = await wait_for(lambda: cluster.events("ScaledDown"), what="a ScaledDown event")
    assert "3 -> 1 replicas: idle" in event["message"]

    # Autoscaling switched off: the condition says so instead of keeping its last reason.
    await cluster.patch(model_path("quiet"), {"spec": {"autoscaling": {"enabled": False}}})
    await wait_for(lambda: _is(scaling_reason(cluster, "quiet"), "Disabled"), what="ScalingActive Disabled")
    assert condition(await cluster.get(model_path("quiet")), "ScalingActive")["status"] == "False"


async def test_scaling_active_carries_the_generation_it_was_set_for(cluster, operator):
    # As Ready, Progressing and Degraded do: which spec the condition speaks of.
    await cluster.create_model(hybrid_model("gen", autoscaling=AUTOSCALING))
    await cluster.create(core_path("pods"), pod("gen-1", "gen", metrics_port=1))  # nothing listens
    await wait_for(lambda: _is(scaling_reason(cluster, "gen"), "FailedGetMetrics"), what="FailedGetMetrics")
    assert condition(await cluster.get(model_path("gen")), "ScalingActive")["observedGeneration"] == 1

    # A spec change (the API server raises the generation) is acted on, and the condition says so.
    await cluster.patch(model_path("gen"), {"metadata": {"generation": 2},
                                            "spec": {"autoscaling": {"targetP95InterTokenLatencyMs": 40}}})
    await wait_for(lambda: _condition_generation(cluster, "gen", "FailedGetMetrics", 2), timeout=SERVER_TIMEOUT,
                   what="FailedGetMetrics at generation 2")
    await cluster.patch(model_path("gen"), {"metadata": {"generation": 3}, "spec": {"autoscaling": {"enabled": False}}})
    await wait_for(lambda: _condition_generation(cluster, "gen", "Disabled", 3), timeout=SERVER_TIMEOUT,
                   what="Disabled at generation 3")
    # Still off after another change: still Disabled, now for generation 4. (The watch can take
    # seconds to bring KMock's newer bodies to the operator.)
    await cluster.patch(model_path("gen"), {"metadata": {"generation": 4}, "spec": {"autoscaling": {"maxReplicas": 3}}})
    await wait_for(lambda: _condition_generation(cluster, "gen", "Disabled", 4), timeout=SERVER_TIMEOUT,
                   what="Disabled at generation 4")


async def _condition_generation(cluster, name, reason, generation):
    active = condition(await cluster.get(model_path(name)), "ScalingActive")
    return (active.get("reason"), active.get("observedGeneration")) == (reason, generation)


async def _is(awaitable, expected):
    return (await awaitable) == expected


async def _replicas(cluster, name, n):
    dep = await cluster.get(DEPLOYMENT(name))
    return dep if dep and dep["spec"]["replicas"] == n else None


async def _with_status(cluster, name, key, value):
    model = await cluster.get(model_path(name))
    return model if (model.get("status") or {}).get(key) == value else None
