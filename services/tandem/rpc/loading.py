"""What each `tandem serve` role loads: the engine (all, attention) or the expert weights (experts)."""

from __future__ import annotations

import logging
import time
from dataclasses import fields

import torch

from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.experts.base import ExpertsUnavailable
from tandem.experts.factory import make_expert_executor
from tandem.experts.shared_weights import SharedPrefill, SharedWeightsError, load_key, open_shared, share
from tandem.metrics import ServingMetrics
from tandem.model.config import ModelError, load_config
from tandem.model.loader import build_expert_executor, resolve_dtype
from tandem.model.moe import wrap_executors
from tandem.rpc.experts_client import ExpertsMismatch, GrpcExpertExecutor, RemoteCpuAttention
from tandem.rpc.fingerprint import model_fingerprint
from tandem.rpc.gen import experts_pb2

log = logging.getLogger(__name__)


def timed(fn, histogram):
    """`fn`, observing each successful call's seconds in `histogram`: in-process work timed the way
    the gRPC clients time the same work done remotely."""
    def call(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        histogram.observe(time.perf_counter() - start)
        return out
    return call


class TimedExpertExecutor:
    """An in-process executor whose forward calls are timed (what the gRPC client does remotely)."""

    def __init__(self, inner, histogram):
        self.inner, self.histogram = inner, histogram
        self.forward = timed(inner.forward, histogram)

    def observe(self, layer, topk_ids, seconds: float) -> None:
        """A call the native decode path made to `inner`'s kernel directly (tandem.model.native_decode)."""
        self.histogram.observe(seconds)


def engine_config(opts) -> EngineConfig:
    """The EngineConfig fields `opts` (ServeOptions) sets; the rest keep their defaults."""
    names = {f.name for f in fields(EngineConfig)}
    values = {
        "block_size": opts.block_size, "gpu_memory_fraction": opts.gpu_memory_fraction,
        "cpu_kv_gib": opts.cpu_kv_gib, "kv_shm_path": opts.kv_shm, "max_num_seqs": opts.max_num_seqs,
        "kv_cache_dtype": opts.kv_cache_dtype,
        "max_num_batched_tokens": opts.max_num_batched_tokens,
        "max_model_len": opts.max_model_len, "max_waiting": opts.max_waiting,
        "num_device_blocks": opts.num_device_blocks, "cpu_decode": opts.cpu_decode,
        "enforce_eager": opts.enforce_eager, "num_scheduler_steps": opts.num_scheduler_steps,
        "page_lock_experts": opts.page_lock_experts, "scheduling_policy": opts.scheduling_policy,
        "enable_prefix_caching": opts.enable_prefix_caching,
    }
    return EngineConfig(**{k: v for k, v in values.items() if k in names and v is not None})


def load_embedded(opts, metrics: ServingMetrics) -> LLMEngine:
    """`--role all`: the whole model in this process, routed experts on the in-process executor."""
    engine = LLMEngine.from_pretrained(
        opts.model, device=opts.device, dtype=opts.dtype, config=engine_config(opts),
        expert_threads=opts.threads, expert_quant=opts.expert_quant, dense_quant=opts.dense_quant,
        experts_gguf=opts.experts_gguf)
    _time_expert_calls(engine.model, metrics)
    engine.runner.cpu_attention = timed(engine.runner.cpu_attention, metrics.cpu_attention_latency)
    return engine


def _time_expert_calls(model: torch.nn.Module, metrics: ServingMetrics) -> None:
    # The loader builds the in-process executor and hands it to every MoE block; wrapping it
    # there times each call without loading the expert weights a second time.
    wrap_executors(model, lambda executor: TimedExpertExecutor(executor, metrics.expert_call_latency))


def connect_experts(opts, metrics: ServingMetrics) -> tuple[GrpcExpertExecutor, bool]:
    """`--role attention`: the client of the experts process, and whether it answered now.

    The client serves only from experts of this checkpoint (its fingerprint). A process that
    answers now must serve it: another model is a ModelError, before the weights load. One that
    does not answer is retried later; if another model's process answers then, the server stays
    NOT_SERVING (the client's ExpertsMismatch) until one serving this model does."""
    client = GrpcExpertExecutor(opts.experts, timeout_s=opts.expert_timeout_s, metrics=metrics, spin_us=opts.spin_us,
                                model_fingerprint=model_fingerprint(opts.model))
    try:
        client.info(timeout_s=min(2.0, opts.expert_timeout_s))
    except ExpertsMismatch as exc:
        check_same_model(load_config(opts.model), exc.info, opts.experts)  # how, when the shapes differ
        raise ModelError(str(exc)) from None
    except ExpertsUnavailable as exc:
        log.warning("experts process not reachable yet (%s); will retry", exc)
        return client, False
    return client, True


def check_same_model(cfg, info: experts_pb2.ExpertsInfo, address: str) -> None:
    """ModelError when the experts process's shapes are not this model's (a cheaper, more telling
    check than the fingerprint's when the architectures differ)."""
    if cfg.hidden_size != info.hidden_size or tuple(info.moe_layers) != tuple(cfg.moe_layers) \
            or cfg.num_experts != info.num_experts:
        raise ModelError(
            f"the experts process at {address} serves {info.model!r} (hidden {info.hidden_size}, "
            f"{info.num_experts} experts, MoE layers {list(info.moe_layers)}), which does not match "
            f"this model (hidden {cfg.hidden_size}, {cfg.num_experts} experts, MoE layers {list(cfg.moe_layers)})")


def load_attention(opts, client: GrpcExpertExecutor) -> LLMEngine:
    """`--role attention`: everything but the routed-expert weights, which the experts process holds.

    With a shared CPU KV tier (--kv-shm), the experts process also computes the attention of the
    sequences offloaded there, on its cores and next to that memory. On CUDA, the engine runs large
    prefill chunks' experts on the GPU from the weights the experts process shares (its
    --experts-shm), when it does (tandem.experts.shared_weights)."""
    engine = LLMEngine.from_pretrained(
        opts.model, device=opts.device, dtype=opts.dtype, config=engine_config(opts), expert_executor=client,
        dense_quant=opts.dense_quant)
    prepare_shared_prefill(engine)  # when the experts process answered already; else when it does
    if opts.kv_shm:
        engine.runner.cpu_attention = RemoteCpuAttention(client)
    return engine


def prepare_shared_prefill(engine: LLMEngine) -> None:
    """Map (and page-lock) the weights the experts process shares, for the engine's GPU prefill,
    now rather than in a request (seconds for a large model); nothing when it shares none, or when
    they are mapped already."""
    for wrapper in engine.gpu_prefill:
        if isinstance(wrapper, SharedPrefill):
            wrapper.prepare(engine.device)


def load_experts(opts) -> tuple[object, experts_pb2.ExpertsInfo]:
    """`--role experts`: only the routed-expert weights, and the ExpertsInfo describing them."""
    cfg = load_config(opts.model)
    if not cfg.is_moe:
        raise ModelError(f"{cfg.architecture} has no routed experts: serve it with --role all")
    dtype = str(resolve_dtype(cfg, opts.dtype)).removeprefix("torch.")
    shared = None
    if opts.experts_shm:
        executor, shared = load_shared_experts(opts, dtype)
    else:
        executor = build_expert_executor(opts.model, dtype=opts.dtype, threads=opts.threads,
                                         quant=opts.expert_quant, experts_gguf=opts.experts_gguf)
    info = experts_pb2.ExpertsInfo(
        model=str(opts.model), moe_layers=list(cfg.moe_layers), num_experts=cfg.num_experts,
        hidden_size=cfg.hidden_size, dtype=dtype, kv_shm_path=opts.kv_shm or "",
        experts_shm_path=str(shared.path) if shared else "", experts_shm_generation=shared.generation if shared else "",
        model_fingerprint=model_fingerprint(opts.model))
    return executor, info


def load_shared_experts(opts, dtype: str):
    """The experts' executor over weights in the shared-memory file `opts.experts_shm`, and the
    mapping: those an earlier process published from the same inputs, or loaded and moved there."""
    key = load_key(opts.model, dtype, opts.expert_quant, opts.experts_gguf)
    try:
        shared = open_shared(opts.experts_shm, key)
    except SharedWeightsError as exc:
        log.info("loading the routed experts (%s)", exc)
        executor = build_expert_executor(opts.model, dtype=opts.dtype, threads=opts.threads,
                                         quant=opts.expert_quant, experts_gguf=opts.experts_gguf)
        if not hasattr(executor, "replace_weights"):
            raise ModelError(f"--experts-shm needs the CPU expert executor, not {type(executor).__name__}") from None
        return executor, share(executor, opts.experts_shm, key)
    log.info("routed experts mapped from %s, as an earlier process published them (generation %s)",
             shared.path, shared.generation)
    return make_expert_executor(shared.layers, threads=opts.threads, quant=shared.quant), shared
