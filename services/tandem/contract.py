"""What the services and the operator must agree on, in one torch-free module.

The operator imports this module and nothing else from `tandem`, so its image stays small.
Change a value here and both sides change together.
"""

# Ports and addresses.
GRPC_PORT = 50051
METRICS_PORT = 9400
EXPERTS_SOCKET = "unix:/run/tandem/experts.sock"
# An API key the Inference API requires (tandem serve --api-key; tandem.rpc.auth), from the environment:
# the operator sets it from a Secret, out of the process's arguments.
API_KEY_ENV = "TANDEM_API_KEY"
# With TLS on the gRPC port, the attention container's probes ask the health service here (--health-listen).
HEALTH_SOCKET = "unix:/run/tandem/health.sock"
# Shared-memory files both containers of a pod map, each in an emptyDir of medium Memory mounted
# at a directory of its own; the flags name a path prefix inside it (the files add suffixes).
KV_SHM_DIR = "/dev/shm/tandem/kv"  # the CPU KV tier's volume
KV_SHM_PATH = f"{KV_SHM_DIR}/tier"  # --kv-shm: tier.k, tier.v and tier.layout.json
EXPERTS_SHM_DIR = "/dev/shm/tandem/experts"  # the routed experts' weights' volume
EXPERTS_SHM_PATH = f"{EXPERTS_SHM_DIR}/weights"  # --experts-shm: weights.bin and weights.json

# gRPC service names (package tandem.v1) as the health service and reflection report them.
INFERENCE_SERVICE = "tandem.v1.Inference"
EXPERTS_SERVICE = "tandem.v1.Experts"

# Prometheus metric names (prometheus_client appends _bucket/_sum/_count, _total).
TIME_TO_FIRST_TOKEN = "tandem_time_to_first_token_seconds"
# from receiving a request to its first scheduling (its prefill's start): the wait for a seat and blocks
REQUEST_QUEUE_TIME = "tandem_request_queue_time_seconds"
E2E_REQUEST_LATENCY = "tandem_e2e_request_latency_seconds"  # from receiving a request to its last token
INTER_TOKEN_LATENCY = "tandem_inter_token_latency_seconds"
REQUESTS = "tandem_requests"  # counter, label outcome
PROMPT_TOKENS = "tandem_prompt_tokens"
GENERATED_TOKENS = "tandem_generated_tokens"
PREFIX_CACHED_TOKENS = "tandem_prefix_cached_tokens"
RUNNING_REQUESTS = "tandem_running_requests"
WAITING_REQUESTS = "tandem_waiting_requests"
KV_BLOCKS_USED = "tandem_kv_blocks_used"  # gauge, label tier
# gauge, label tier: the tier's size (not "_total", which names counters)
KV_BLOCKS_CAPACITY = "tandem_kv_blocks_capacity"
EXPERT_CALL_LATENCY = "tandem_expert_call_latency_seconds"
CPU_ATTENTION_LATENCY = "tandem_cpu_attention_latency_seconds"  # one layer's attention over the CPU KV tier
OFFLOADED_REQUESTS = "tandem_offloaded_requests"  # gauge: running requests whose KV is on the CPU tier
# counter: MoE layer calls of prefill chunks whose routed experts ran on the GPU, the weights streamed
# from host memory (tandem.experts.device_prefill); flat on a GPU node means they run on the CPU
GPU_PREFILL_EXPERT_CALLS = "tandem_gpu_prefill_expert_calls"
# counter: running sequences preempted (swapped out or freed to be recomputed) for want of KV blocks
PREEMPTIONS = "tandem_preemptions"
# The experts process (--role experts) exports these instead of the series above, so that no
# series is exported by both processes of a pair: the computing of the calls it answers.
EXPERTS_FORWARD_LATENCY = "tandem_experts_forward_latency_seconds"
EXPERTS_CPU_ATTENTION_LATENCY = "tandem_experts_cpu_attention_latency_seconds"
# counter: tokens whose routed experts the experts process computed, once for each MoE layer they went through
EXPERTS_FORWARD_TOKENS = "tandem_experts_forward_tokens"

