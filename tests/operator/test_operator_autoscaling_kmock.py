"""The operator's autoscaling timer against KMock, reading a live metrics endpoint."""

from __future__ import annotations

from hm_cluster import DEPLOYMENT, core_path, hybrid_model, model_path, wait_for
from test_operator_kmock import condition, pod

AUTOSCALING = {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetP95InterTokenLatencyMs": 50,
               "windowSeconds": 60, "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 300}


async def scaling_reason(cluster, name):
    model = await cluster.get(model_path(name))
    return condition(model, "ScalingActive").get("reason")


async def test_scales_up_from_measured_decode_latency(cluster, operator, metrics_endpoint):
    await cluster.create_model(hybrid_model("auto", autoscaling=AUTOSCALING))
    await cluster.create(core_path("pods"), pod("auto-1", "auto", metrics_port=metrics_endpoint.port))
    # The first scrape is the window's baseline: nothing observed yet, so no decision.
    await wait_for(lambda: _is(scaling_reason(cluster, "auto"), "NoSamples"), what="a baseline scrape")

    # Decode steps of ~200 ms against a 50 ms target: ceil(1 × 4.x) = 5, clamped to maxReplicas 4.
    metrics_endpoint.observe(0.2, times=200)

    async def scaled():
        model = await cluster.get(model_path("auto"))
        return model if model["spec"]["replicas"] == 4 else None

    model = await wait_for(scaled, what="spec.replicas scaled to 4")
    deployment = await wait_for(lambda: _replicas(cluster, "auto", 4), what="the Deployment at 4 replicas")
    assert deployment["spec"]["replicas"] == 4
    model = await wait_for(lambda: _with_status(cluster, "auto", "desiredReplicas", 4), what="desiredReplicas 4")
    assert 100 < model["status"]["p95InterTokenLatencyMs"] <= 250
    assert model["status"]["lastScaleTime"].endswith("Z")
    (event,) = await wait_for(lambda: cluster.events("ScaledUp"), what="a ScaledUp event")
    assert "1 -> 4 replicas" in event["message"]


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


async def _is(awaitable, expected):
    return (await awaitable) == expected


async def _replicas(cluster, name, n):
    dep = await cluster.get(DEPLOYMENT(name))
    return dep if dep and dep["spec"]["replicas"] == n else None


async def _with_status(cluster, name, key, value):
    model = await cluster.get(model_path(name))
    return model if (model.get("status") or {}).get(key) == value else None
