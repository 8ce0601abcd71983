"""Prometheus metrics of one Tandem server process, served at `/metrics` over HTTP.

Names and buckets come from `tandem.contract`, which the operator reads too: the autoscaler
scales on `tandem_inter_token_latency_seconds`. Each `ServingMetrics` has its own registry so
several servers (tests) can live in one process.

The two processes of a split pair export no series of the same name: the attention process
times the expert calls it makes (`ServingMetrics`), the experts process the computing of them
(`ExpertsMetrics`), so that a sum over a pod's targets counts each call once.
"""

from __future__ import annotations

import errno
import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from tandem import contract

# No `<name>_created` series beside every counter and histogram: a series per label set that no
# dashboard or rule reads (the process start time is process_start_time_seconds), as vLLM does.
prometheus_client.disable_created_metrics()

# `outcome` label values of the requests counter.
OUTCOMES = (
    "stop",  # finished: end-of-sequence, stop string or stop token
    "length",  # finished: max_tokens or context length reached
    "cancelled",  # the client cancelled or disconnected, or the server shut down
    "invalid_argument",  # rejected: bad request
    "resource_exhausted",  # rejected: waiting queue full
    "unavailable",  # rejected: experts process down or server shutting down
    "error",  # the engine failed
)
KV_TIERS = ("device", "cpu")  # the engine's tier names (tandem.kv.cache)


class _Metrics:
    """A registry of its own, and `serve_http` to expose it."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()

    def serve_http(self, port: int, addr: str | None = None) -> "MetricsHTTPServer":
        """Serves `/metrics` on daemon threads, so no scrape waits for the engine nor the engine for
        a scrape; returns the HTTP server (`.server_port`, `.close()`).

        `addr` None: every address of the host, IPv6 and IPv4 (a pod on an IPv6-only cluster is
        scraped at its IPv6 address), or IPv4 alone where the host has no IPv6. OSError when the
        port cannot be bound."""
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be in 0..65535, got {port}")
        app = make_wsgi_app(self.registry)
        if addr is None:
            try:
                httpd = _make_server("::", port, app)
            except OSError as exc:
                no_ipv6 = isinstance(exc, socket.gaierror) or exc.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL)
                if not no_ipv6:  # the port in use, say
                    raise
                httpd = _make_server("0.0.0.0", port, app)
        else:
            httpd = _make_server(addr.strip().removeprefix("[").removesuffix("]"), port, app)  # [v6] as in a URL
        threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
        return httpd


class MetricsHTTPServer(ThreadingWSGIServer):
    """prometheus_client's threading WSGI server; an IPv6 one takes IPv4 clients too."""

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:  # whatever net.ipv6.bindv6only says
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

    def close(self) -> None:
        """Stops serving and frees the port (shutdown() alone keeps the socket listening)."""
        self.shutdown()
        self.server_close()


def _make_server(addr: str, port: int, app) -> MetricsHTTPServer:
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("MetricsHTTPServer", (MetricsHTTPServer,), {"address_family": family})
    return make_server(addr, port, app, server_class, handler_class=_QuietHandler)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - a scrape every few seconds is not news
        pass