# Histogram buckets for latencies: 1 ms to 10 s, no bound more than twice the one before from
# 2.5 ms up, so that a p95 interpolated inside a bucket (the autoscaler's, or histogram_quantile's)
# is near the truth for GPU decode (ms) and CPU decode (100s of ms to seconds) alike.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0,
)
# Time to first token includes the prefill, which for a long prompt on CPU cores takes minutes.
TIME_TO_FIRST_TOKEN_BUCKETS = LATENCY_BUCKETS + (20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
# A whole request: a long generation on CPU cores takes up to hours.
E2E_REQUEST_BUCKETS = TIME_TO_FIRST_TOKEN_BUCKETS + (1280.0, 2560.0, 5120.0)

# `tandem serve` roles and flags, as the operator renders container commands.
ROLES = ("all", "attention", "experts")
SERVE_FLAGS = {
    "model": "--model",
    "listen": "--listen",
    "metrics_port": "--metrics-port",
    "role": "--role",
    "experts": "--experts",
    "kv_shm": "--kv-shm",
    # the experts role keeps its stored weights in this shared-memory file, which the attention
    # role maps to prefill on the GPU (tandem.experts.shared_weights)
    "experts_shm": "--experts-shm",
    "device": "--device",
    "dtype": "--dtype",
    "threads": "--threads",
    "block_size": "--block-size",
    "gpu_memory_fraction": "--gpu-memory-fraction",
    "cpu_kv_gib": "--cpu-kv-gib",
    "expert_quant": "--expert-quant",
    # routed experts from a llama.cpp GGUF file (Q8_0, Q4_0, Q4_K...) instead of the checkpoint's
    # own weights; the file's types decide their format, so it excludes --expert-quant
    "experts_gguf": "--experts-gguf",
    "cpu_decode": "--cpu-decode",  # a boolean flag: the operator renders it or no_cpu_decode
    "no_cpu_decode": "--no-cpu-decode",
    "spin_us": "--spin-us",  # rendered only when spec.experts.spinMicroseconds is set
    "num_scheduler_steps": "--num-scheduler-steps",  # rendered only when spec.attention.numSchedulerSteps != 1
    # the KV cache's dtype, both tiers (vLLM's flag); rendered only when spec.kvCache.dtype != auto
    "kv_cache_dtype": "--kv-cache-dtype",
    # vLLM's flag: fcfs or priority (GenerateRequest.priority); rendered only when spec.attention.schedulingPolicy
    # is priority
    "scheduling_policy": "--scheduling-policy",
    # a boolean flag, rendered only when spec.kvCache.prefixCaching is false (on by default)
    "no_enable_prefix_caching": "--no-enable-prefix-caching",
    # TLS on the Inference API's port (vLLM's flag names): the certificate chain and key files, reloaded when
    # they change; with --ssl-ca-certs, clients must present a certificate signed by one of its CAs
    "ssl_certfile": "--ssl-certfile",
    "ssl_keyfile": "--ssl-keyfile",
    "ssl_ca_certs": "--ssl-ca-certs",
    # a second, plaintext listener serving only grpc.health.v1 (the kubelet's probes cannot speak TLS)
    "health_listen": "--health-listen",
}
EXPERT_QUANTS = ("none", "int8", "int4")
# --kv-cache-dtype: "auto" (the model's dtype) or float8 e4m3, named "fp8" or, as vLLM also names it, "fp8_e4m3"
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# --scheduling-policy: first come, first served, or by each request's priority (tandem.engine.scheduler)
SCHEDULING_POLICIES = ("fcfs", "priority")

# The experts role shares its pod's network namespace with the attention role, so its own
# metrics endpoint needs a port of its own.
EXPERTS_METRICS_PORT = 9401

# Weight-only quantization of the dense (non-expert) layers: attention, dense MLPs, shared
# experts, LM head. A flag of `tandem serve`, `generate` and `bench`, not in SERVE_FLAGS: the
# operator does not render it (its int8 kernel is a CPU one; the attention container runs on a GPU).
DENSE_QUANT_FLAG = "--dense-quant"
DENSE_QUANTS = ("none", "int8")
