"""The CPU decode step in native code: one call per decoder layer (experts/csrc/decode_layer.cpp).

When the model runs on the CPU, a decode step streams the weights from RAM, and every big read
(an expert, a projection) evicts the caches. The torch path runs ~150 small ops per layer between
those reads, each of them cold; `DecodeLayer` does that glue (norms, RoPE, the KV write, routing,
residual adds) in a few loops and calls the same native kernels for the reads.

It serves a step when all of these hold, and the model's torch path serves it otherwise:
- the model is float32 or bfloat16 on the CPU, every layer grouped-query attention with routed
  experts (Mixtral, Qwen3-MoE), routed experts and a sigmoid-gated shared expert (Qwen2-MoE), or a
  dense SwiGLU MLP (Llama, Qwen2-MoE's dense layers); dense weights in the model's dtype or int8;
- a bfloat16 model's weights and KV cache stay bfloat16 and its residual stream is float32 in the
  native layers (llama.cpp's choice): its hidden states and logits match the float32 computation
  over the bf16 weights, closer to it than the torch path's bf16 arithmetic;
- an fp8 KV cache (--kv-cache-dtype fp8, tandem.kv.fp8) is written and read here with the cache's
  scales, which each native layer takes from the cache it is called with;
- the step is decode only, every sequence on the device tier, at most `max_tokens` tokens.

Where the experts run decides how much one call does:
- in this process on the native kernel (`CpuExpertExecutor`), possibly behind wrappers that only
  watch the calls (`inner` + `observe`, e.g. the serving metrics' timer): the whole layer, and the
  wrappers see each call through `observe(layer, topk_ids, seconds)`; when every layer's experts
  are here, one native call (`decode_layers`) runs all the layers and the final norm;
- in the split deployment's experts process, reached over the data plane (an executor with
  `data_plane_calls`, `tandem.rpc.experts_client.GrpcExpertExecutor`): when every layer's experts
  are there, one native call runs all the layers and makes each layer's Forward call itself
  (`decode_layers` with the connection); without a data plane connection (gRPC only), as below;
- anywhere else (the torch kernels, a patched `forward`): the native call stops at the router and
  the layer's executor is called with its output.

When the whole step is one call and every sequence samples greedily, the engine's decode steps
(a multi-step run, or a single step) are one call too (`greedy`, `decode_greedy`): the embedding,
the layers, the LM head and the argmax of every step, each token fed to the next step.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tandem.experts import native
from tandem.experts.cpu_executor import CpuExpertExecutor
from tandem.kv.attention import DecodeSteps
from tandem.kv.cache import DEVICE, KVCache
from tandem.kv.tiered import LayerKV, StepAttention
from tandem.model.attention import Attention
from tandem.model.layers import DenseMLP
from tandem.model.moe import SparseMoe, run_routed_experts
from tandem.model.quant_linear import Int8Linear

_log = logging.getLogger(__name__)


class Unsupported(ValueError):
    """The model (as it is now) cannot take the native decode path; the message says why."""


def _watched(executor) -> tuple[object, list]:
    """The executor behind the wrappers that only watch its calls (`inner` + `observe`), and their
    `observe` hooks (outermost first)."""
    observers = []
    while not isinstance(executor, CpuExpertExecutor):
        inner, observe = getattr(executor, "inner", None), getattr(executor, "observe", None)
        if inner is None or observe is None:
            break
        observers.append(observe)
        executor = inner
    return executor, observers


def _remote(executor):
    """The data plane client behind the watching wrappers (None if the experts are not called that way)."""
    executor, _ = _watched(executor)
    if hasattr(executor, "data_plane_calls") and "forward" not in getattr(executor, "__dict__", {}):
        return executor
    return None


def unwrap_executor(executor) -> tuple[CpuExpertExecutor, list]:
    """The native in-process executor behind `executor`, and the `observe` hooks of the wrappers
    around it (outermost first)."""
    executor, observers = _watched(executor)
    if not isinstance(executor, CpuExpertExecutor):
        raise Unsupported(f"the experts run on {type(executor).__name__}, not in this process")
    if executor.native is None:
        raise Unsupported("the native expert kernel is not loaded")
    if "forward" in getattr(executor, "__dict__", {}):  # patched or wrapped in place: honour it, call it from Python
        raise Unsupported("the executor's forward was replaced")
    return executor, observers


DENSE_KINDS = {torch.float32: native.KIND_F32, torch.bfloat16: native.KIND_BF16}  # a Dense's kind per weight dtype


def _dense(module: nn.Module, name: str, bias: bool = True):
    d = native.load_kernel().Dense()
    if isinstance(module, Int8Linear):
        d.kind, d.weight, d.scale = native.KIND_INT8, module.kernel.q, module.kernel.scale
    elif isinstance(module, nn.Linear) and module.weight.dtype in DENSE_KINDS:
        d.kind, d.weight = DENSE_KINDS[module.weight.dtype], module.weight.detach().contiguous()
    else:
        weight = getattr(module, "weight", None)
        raise Unsupported(f"{name} is {type(module).__name__} ({getattr(weight, 'dtype', 'no weight')}), "
                          "not a float32, bfloat16 or int8 linear layer")
    if bias and module.bias is not None:
        d.bias = module.bias.detach().float().contiguous()
    return d


DEFAULT_MAX_TOKENS = 32  # decode batches above this go to the torch path's GEMMs (as the executor's default)


class _Layer:
    """One decoder layer on the native path. An MoE layer's experts run in this process (`local`: one
    call does the whole layer) or elsewhere (the native call stops at the router and the executor is
    called); a dense layer (`moe_layer` None) is always one call."""

    def __init__(self, index: int, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is not Attention:
            raise Unsupported(f"layer {index}: {type(attn).__name__} is not grouped-query attention")
        if type(mlp) not in (SparseMoe, DenseMLP):
            raise Unsupported(f"layer {index}: {type(mlp).__name__} is neither a routed MoE nor a dense MLP")
        d = self.native = native.load_kernel().DecodeLayer()
        d.hidden, d.heads, d.kv_heads, d.head_dim = attn.q_proj.in_features, attn.num_heads, attn.num_kv_heads, attn.head_dim
        d.eps, d.scale = float(layer.input_layernorm.eps), attn.scale
        if float(layer.post_attention_layernorm.eps) != d.eps or (attn.qk_norm and float(attn.q_norm.eps) != d.eps):
            raise Unsupported(f"layer {index}: its norms have different epsilons")
        d.input_norm = layer.input_layernorm.weight.detach().float().contiguous()
        d.post_norm = layer.post_attention_layernorm.weight.detach().float().contiguous()
        if attn.qk_norm:
            d.q_norm = attn.q_norm.weight.detach().float().contiguous()
            d.k_norm = attn.k_norm.weight.detach().float().contiguous()
        d.q, d.k, d.v, d.o = (_dense(getattr(attn, n), f"layer {index} {n}")
                              for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        self.mlp, self.max_tokens = mlp, DEFAULT_MAX_TOKENS
        swiglu = mlp if type(mlp) is DenseMLP else mlp.shared_expert  # the dense MLP or the shared expert
        if swiglu is not None:
            d.mlp_gate, d.mlp_up, d.mlp_down = (_dense(getattr(swiglu, n), f"layer {index} {n}")
                                                for n in ("gate_proj", "up_proj", "down_proj"))
        if type(mlp) is DenseMLP:
            self.moe_layer, self.remote, self.local, self.observers = None, None, True, []
            d.check()
            return
        self.moe_layer = mlp.layer
        d.router = _dense(mlp.gate, f"layer {index} router")
        if swiglu is not None:
            d.shared_expert_gate = _dense(mlp.shared_expert_gate, f"layer {index} shared_expert_gate")
        d.top_k, d.normalize, d.layer = mlp.top_k, bool(mlp.normalize), mlp.layer
        self.remote = _remote(mlp.executor)  # the experts process's client, when they are there
        try:
            executor, self.observers = unwrap_executor(mlp.executor)
            experts = executor.layers[mlp.layer]
        except (Unsupported, KeyError) as exc:
            self.local = False  # the executor is called with the router's output
            self.observers = _watched(mlp.executor)[1]  # seen only when the step is one call (remote)
            # str(exc): a log record that holds the exception holds its frames, and through them the model
            _log.debug("layer %d: experts through the executor: %s", index, str(exc))
        else:
            self.local, self.max_tokens = True, min(executor.prefill_tokens, DEFAULT_MAX_TOKENS)
            d.expert_kind, d.group = experts.kind, experts.group_size
            d.gate_up, d.gate_up_scale, d.gate_up_min, d.down, d.down_scale, d.down_min = experts.native_args()
        d.check()

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV, meta, window: int) -> None:
        args = (x, cos, sin, kv.device["k"], kv.device["v"], meta.slot_mapping, meta.block_tables, meta.seq_lens,
                window)
        if self.local:
            seconds, ids = self.native.forward(*args)
            for observe in self.observers:
                observe(self.moe_layer, ids, seconds)
        else:
            h, ids, weights = self.native.attention(*args)
            routed = run_routed_experts(self.mlp.executor, self.moe_layer, h, ids, weights)
            x += self.mlp.combine(h.to(self.mlp.gate.weight.dtype), routed)  # a shared expert at its weights' dtype


class NativeDecode:
    """The model's decoder layers as native `DecodeLayer`s, built for the model as it is now."""

    def __init__(self, model: nn.Module):
        if native.load_kernel() is None:
            raise Unsupported(f"the native kernel is not available: {native.unavailable_reason()}")
        emb = model.model.embed_tokens.weight
        if emb.device.type != "cpu" or emb.dtype not in DENSE_KINDS:
            raise Unsupported(f"the model is {emb.dtype} on {emb.device}, not float32 or bfloat16 on the CPU")
        self.layers = [_Layer(i, layer) for i, layer in enumerate(model.model.layers)]
        self.final_norm = model.model.norm.weight.detach().float().contiguous()
        self.final_eps = float(model.model.norm.eps)
        kernel = native.load_kernel()
        self.rms_norm, self.decode_layers = kernel.rms_norm, kernel.decode_layers
        self.decode_greedy = kernel.decode_greedy
        # Every layer's experts inside its native call, or every layer's in the one experts process
        # over the data plane: the whole step is one call (decode_layers).
        remotes = {id(layer.remote): layer.remote for layer in self.layers if layer.moe_layer is not None}
        self.remote = next(iter(remotes.values())) if len(remotes) == 1 and not self.local_experts else None
        one_call = self.local_experts or self.remote is not None
        self.natives = [layer.native for layer in self.layers] if one_call else None
        # Int8Linear and the executor hand batches above their threshold to GEMMs; so does this path.
        limits = [layer.max_tokens for layer in self.layers]
        limits += [m.kernel.prefill_tokens for m in model.modules() if isinstance(m, Int8Linear)]
        self.max_tokens = min(limits)
        self.embed = emb.detach().contiguous()
        self.head = _head(model)  # None: the greedy runs (`greedy`) are off, each step samples in Python
        self._caches: tuple[KVCache, list[torch.Tensor], list[torch.Tensor]] | None = None  # _device_caches
        self.steps = 0  # steps served (tests check the path was taken)
        self.greedy_steps = 0  # of which in greedy runs

    @property
    def local_experts(self) -> bool:
        """Whether every layer's experts run inside the native call (else some go through their executor)."""
        return all(layer.local for layer in self.layers)

    def serves(self, step: StepAttention, num_tokens: int) -> bool:
        meta = step.device
        return (step.cpu is None and meta is not None and 0 < num_tokens <= self.max_tokens
                and meta.query_index.shape[1] == 1)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], cache: KVCache,
                step: StepAttention) -> torch.Tensor:
        """x [T, H] float32 embeddings -> [T, H] float32 final hidden states, after the final norm (x is
        updated in place). cos_sin: float32 [T, D] each."""
        meta = step.device
        cos, sin = (c.contiguous() for c in cos_sin)
        window = meta.sliding_window or 0
        self.steps += 1
        caches = self._device_caches(cache)
        if self.natives is not None:
            args = (self.natives, x, cos, sin, *caches, meta.slot_mapping, meta.block_tables,
                    meta.seq_lens, window, self.final_norm, self.final_eps)
            done = self._one_call(self.decode_layers, *args)
            if done is not None:
                out, seconds, ids = done
                self._observed(seconds, ids)
                return out
        for i, layer in enumerate(self.layers):  # no data plane connection: Forward over gRPC
            layer(x, cos, sin, LayerKV.of(cache, i), meta, window)
        return self.rms_norm(x, self.final_norm, self.final_eps)

    def runs_greedy(self, num_seqs: int) -> bool:
        """Whether `greedy` can run decode steps of num_seqs sequences: the whole step one native call
        (every layer's experts in this process, or all in the experts process), a head the native
        kernel takes, and a batch the native layers take."""
        return self.natives is not None and self.head is not None and 0 < num_seqs <= self.max_tokens

    def greedy(self, ids: torch.Tensor, rope: torch.Tensor, steps: DecodeSteps, cache: KVCache,
               tokens: torch.Tensor, on_step=None) -> bool:
        """Greedy decode steps in a row in one native call (`decode_greedy`): ids [B] are the
        sequences' next inputs, `steps` where each step computes them (positions, slots, block
        tables), rope the RoPE table [2, P, D]; the argmax tokens go to tokens [B, S], a column per
        step as it ends (when a step raises, those before it are there). on_step(s), when given, is
        called as column s is written, and a false return ends the run there. The observers see
        every step's calls. False (nothing run) when the experts process is reached over gRPC only."""
        k_caches, v_caches = self._device_caches(cache)
        args = (self.natives, self.embed, rope, ids, k_caches, v_caches, steps.positions, steps.slots,
                steps.block_tables, steps.sliding_window or 0, self.final_norm, self.final_eps, self.head, tokens)
        done = self._one_call(self.decode_greedy, *args, on_step=on_step)
        if done is None:
            return False
        seconds, ids_per_step = done
        self.steps += len(seconds)
        self.greedy_steps += len(seconds)
        for step_seconds, step_ids in zip(seconds, ids_per_step):
            self._observed(step_seconds, step_ids)
        return True

    def _device_caches(self, cache: KVCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's device-tier K and V caches, listed once per cache (a decode step's Python is
        paid once a token); the native layers take the cache's scales then."""
        if self._caches is None or self._caches[0] is not cache:
            layers = [cache.layer(i, DEVICE) for i in range(len(self.layers))]
            for layer, scales in zip(self.layers, cache.scales):
                layer.native.k_scale, layer.native.v_scale = scales["k"], scales["v"]
            self._caches = (cache, [layer["k"] for layer in layers], [layer["v"] for layer in layers])
        return self._caches[1], self._caches[2]

    def _one_call(self, fn, *args, **kwargs):
        """fn(*args), a native call over every layer, with the experts in this process; with them in
        the experts process, fn(*args, *plane) over the data plane connection, or None (nothing run)
        when there is none (Forward goes over gRPC)."""
        if self.remote is None:
            return fn(*args, **kwargs)
        with self.remote.data_plane_calls() as plane:
            return None if plane is None else fn(*args, *plane, **kwargs)

    def _observed(self, seconds: list[float], ids: list[torch.Tensor]) -> None:
        """One step's expert calls, a layer each, made inside a native call: the data plane client
        records them (split deployment), and the watching wrappers see them."""
        if self.remote is not None:
            for layer, s in zip(self.layers, seconds):
                if layer.moe_layer is not None:  # a dense layer made no call
                    self.remote.record_call(s)
        for layer, layer_seconds, layer_ids in zip(self.layers, seconds, ids):
            for observe in layer.observers:
                observe(layer.moe_layer, layer_ids, layer_seconds)