class ServingMetrics(_Metrics):
    """The counters, gauges and histograms a server of the engine updates; `serve_http` exposes them."""

    def __init__(self, registry: CollectorRegistry | None = None):
        super().__init__(registry)
        reg, buckets = self.registry, contract.LATENCY_BUCKETS
        self.time_to_first_token = Histogram(
            contract.TIME_TO_FIRST_TOKEN, "Seconds from receiving a request to its first token.",
            buckets=contract.TIME_TO_FIRST_TOKEN_BUCKETS, registry=reg)
        self.request_queue_time = Histogram(
            contract.REQUEST_QUEUE_TIME, "Seconds from receiving a request to its first scheduling (its prefill's "
            "start): the wait for a seat in the batch and for KV blocks.",
            buckets=contract.TIME_TO_FIRST_TOKEN_BUCKETS, registry=reg)
        self.e2e_request_latency = Histogram(
            contract.E2E_REQUEST_LATENCY, "Seconds from receiving a request to its last token (all its completions).",
            buckets=contract.E2E_REQUEST_BUCKETS, registry=reg)
        self.inter_token_latency = Histogram(
            contract.INTER_TOKEN_LATENCY,
            "Seconds between consecutive generated tokens of a request (decode latency), "
            "one observation per token after the first.", buckets=buckets, registry=reg)
        self.expert_call_latency = Histogram(
            contract.EXPERT_CALL_LATENCY, "Seconds per routed-expert call (one MoE layer, one step).",
            buckets=buckets, registry=reg)
        self.cpu_attention_latency = Histogram(
            contract.CPU_ATTENTION_LATENCY,
            "Seconds per attention call over the CPU KV tier (one layer, one step, offloaded sequences).",
            buckets=buckets, registry=reg)
        self.requests = Counter(
            contract.REQUESTS, "Generate requests by outcome.", ["outcome"], registry=reg)
        self.prompt_tokens = Counter(
            contract.PROMPT_TOKENS, "Prompt tokens of admitted requests.", registry=reg)
        self.generated_tokens = Counter(
            contract.GENERATED_TOKENS, "Tokens generated.", registry=reg)
        self.prefix_cached_tokens = Counter(
            contract.PREFIX_CACHED_TOKENS, "Prompt tokens served from the prefix cache.", registry=reg)
        self.running_requests = Gauge(
            contract.RUNNING_REQUESTS, "Requests in the running batch.", registry=reg)
        self.waiting_requests = Gauge(
            contract.WAITING_REQUESTS, "Requests waiting to be scheduled (swapped ones included).",
            registry=reg)
        self.offloaded_requests = Gauge(
            contract.OFFLOADED_REQUESTS, "Running requests whose KV is on the CPU tier (decoding there).",
            registry=reg)
        self.gpu_prefill_expert_calls = Counter(
            contract.GPU_PREFILL_EXPERT_CALLS,
            "MoE layer calls of prefill chunks whose routed experts ran on the GPU, streamed from host memory.",
            registry=reg)
        self.preemptions = Counter(
            contract.PREEMPTIONS, "Running sequences preempted for want of KV blocks (swapped out, or freed to be "
            "recomputed).", registry=reg)
        self._engine_totals: dict[Counter, int] = {}  # counters of an engine's running totals: the total last seen
        self.kv_blocks_used = Gauge(
            contract.KV_BLOCKS_USED, "KV cache blocks in use, per tier.", ["tier"], registry=reg)
        self.kv_blocks_capacity = Gauge(
            contract.KV_BLOCKS_CAPACITY, "KV cache blocks, used or not, per tier.", ["tier"], registry=reg)
        # Export every label value from the start, so dashboards and the operator see zeros
        # rather than missing series.
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)
        for tier in KV_TIERS:
            self.kv_blocks_used.labels(tier=tier)
            self.kv_blocks_capacity.labels(tier=tier)

    def record_outcome(self, outcome: str) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown request outcome {outcome!r}; expected one of {OUTCOMES}")
        self.requests.labels(outcome=outcome).inc()

    def record_engine_stats(self, stats) -> None:
        """Copies an `EngineStats` into the gauges."""
        self.running_requests.set(stats.num_running)
        self.waiting_requests.set(stats.num_waiting + getattr(stats, "num_swapped", 0))
        self.offloaded_requests.set(getattr(stats, "num_offloaded", 0))
        for tier, n in stats.kv_blocks_used.items():
            self.kv_blocks_used.labels(tier=tier).set(n)
        for tier, n in stats.kv_blocks_total.items():
            self.kv_blocks_capacity.labels(tier=tier).set(n)
        # the engine's counts since it started
        self._count_up(self.gpu_prefill_expert_calls, getattr(stats, "gpu_prefill_expert_calls", 0))
        self._count_up(self.preemptions, getattr(stats, "num_preemptions", 0))

    def _count_up(self, counter: Counter, total: int) -> None:
        """Advances `counter` to an engine's running `total`."""
        seen = self._engine_totals.get(counter, 0)
        if total > seen:
            counter.inc(total - seen)
            self._engine_totals[counter] = total


class ExpertsMetrics(_Metrics):
    """What the experts process (`--role experts`) exports: the computing of the calls it answers."""

    def __init__(self, registry: CollectorRegistry | None = None):
        super().__init__(registry)
        reg, buckets = self.registry, contract.LATENCY_BUCKETS
        self.forward_latency = Histogram(
            contract.EXPERTS_FORWARD_LATENCY,
            "Seconds computing one Forward (one MoE layer, one step), waiting for other calls excluded.",
            buckets=buckets, registry=reg)
        self.forward_tokens = Counter(
            contract.EXPERTS_FORWARD_TOKENS,
            "Tokens whose routed experts this process computed, once for each MoE layer they went through.",
            registry=reg)
        self.cpu_attention_latency = Histogram(
            contract.EXPERTS_CPU_ATTENTION_LATENCY,
            "Seconds computing one CpuAttention call (one layer, one step) over the CPU KV tier.",
            buckets=buckets, registry=reg)
