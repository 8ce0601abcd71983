"""The metrics a server exports, scraped over HTTP as Prometheus does."""

from __future__ import annotations

import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem import contract
from tandem.metrics import OUTCOMES, ServingMetrics


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}} from /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


@pytest.fixture
def metrics():
    m = ServingMetrics()
    httpd = m.serve_http(0, "127.0.0.1")
    yield m, httpd.server_port
    httpd.shutdown()


def test_latency_histograms_have_buckets_from_1ms_to_10s(metrics):
    m, port = metrics
    for seconds in (0.0004, 0.003, 0.02, 20.0):
        m.inter_token_latency.observe(seconds)
    m.time_to_first_token.observe(0.2)
    samples = scrape(port)
    buckets = samples[contract.INTER_TOKEN_LATENCY + "_bucket"]
    bounds = sorted(float(dict(k)["le"]) for k in buckets)
    assert bounds[0] == 0.001 and bounds[-2] == 10.0 and bounds[-1] == float("inf")
    assert buckets[(("le", "0.001"),)] == 1 and buckets[(("le", "0.005"),)] == 2
    assert buckets[(("le", "10.0"),)] == 3 and buckets[(("le", "+Inf"),)] == 4
    assert samples[contract.TIME_TO_FIRST_TOKEN + "_count"][()] == 1
    assert samples[contract.EXPERT_CALL_LATENCY + "_count"][()] == 0


def test_counters_and_gauges_by_label(metrics):
    m, port = metrics
    m.record_outcome("stop")
    m.record_outcome("stop")
    m.record_outcome("resource_exhausted")
    m.generated_tokens.inc(7)
    stats = SimpleNamespace(num_running=3, num_waiting=2, num_swapped=1,
                            kv_blocks_used={"device": 5, "cpu": 1}, kv_blocks_total={"device": 64, "cpu": 32})
    m.record_engine_stats(stats)
    samples = scrape(port)
    requests = samples[contract.REQUESTS + "_total"]
    assert requests[(("outcome", "stop"),)] == 2
    assert requests[(("outcome", "resource_exhausted"),)] == 1
    assert {dict(k)["outcome"] for k in requests} == set(OUTCOMES)  # every outcome exported from the start
    assert samples[contract.GENERATED_TOKENS + "_total"][()] == 7
    assert samples[contract.RUNNING_REQUESTS][()] == 3
    assert samples[contract.WAITING_REQUESTS][()] == 3  # swapped-out requests wait too
    assert samples[contract.KV_BLOCKS_USED][(("tier", "device"),)] == 5
    assert samples[contract.KV_BLOCKS_TOTAL][(("tier", "cpu"),)] == 32

    # the engine counts its GPU prefill calls since it started; the counter follows it
    counted = contract.GPU_PREFILL_EXPERT_CALLS + "_total"
    assert scrape(port)[counted][()] == 0
    for engine_count, exported in ((4, 4), (4, 4), (10, 10)):
        m.record_engine_stats(SimpleNamespace(**{**vars(stats), "gpu_prefill_expert_calls": engine_count}))
        assert scrape(port)[counted][()] == exported


def test_unknown_outcome_is_refused():
    with pytest.raises(ValueError, match="unknown request outcome 'ok'"):
        ServingMetrics().record_outcome("ok")


def test_bad_port_is_refused():
    with pytest.raises(ValueError, match="metrics port must be in 0..65535"):
        ServingMetrics().serve_http(70000)


def test_two_servers_in_one_process_do_not_share_metrics():
    a, b = ServingMetrics(), ServingMetrics()
    a.generated_tokens.inc(3)
    assert b.registry.get_sample_value(contract.GENERATED_TOKENS + "_total") == 0
    assert a.registry.get_sample_value(contract.GENERATED_TOKENS + "_total") == 3