def _head(model: nn.Module):
    """The LM head as a native `Dense`, without a bias as `CausalLM.compute_logits` computes the
    logits; None when the kernel does not take it (greedy runs are then off)."""
    if model.cfg.tie_word_embeddings:  # the embedding's [V, H] weight
        weight = model.model.embed_tokens.weight
        d = native.load_kernel().Dense()
        d.kind, d.weight = DENSE_KINDS[weight.dtype], weight.detach().contiguous()  # NativeDecode checked the dtype
        return d
    try:
        return _dense(model.lm_head, "lm_head", bias=False)
    except Unsupported as exc:
        _log.debug("greedy runs off: %s", str(exc))
        return None


def signature(model: nn.Module) -> tuple:
    """What `NativeDecode` was built from: the modules and executors it took weights from, held (not
    their ids, which a new object could reuse) and compared by identity."""
    sig = []
    for layer in model.model.layers:
        # Checked every step: read the module dicts directly (nn.Module.__getattr__ costs ~1 us a lookup).
        attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]
        projections = attn._modules
        executor = mlp.__dict__.get("executor")
        swiglu = mlp._modules.get("shared_expert") or mlp  # its projections: a dense MLP's, or the shared expert's
        sig.append((attn, mlp, projections.get("q_proj"), projections.get("k_proj"), projections.get("v_proj"),
                    projections.get("o_proj"), executor, _own_forward(executor), tuple(swiglu._modules.values())))
    sig.append((model.model._modules["embed_tokens"], model._modules.get("lm_head")))
    return tuple(sig)


def _own_forward(executor):
    while executor is not None:  # a forward set on an instance (a patch), down the wrapper chain
        if "forward" in getattr(executor, "__dict__", {}) and not hasattr(executor, "observe"):
            return vars(executor)["forward"]
        executor = getattr(executor, "inner", None)
    return None


_last_message: str | None = None


def build(model: nn.Module) -> NativeDecode | None:
    """The native decode path for `model`, or None when it cannot take it (logged, once per outcome)."""
    global _last_message
    try:
        path = NativeDecode(model)
    except Unsupported as exc:
        path, message = None, f"native decode path off, decode runs the torch layers: {exc}"
    else:
        dense_only = all(layer.moe_layer is None for layer in path.layers)
        where = ("none (dense layers only)" if dense_only else "inside the call" if path.local_experts else
                 "in the experts process, called from the native call" if path.remote is not None else
                 "through the expert executor")
        message = (f"native decode path on: {len(path.layers)} layers, experts {where}, "
                   f"up to {path.max_tokens} tokens a step")
    if message != _last_message:
        _log.info(message)
        _last_message = message
    return path
