"""End to end: a real Prometheus server scrapes a live metrics endpoint under load, and the
autoscaler reads the p95 from Prometheus and decides to scale.

The endpoint serves the inter-token latency histogram exactly as `tandem serve` does (name and
buckets from tandem.contract). Prometheus comes from the Debian package (installed by .ci/run);
on CI a missing binary is a failure, elsewhere a skip.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
import types
import urllib.parse
import urllib.request

import pytest
import yaml
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from tandem import contract
from tandem_operator import autoscaler
from tandem_operator.scaling import measure_p95
from tandem_operator.spec import parse_spec

NAMESPACE, NAME = "models", "mixtral"
STARTUP_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("prometheus is not installed (apt-get install prometheus); CI must run this test")
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    return path


@pytest.fixture
def model_metrics():
    registry = CollectorRegistry()
    histogram = Histogram(contract.INTER_TOKEN_LATENCY, "Time between consecutive generated tokens.",
                          buckets=contract.LATENCY_BUCKETS, registry=registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield types.SimpleNamespace(port=server.server_port, histogram=histogram)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def prometheus(prometheus_binary, model_metrics, tmp_path):
    """A Prometheus scraping the endpoint every second, labelled as the pod of a HybridModel."""
    port = _free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{
            "job_name": "tandem",
            "static_configs": [{"targets": [f"127.0.0.1:{model_metrics.port}"],
                                "labels": {"namespace": NAMESPACE, "pod": f"{NAME}-7d9f-abcde"}}],
        }],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(tmp_path / "prometheus.log", "wb")
    process = subprocess.Popen(
        [prometheus_binary, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _poll(lambda: _get(f"{url}/-/ready") is not None, "Prometheus ready", process, tmp_path)
        yield types.SimpleNamespace(url=url, process=process, log=tmp_path / "prometheus.log")
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def test_autoscaler_scales_from_prometheus(prometheus, model_metrics):
    spec = parse_spec({
        "model": {"volume": {"emptyDir": {}}}, "image": "x", "replicas": 2,
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 8, "targetP95InterTokenLatencyMs": 40,
                        "windowSeconds": 30, "metrics": {"source": "Prometheus",
                                                         "prometheus": {"url": prometheus.url}}},
    })
    # Wait until Prometheus has scraped the (still empty) histogram twice, so increase() has a base.
    series = f'{contract.INTER_TOKEN_LATENCY}_count{{namespace="{NAMESPACE}"}}[30s]'
    _poll(lambda: _sample_count(prometheus.url, series) >= 2, "two scrapes", prometheus.process, None)

    # Load: decode steps of ~100-200 ms, well above the 40 ms target.
    stop = threading.Event()

    def load():
        while not stop.is_set():
            for latency in (0.09, 0.12, 0.15, 0.2):
                model_metrics.histogram.observe(latency)
            stop.wait(0.01)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    memo = types.SimpleNamespace()
    try:
        p95 = _poll(lambda: measure_p95(spec, NAMESPACE, NAME, memo, time.monotonic()), "a p95 from Prometheus",
                    prometheus.process, None)
    finally:
        stop.set()
        loader.join(timeout=5)

    assert 0.1 < p95 <= 0.25
    decision, _ = autoscaler.decide(spec.replicas, p95, spec.autoscaling, [], now=time.monotonic())
    # ceil(2 × p95 / 40 ms) is at least 6, within maxReplicas 8.
    assert decision.reason == "ScaleUp" and 6 <= decision.replicas <= 8


def _poll(check, what, process, tmp_path):
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"prometheus exited with {process.returncode} while waiting for {what}")
        value = check()
        if value:
            return value
        time.sleep(0.2)  # a polling step, bounded by the deadline
    raise AssertionError(f"timed out waiting for {what}")


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
