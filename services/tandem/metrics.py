"""Prometheus metrics of one Tandem server process, served at `/metrics` over HTTP.

Names and buckets come from `tandem.contract`, which the operator reads too: the autoscaler
scales on `tandem_inter_token_latency_seconds`. Each `ServingMetrics` has its own registry so
several servers (tests) can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tandem import contract

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


class ServingMetrics:
    """The counters, gauges and histograms a server updates; `serve_http` exposes them."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        reg, buckets = self.registry, contract.LATENCY_BUCKETS
        self.time_to_first_token = Histogram(
            contract.TIME_TO_FIRST_TOKEN, "Seconds from receiving a request to its first token.",
            buckets=buckets, registry=reg)
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
        self._gpu_prefill_expert_calls = 0  # the engine's count when last recorded
        self.kv_blocks_used = Gauge(
            contract.KV_BLOCKS_USED, "KV cache blocks in use, per tier.", ["tier"], registry=reg)
        self.kv_blocks_total = Gauge(
            contract.KV_BLOCKS_TOTAL, "KV cache blocks, per tier.", ["tier"], registry=reg)
        # Export every label value from the start, so dashboards and the operator see zeros
        # rather than missing series.
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)
        for tier in KV_TIERS:
            self.kv_blocks_used.labels(tier=tier)
            self.kv_blocks_total.labels(tier=tier)

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
            self.kv_blocks_total.labels(tier=tier).set(n)
        calls = getattr(stats, "gpu_prefill_expert_calls", 0)  # the engine's count since it started
        if calls > self._gpu_prefill_expert_calls:
            self.gpu_prefill_expert_calls.inc(calls - self._gpu_prefill_expert_calls)
            self._gpu_prefill_expert_calls = calls

    def serve_http(self, port: int, addr: str = "0.0.0.0"):
        """Serves `/metrics` on a daemon thread; returns the HTTP server (`.server_port`, `.shutdown()`)."""
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be in 0..65535, got {port}")
        httpd, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return httpd
