"""The engine's settings (EngineConfig, checked on construction), the context length they give a
model, and the counts `LLMEngine.stats` reports."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.contract import KV_CACHE_DTYPES, SCHEDULING_POLICIES
from tandem.experts.device_prefill import DEFAULT_MIN_TOKENS as DEVICE_PREFILL_TOKENS

@dataclass
class EngineConfig:
    block_size: int = 16
    num_device_blocks: int | None = None  # None: size from device_kv_gib / gpu_memory_fraction
    num_cpu_blocks: int | None = None  # None: size from cpu_kv_gib
    device_kv_gib: float = 1.0  # KV budget when the compute device is the CPU
    gpu_memory_fraction: float = 0.9  # share of free GPU memory (after weights) for the device tier
    cpu_kv_gib: float = 1.0
    kv_shm_path: str | None = None  # back the CPU tier with this shared-memory file
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's, capped at DEFAULT_MAX_MODEL_LEN
    max_waiting: int = 1024
    enable_prefix_caching: bool = True
    # A sequence the device tier cannot hold moves to the CPU tier and decodes there (attention on
    # the CPU socket) rather than pausing until the device has room; see tandem.engine.scheduler.
    cpu_decode: bool = True
    # On CUDA, decode steps replay CUDA graphs (tandem.engine.cuda_graph) for batches of up to
    # min(max_num_seqs, MAX_GRAPH_BATCH) sequences; True: every step runs eagerly, as vLLM's flag.
    enforce_eager: bool = False
    # On CUDA, prefill chunks of at least this many tokens run their routed experts on the GPU,
    # the weights streamed from host memory (tandem.experts.device_prefill); 0: always the CPU.
    device_prefill_tokens: int = DEVICE_PREFILL_TOKENS
    # ... with the experts' host memory page-locked (cudaHostRegister), so those copies run at full
    # speed: 7.75-8.7x the prefill from pageable memory on an H100 (benchmarks/RESULTS.md, round
    # sixteen). The pages then stay in RAM; False leaves them pageable.
    page_lock_experts: bool = True
    # Decode tokens per engine step while only decodes run (vLLM's multi-step scheduling; see
    # tandem.engine.scheduler): the scheduling between forward passes runs once per this many
    # tokens. step(emit=...) streams each token as its step of the run ends (the serving loop
    # does); step() returns them together at the run's end. 1: a step per token.
    num_scheduler_steps: int = 1
    # The KV cache's dtype in both tiers (vLLM's --kv-cache-dtype): "auto", the model's; "fp8" (or
    # "fp8_e4m3"), float8 e4m3 with the checkpoint's KV scales or 1.0: half a bf16 block's bytes,
    # twice the tokens in the same memory (tandem.kv.fp8).
    kv_cache_dtype: str = "auto"
    # Which request runs first (vLLM's --scheduling-policy): "fcfs", by arrival; "priority", by each
    # request's priority, lower first, then arrival (see tandem.engine.scheduler).
    scheduling_policy: str = "fcfs"

    DEFAULT_MAX_MODEL_LEN = 8192

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting", "num_scheduler_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.device_prefill_tokens < 0:
            raise ValueError(f"device_prefill_tokens must be >= 0, got {self.device_prefill_tokens}")
        if not 0 <= self.cpu_kv_gib < math.inf:  # NaN fails too
            raise ValueError(f"cpu_kv_gib must be a number of GiB >= 0, got {self.cpu_kv_gib}")
        if not 0 < self.device_kv_gib < math.inf:
            raise ValueError(f"device_kv_gib must be a number of GiB > 0, got {self.device_kv_gib}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.num_device_blocks is not None and self.num_device_blocks < 1:
            raise ValueError(f"num_device_blocks must be at least 1, got {self.num_device_blocks}")
        if self.num_cpu_blocks is not None and self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be at least 0, got {self.num_cpu_blocks}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")


def context_length(model_config, config: EngineConfig) -> int:
    """The engine's max_model_len: config.max_model_len, which may not exceed the model's context
    (ValueError, as vLLM refuses it), or by default the model's context up to DEFAULT_MAX_MODEL_LEN."""
    limit = model_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} is more than the model's context, "
                         f"max_position_embeddings {limit}")
    return min(limit, config.max_model_len or config.DEFAULT_MAX_MODEL_LEN)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_offloaded: int = 0  # running with their KV on the CPU tier
    kv_blocks_used: dict[str, int] = field(default_factory=dict)
    kv_blocks_total: dict[str, int] = field(default_factory=dict)
    prefix_cache_hit_tokens: int = 0
    gpu_prefill_expert_calls: int = 0  # MoE layer calls of prefill chunks computed on the GPU, so far
    num_preemptions: int = 0  # running sequences preempted for want of blocks, so far
