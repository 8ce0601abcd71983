"""Where latency comes from: unreadable pods are left out, NaN is no sample, a whole quiet window
is idle, and the default PromQL selects this model's series only."""

from __future__ import annotations

import math
import types

import pytest

from fake_metrics import exposition, fake_server, vector
from tandem_operator import names
from tandem_operator.metrics_source import (DEFAULT_PROMETHEUS_QUERY, MetricsError, PodWindow, prometheus_query,
                                            read_pods, read_prometheus)
from tandem_operator.scaling import measure
from tandem_operator.spec import parse_spec


@pytest.fixture
def server():
    with fake_server() as state:
        yield state


def pod(name: str, port: int) -> dict:
    return {"metadata": {"name": name, "uid": f"uid-{name}", "labels": names.common_labels("mx")},
            "spec": {"containers": [{"name": "attention", "ports": [{"name": "metrics", "containerPort": port}]}]},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


def spec(source: str = "Pods", url: str = "http://127.0.0.1:1", window: int = 60, query: str | None = None):
    metrics = {"source": source}
    if source == "Prometheus":
        metrics["prometheus"] = {"url": url, **({"query": query} if query else {})}
    return parse_spec({"model": {"volume": {"emptyDir": {}}}, "image": "x", "autoscaling": {
        "enabled": True, "maxReplicas": 4, "targetP95InterTokenLatencyMs": 50, "windowSeconds": window,
        "metrics": metrics}})


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
def test_non_finite_prometheus_samples_are_no_samples(server, value):
    url = f"http://127.0.0.1:{server.port}"
    server.answer = vector(({}, value))  # histogram_quantile over no observations answers NaN
    assert read_prometheus(url, "histogram_quantile(0.95, ...)") is None
    server.answer = vector(({"le": "0.05"}, value), ({"le": "+Inf"}, "3"))
    assert read_prometheus(url, "q") is None
    server.answer = {"status": "success", "data": {"resultType": "scalar", "result": [0, value]}}
    measured = measure(spec("Prometheus", url, query="q"), "models", "mx", types.SimpleNamespace(), 0.0)
    assert measured.p95_s is None and not measured.idle


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-1"])
def test_a_pod_exporting_a_non_finite_count_is_left_out(server, value):
    window, broken = PodWindow(), pod("broken", server.port)
    with fake_server() as healthy:
        good = pod("good", healthy.port)
        healthy.metrics = exposition({0.05: 10.0})
        server.metrics = exposition({0.05: 1.0}).replace(" 1.0\n", f" {value}\n", 1)
        first = read_pods([broken, good], window, 0.0, 60)
        healthy.metrics = exposition({0.05: 30.0})
        second = read_pods([broken, good], window, 10.0, 60)
    assert len(first.skipped) == len(second.skipped) == 1 and "not a count" in second.skipped[0]
    assert second.observed == {0.05: 20.0, math.inf: 20.0}  # the good pod's, not NaN or inf
    with pytest.raises(MetricsError, match="not a count"):  # alone: no reading at all, so no decision
        read_pods([broken], PodWindow(), 0.0, 60)


def test_prometheus_series_of_the_same_bucket_are_summed(server):
    # A custom query without `sum by (le)`: one series per pod and bucket.
    url = f"http://127.0.0.1:{server.port}"
    server.answer = vector(({"le": "0.05", "pod": "a"}, "90"), ({"le": "+Inf", "pod": "a"}, "90"),
                           ({"le": "0.05", "pod": "b"}, "0"), ({"le": "+Inf", "pod": "b"}, "10"))
    assert read_prometheus(url, "increase(x_bucket[1m])") == {0.05: 90.0, math.inf: 100.0}


def test_an_unreadable_pod_is_left_out(server):
    window, good, dead = PodWindow(), pod("good", server.port), pod("dead", 1)
    server.metrics = exposition({0.05: 10.0})
    first = read_pods([good, dead], window, 0.0, 60)
    assert len(first.skipped) == 1 and "127.0.0.1:1/metrics" in first.skipped[0]
    server.metrics = exposition({0.05: 30.0})
    second = read_pods([good, dead], window, 10.0, 60)
    assert second.observed[math.inf] == 20.0
    with pytest.raises(MetricsError, match="127.0.0.1:1/metrics"):
        read_pods([dead], PodWindow(), 0.0, 60)


def test_a_pod_read_again_after_a_failed_scrape_is_not_new():
    window = PodWindow()
    window.record(0.0, {"a": {math.inf: 100.0}}, 60)
    window.record(10.0, {}, 60, unread=["a"])  # a's scrape failed: it keeps its last histogram
    window.record(70.0, {"a": {math.inf: 103.0}}, 60)
    assert window.scrapes[0][0] == 10.0
    assert window.increase() == {math.inf: 3.0}  # not all 103 of its observations


def test_no_decode_steps_in_a_whole_window_is_idle(server):
    memo, quiet = types.SimpleNamespace(), [pod("a", server.port)]
    server.metrics = exposition({0.05: 5.0})  # no new observations from here on
    assert measure(spec(window=60), "models", "mx", memo, 0.0, quiet).p95_s is None
    part = measure(spec(window=60), "models", "mx", memo, 30.0, quiet)
    assert (part.p95_s, part.idle) == (None, False)  # half a window: too short a look
    whole = measure(spec(window=60), "models", "mx", memo, 60.0, quiet)
    assert (whole.p95_s, whole.idle) == (None, True)
    # From Prometheus: the model's series exist and did not increase.
    url = f"http://127.0.0.1:{server.port}"
    server.answer = vector(({"le": "0.05"}, "0"), ({"le": "+Inf"}, "0"))
    assert measure(spec("Prometheus", url), "models", "mx", memo, 0.0).idle
    server.answer = vector()  # nothing matched: unknown, not idle
    assert not measure(spec("Prometheus", url), "models", "mx", memo, 0.0).idle


def test_default_query_selects_this_models_series_only():
    query = prometheus_query(None, "models", "mixtral", 60)
    assert 'namespace="models"' in query and 'tandem_dev_hybridmodel="mixtral"' in query
    assert "pod=~" not in query and "[60s]" in query
    # What the default selects on is the pods' model label, as Prometheus spells label names.
    assert DEFAULT_PROMETHEUS_QUERY.count("tandem_dev_hybridmodel") == 1
    assert names.MODEL_LABEL.replace(".", "_").replace("/", "_") == "tandem_dev_hybridmodel"
