"""End to end: a real Prometheus server scrapes a real `tandem serve` under load; the autoscaler,
and then the real operator (kopf against KMock), scale a HybridModel from what it scraped.

Prometheus comes from the Debian package (installed by .ci/run); on CI a missing binary is a
failure, elsewhere a skip. One `tandem serve` (demo Mixtral on CPU) serves the whole module.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
import types
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tandem import contract
from tandem_operator import autoscaler
from tandem_operator.metrics_source import MODEL_SERIES_LABEL
from tandem_operator.scaling import measure_p95
from tandem_operator.spec import parse_spec

# The operator tests' KMock and kopf fixtures, and their `tandem serve` helpers.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from hm_cluster import DEPLOYMENT, core_path, hybrid_model, model_path, wait_for  # noqa: E402
from kopf_fixtures import cluster, kmock_options, operator  # noqa: E402,F401 (fixtures)
from tandem_serve import drive_load, observed_bucket_range_ms, scrape, tandem_serve  # noqa: E402
from test_operator_kmock import pod  # noqa: E402

from prometheus_process import prometheus_process, wait_until  # noqa: E402

NAMESPACE, NAME = "models", "mixtral"
STARTUP_TIMEOUT_S = 60
# A demo Mixtral decodes a token in far more than 10 µs on any CPU: the decision is always a scale-up.
TINY_TARGET_MS = 0.01


@pytest.fixture(scope="module")
def tandem_server(tmp_path_factory):
    with tandem_serve(tmp_path_factory.mktemp("tandem-serve")) as server:
        yield server


@pytest.fixture
def prometheus(prometheus_binary, tandem_server, tmp_path):
    """A Prometheus scraping `tandem serve`'s /metrics every second, labelled as a pod of HybridModel NAME.

    The labels are those the chart's ServiceMonitor (or a `kubernetes-pods` job) gives a model's
    series: the operator's default query selects on the model label.
    """
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{
            "job_name": "tandem",
            "static_configs": [{"targets": [f"127.0.0.1:{tandem_server.metrics_port}"],
                                "labels": {"namespace": NAMESPACE, "pod": f"{NAME}-7d9f-abcde",
                                           MODEL_SERIES_LABEL: NAME}}],
        }],
    }
    ready = lambda url: _get(f"{url}/-/ready") is not None  # noqa: E731
    with prometheus_process(prometheus_binary, tmp_path, config, ready=ready) as (url, process):
        yield types.SimpleNamespace(url=url, process=process, log=tmp_path / "prometheus.log")


def test_autoscaler_scales_from_prometheus(prometheus, tandem_server):
    spec = parse_spec({
        "model": {"volume": {"emptyDir": {}}}, "image": "x", "replicas": 2,
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 8,
                        "targetP95InterTokenLatencyMs": TINY_TARGET_MS, "windowSeconds": 30,
                        "metrics": {"source": "Prometheus", "prometheus": {"url": prometheus.url}}},
    })
    _wait_for_two_scrapes(prometheus)
    assert asyncio.run(drive_load(tandem_server.address)) > 0

    memo = types.SimpleNamespace()
    p95 = wait_until(lambda: measure_p95(spec, NAMESPACE, NAME, memo, time.monotonic()), "a p95 from Prometheus",
                     prometheus.process)

    _assert_within_observed(p95 * 1000.0, tandem_server)
    decision, _ = autoscaler.decide(spec.replicas, p95, spec.autoscaling, [], now=time.monotonic())
    # ceil(2 × p95 / 10 µs) is far above maxReplicas 8.
    assert decision.reason == "ScaleUp" and decision.replicas == min(8, math.ceil(2 * p95 * 1000 / TINY_TARGET_MS))


async def test_operator_scales_from_prometheus(prometheus, tandem_server, cluster, operator):
    autoscaling = {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetP95InterTokenLatencyMs": TINY_TARGET_MS,
                   "windowSeconds": 30, "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 300,
                   "metrics": {"source": "Prometheus", "prometheus": {"url": prometheus.url}}}
    await asyncio.to_thread(_wait_for_two_scrapes, prometheus)
    model = hybrid_model(NAME, autoscaling=autoscaling)
    model["metadata"]["namespace"] = NAMESPACE
    await cluster.create_model(model)
    # The pod Prometheus scrapes, Ready: the autoscaler scales from the Ready pods it measured.
    await cluster.create(core_path("pods"), pod(f"{NAME}-7d9f-abcde", NAME))
    # Nothing decoded in the window yet: Prometheus answers zero increases, the model is idle at
    # minReplicas already.
    await wait_for(lambda: _reason_is(cluster, "Idle"), timeout=STARTUP_TIMEOUT_S, what="Idle")
    assert (await cluster.get(model_path(NAME)))["spec"]["replicas"] == 1

    assert await drive_load(tandem_server.address) > 0

    async def scaled():
        body = await cluster.get(model_path(NAME))
        return body if (body.get("status") or {}).get("desiredReplicas") == 3 else None

    body = await wait_for(scaled, timeout=STARTUP_TIMEOUT_S, what="desiredReplicas 3 from Prometheus")
    assert body["spec"]["replicas"] == 3
    p95_ms = body["status"]["p95InterTokenLatencyMs"]
    _assert_within_observed(p95_ms, tandem_server)
    assert body["status"]["lastScaleTime"].endswith("Z")
    active = _condition(body, "ScalingActive")
    assert active["status"] == "True" and f"p95 {p95_ms:g} ms" in active["message"]

    async def deployment_at_3():
        dep = await cluster.get(DEPLOYMENT(NAME))
        return dep if dep and dep["spec"]["replicas"] == 3 else None

    await wait_for(deployment_at_3, what="the Deployment at 3 replicas")
    (event,) = await wait_for(lambda: cluster.events("ScaledUp"), what="a ScaledUp event")
    assert "1 -> 3 replicas" in event["message"]


def _wait_for_two_scrapes(prometheus) -> None:
    """Until Prometheus holds two samples of the histogram, so increase() has a baseline before the load."""
    series = f'{contract.INTER_TOKEN_LATENCY}_count{{namespace="{NAMESPACE}"}}[30s]'
    wait_until(lambda: _sample_count(prometheus.url, series) >= 2, "two scrapes", prometheus.process)


def _assert_within_observed(p95_ms: float, tandem_server) -> None:
    """The p95 lies within the buckets in which `tandem serve` itself recorded observations."""
    lower, upper, count = observed_bucket_range_ms(scrape(tandem_server.metrics_port))
    assert count > 0 and lower <= p95_ms <= upper, (p95_ms, lower, upper, count)


def _condition(body: dict, type_: str) -> dict:
    return next((c for c in (body.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


async def _reason_is(cluster, reason: str) -> bool:
    body = await cluster.get(model_path(NAME))
    return _condition(body or {}, "ScalingActive").get("reason") == reason


def _get(url: str) -> str | None:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=2) as response:
            return response.read().decode()
    except OSError:
        return None


def _sample_count(url: str, selector: str) -> int:
    text = _get(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': selector})}")
    if not text:
        return 0
    result = json.loads(text).get("data", {}).get("result", [])
    return len(result[0]["values"]) if result else 0
