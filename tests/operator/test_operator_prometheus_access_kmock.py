"""The operator's autoscaler against KMock, querying a Prometheus over HTTPS with a private CA and a
bearer token, both read from Secrets that KMock serves."""

from __future__ import annotations

import base64
import logging
from dataclasses import astuple

import pytest

from fake_metrics import fake_server, vector
from hm_cluster import NS, core_path, hybrid_model, model_path, wait_for
from test_operator_kmock import condition, pod
from tls_certs import CA

TOKEN = "prometheus-token-1"
AUTOSCALING = {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetP95InterTokenLatencyMs": 50,
               "windowSeconds": 60, "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 300}


def secret(name: str, **data: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": name, "namespace": NS},
            "data": {key: base64.b64encode(value.encode()).decode() for key, value in data.items()}}


@pytest.fixture
def prometheus():
    """A Prometheus stand-in over HTTPS (certificate for 127.0.0.1 from its own CA) that wants TOKEN."""
    ca = CA()
    with fake_server(tls=astuple(ca.issue(ips=("127.0.0.1",)))) as server:
        server.authorization = f"Bearer {TOKEN}"
        server.answer = vector(({}, "0.2"))  # a p95 of 200 ms: 4× the target, so scale up to 4
        server.url, server.ca = f"https://127.0.0.1:{server.port}", ca.cert_pem
        yield server


def autoscaling(url: str) -> dict:
    return dict(AUTOSCALING, metrics={"source": "Prometheus", "prometheus": {
        "url": url, "query": "histogram_quantile(0.95, ...)",
        "tls": {"caSecret": {"name": "prometheus-ca", "key": "ca.crt"}},
        "auth": {"bearerTokenSecret": {"name": "prometheus-token", "key": "token"}}}})


async def active(cluster, name: str) -> dict:
    return condition(await cluster.get(model_path(name)), "ScalingActive")


async def test_scales_from_an_https_prometheus_with_credentials_from_secrets(cluster, operator, prometheus, caplog):
    caplog.set_level(logging.DEBUG)
    await cluster.create(core_path("secrets"), secret("prometheus-ca", **{"ca.crt": prometheus.ca}))
    await cluster.create(core_path("secrets"), secret("prometheus-token", token=TOKEN))
    await cluster.create_model(hybrid_model("secure", autoscaling=autoscaling(prometheus.url)))
    await cluster.create(core_path("pods"), pod("secure-1", "secure"))

    async def scaled():
        model = await cluster.get(model_path("secure"))
        return model if (model.get("status") or {}).get("desiredReplicas") == 4 else None

    model = await wait_for(scaled, what="desiredReplicas 4 from the HTTPS Prometheus")
    assert model["spec"]["replicas"] == 4 and model["status"]["p95InterTokenLatencyMs"] == 200
    assert prometheus.headers[0]["Authorization"] == f"Bearer {TOKEN}"
    scaling = condition(model, "ScalingActive")
    assert (scaling["status"], scaling["reason"], scaling["observedGeneration"]) == ("True", "ScaleUp", 1)

    # The token is rotated on the server's side only: the next step reads the old one from the
    # Secret, is refused, and says whose credentials, never the token itself.
    prometheus.authorization = "Bearer prometheus-token-2"
    refused = await wait_for(lambda: _reason(cluster, "secure", "FailedGetMetrics"), what="FailedGetMetrics")
    assert "HTTP 401 Unauthorized: the server refused the credentials of metrics.prometheus.auth." \
           "bearerTokenSecret prometheus-token" in refused["message"]
    (event,) = await wait_for(lambda: cluster.events("FailedGetMetrics"), what="a FailedGetMetrics event")
    assert TOKEN not in refused["message"] + event["message"]
    # Rotated in the Secret too: read again at the next step.
    await cluster.patch(core_path("secrets", "prometheus-token"),
                        {"data": {"token": base64.b64encode(b"prometheus-token-2").decode()}})
    async def read_again():
        scaling = await active(cluster, "secure")
        return scaling if scaling.get("status") == "True" else None

    await wait_for(read_again, what="reading again with the new token")
    assert "prometheus-token-1" not in caplog.text and "prometheus-token-2" not in caplog.text
    assert "no scaling decision: https://127.0.0.1" in caplog.text  # the operator's log, captured
    # Secrets are read one by name (all the operator's role allows), never listed or watched.
    calls = {(str(r.method).upper().rsplit(".", 1)[-1], r.url.path) for r in list(cluster.kmock)
             if "/secrets" in r.url.path}
    reads = {(method, path) for method, path in calls if method not in ("POST", "PATCH")}  # the test's own
    assert reads == {("GET", core_path("secrets", name)) for name in ("prometheus-ca", "prometheus-token")}


async def test_a_missing_secret_is_named_in_scaling_active(cluster, operator, prometheus):
    await cluster.create(core_path("secrets"), secret("prometheus-ca", **{"ca.crt": prometheus.ca}))
    await cluster.create_model(hybrid_model("locked", autoscaling=autoscaling(prometheus.url)))
    await cluster.create(core_path("pods"), pod("locked-1", "locked"))

    failed = await wait_for(lambda: _reason(cluster, "locked", "FailedGetMetrics"), what="FailedGetMetrics")
    assert failed["status"] == "False" and failed["observedGeneration"] == 1
    assert failed["message"] == f"metrics.prometheus.auth.bearerTokenSecret: Secret {NS}/prometheus-token not found"
    (event,) = await wait_for(lambda: cluster.events("FailedGetMetrics"), what="a FailedGetMetrics event")
    assert "Secret models/prometheus-token not found" in event["message"]
    assert not prometheus.headers  # nothing was sent without the credentials the spec asks for
    assert (await cluster.get(model_path("locked")))["spec"]["replicas"] == 1

    # The Secret appears: the next step reads it and scales.
    await cluster.create(core_path("secrets"), secret("prometheus-token", token=TOKEN))
    await wait_for(lambda: _reason(cluster, "locked", "ScaleUp"), what="ScaleUp once the Secret exists")


async def _reason(cluster, name: str, reason: str) -> dict | None:
    scaling = await active(cluster, name)
    return scaling if scaling.get("reason") == reason else None
