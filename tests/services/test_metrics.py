"""The metrics a server exports, scraped over HTTP as Prometheus does."""

from __future__ import annotations

import socket
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tandem import contract
from tandem.metrics import OUTCOMES, ExpertsMetrics, ServingMetrics


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}} from /metrics."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
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
    assert samples[contract.KV_BLOCKS_CAPACITY][(("tier", "cpu"),)] == 32
    # a gauge: no "_total", which Prometheus's conventions (and promtool) keep for counters
    counters = (contract.REQUESTS, contract.PROMPT_TOKENS, contract.GENERATED_TOKENS, contract.PREFIX_CACHED_TOKENS,
                contract.GPU_PREFILL_EXPERT_CALLS, contract.PREEMPTIONS)
    assert not [name for name in samples if name.endswith("_total") and name.removesuffix("_total") not in counters]

    # the engine counts its GPU prefill calls and its preemptions since it started; the counters follow it
    for field, name in (("gpu_prefill_expert_calls", contract.GPU_PREFILL_EXPERT_CALLS),
                        ("num_preemptions", contract.PREEMPTIONS)):
        counted = name + "_total"
        assert scrape(port)[counted][()] == 0
        for engine_count, exported in ((4, 4), (4, 4), (10, 10)):
            m.record_engine_stats(SimpleNamespace(**{**vars(stats), field: engine_count}))
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


def test_neighbouring_latency_buckets_are_at_most_twice_apart():
    # The autoscaler's p95 (and histogram_quantile's) interpolates linearly inside a bucket: a bucket
    # from 100 to 250 ms put a CPU decode's p95 anywhere in it, up to 40 % off the truth.
    for buckets in (contract.LATENCY_BUCKETS, contract.TIME_TO_FIRST_TOKEN_BUCKETS):
        bounds = [b for b in buckets if b >= 0.0025]
        assert all(hi <= 2 * lo for lo, hi in zip(bounds, bounds[1:])), buckets
    assert contract.LATENCY_BUCKETS[0] == 0.001 and contract.LATENCY_BUCKETS[-1] == 10.0
    # the prefill of a long prompt on CPU cores takes minutes: its TTFT must not read as "over 10 s"
    m = ServingMetrics()
    m.time_to_first_token.observe(95.0)
    value = m.registry.get_sample_value
    assert value(contract.TIME_TO_FIRST_TOKEN + "_bucket", {"le": "80.0"}) == 0
    assert value(contract.TIME_TO_FIRST_TOKEN + "_bucket", {"le": "160.0"}) == 1


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def test_metrics_are_served_on_ipv6_and_ipv4_by_default():
    # The operator renders --listen [::]:50051; a pod on an IPv6-only cluster is scraped (by the
    # operator and by Prometheus) at its IPv6 address, so /metrics must listen there too.
    if not _has_ipv6_loopback():
        pytest.skip("no IPv6 on this host")
    m = ServingMetrics()
    m.generated_tokens.inc(2)
    httpd = m.serve_http(0)
    try:
        for host in ("127.0.0.1", "[::1]"):
            assert scrape(httpd.server_port, host)[contract.GENERATED_TOKENS + "_total"][()] == 2
    finally:
        httpd.close()


def test_a_host_without_ipv6_serves_metrics_on_ipv4(monkeypatch):
    import errno

    from tandem.metrics import MetricsHTTPServer

    bind = MetricsHTTPServer.server_bind

    def no_ipv6(self):  # as with net.ipv6.conf.all.disable_ipv6=1
        if self.address_family == socket.AF_INET6:
            raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")
        bind(self)

    monkeypatch.setattr(MetricsHTTPServer, "server_bind", no_ipv6)
    httpd = ServingMetrics().serve_http(0)
    try:
        assert httpd.server_address[0] == "0.0.0.0"
        assert contract.GENERATED_TOKENS + "_total" in scrape(httpd.server_port)
    finally:
        httpd.close()


def test_a_closed_endpoint_frees_its_port():
    m = ServingMetrics()
    httpd = m.serve_http(0, "127.0.0.1")
    port = httpd.server_port
    httpd.close()
    again = m.serve_http(port, "127.0.0.1")  # a server restarted in the same process gets it back
    try:
        assert contract.GENERATED_TOKENS + "_total" in scrape(port)
    finally:
        again.close()


def test_the_two_processes_of_a_pair_export_no_series_of_the_same_name():
    # A pod's two containers are two targets: a sum over them would count each expert call twice
    # (once as the attention side's round trip, once as the experts side's computing).
    def families(metrics):
        text = generate_latest(metrics.registry).decode()
        return {f.name for f in text_string_to_metric_families(text)}

    attention, experts = families(ServingMetrics()), families(ExpertsMetrics())
    assert contract.EXPERT_CALL_LATENCY in attention and contract.CPU_ATTENTION_LATENCY in attention
    assert experts == {contract.EXPERTS_FORWARD_LATENCY, contract.EXPERTS_CPU_ATTENTION_LATENCY,
                       contract.EXPERTS_FORWARD_TOKENS}
    assert not attention & experts


_SPEC = {"model": {"path": "mixtral", "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
         "image": "ghcr.io/example/tandem:0.1.0"}


def test_the_operator_reads_the_inter_token_latency_the_server_exports():
    # The contract between the two sides: the histogram's name and buckets as the operator parses a
    # pod's /metrics at the port the attention container names `metrics`, and as its default
    # Prometheus query selects it.
    from tandem_operator import containers, metrics_source
    from tandem_operator.histogram import count, quantile
    from tandem_operator.spec import parse_spec

    m = ServingMetrics()
    for seconds in (0.12,) * 19 + (0.35,):
        m.inter_token_latency.observe(seconds)
    m.time_to_first_token.observe(0.5)  # another histogram, not read
    httpd = m.serve_http(0, "127.0.0.1")
    try:
        attention = containers.build_attention_container(parse_spec(_SPEC))
        (port,) = [p for p in attention["ports"] if p["name"] == "metrics"]
        assert port["containerPort"] == contract.METRICS_PORT
        flags = attention["command"] + attention.get("args", [])
        assert flags[flags.index(contract.SERVE_FLAGS["metrics_port"]) + 1] == str(contract.METRICS_PORT)
        port["containerPort"] = httpd.server_port  # this test's server, as if it were the pod's
        pod = {"metadata": {"name": "p"}, "spec": {"containers": [attention]}, "status": {"podIP": "127.0.0.1"}}
        histogram = metrics_source.scrape_pod(pod)
    finally:
        httpd.close()
    assert count(histogram) == 20
    assert 0.1 < quantile(0.5, histogram) <= 0.15 and 0.3 < quantile(0.99, histogram) <= 0.4
    assert f"increase({contract.INTER_TOKEN_LATENCY}_bucket{{" in metrics_source.DEFAULT_PROMETHEUS_QUERY


def test_no_created_series_beside_the_counters_and_histograms(metrics):
    m, port = metrics
    m.record_outcome("stop")
    m.inter_token_latency.observe(0.01)
    text = generate_latest(m.registry).decode() + generate_latest(ExpertsMetrics().registry).decode()
    assert "_total" in text and "_bucket" in text
    assert "_created" not in text
