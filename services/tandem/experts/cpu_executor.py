"""The fast CPU expert executor: quantized weights, a fused native kernel, torch as fallback.

Decode-shaped batches (few tokens) go to the native kernel, which streams each touched
expert's rows once for all tokens routed to it; for int8 and int4 rows it quantizes the
activations to int8 per 32 values (llama.cpp's Q8_0; on AVX2 per 256, as Q8_K) and uses
integer dot products.
Prefill-shaped batches (many tokens per expert) are compute-bound, so they go to MKL's GEMM
one expert at a time instead, on dequantized weights.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import torch

from tandem.experts import native
from tandem.experts.base import ExpertWeights
from tandem.experts.cores import available_cores
from tandem.experts.quant import Int4Weight, Int8Weight, check_quant, quantize, to_integer_scales
from tandem.experts.routing import check_batch, group_by_expert
from tandem.experts.torch_kernels import Stored, decode_linear, moe_with_linears, prefill_linear

KERNELS = ("auto", "native", "torch")
# Tokens per call above which the GEMM path takes over, per storage, where the caller does not
# say. Quantized experts are dequantized per call for the GEMM, which costs more than the native
# kernel saves until batches of ~400-600 tokens (int4 / int8; 8 experts of 1024 x 2816, 2 cores:
# native 59 ms against 110-190 ms at 128 tokens, crossing at 512-1024); float weights cross at
# 64-128, and bf16 meets MKL's bf16 GEMM, so those stay at 32.
PREFILL_TOKENS = {"none": 32, "int8": 384, "int4": 384}
# Float experts where torch's GEMM is known to be the slower: bf16 where the kernel multiplies them
# with vdpbf16ps (isa avx512bf16) and torch has no AMX tiles (kernel 105-132 GMAC/s at 64-1024
# tokens a call against the GEMM path's 11-61), and f32 on AMD CPUs with AVX-512, where torch's
# MKL does not run its AVX-512 code (kernel 60-76 GMAC/s at 64-1024 tokens, GEMM 29-69, nearly
# even at 1024). Measured on AMD Zen 4, 2 cores (benchmarks/RESULTS.md round thirty: prompts of
# 256 and 512 tokens prefill in 0.70 / 0.83 of the time at f32, 0.42 / 0.52 at bf16); Intel CPUs
# keep 32 for f32.
FLOAT_KERNEL_PREFILL_TOKENS = 512
_KIND = {torch.float32: native.KIND_F32, torch.bfloat16: native.KIND_BF16, Int8Weight: native.KIND_INT8,
         Int4Weight: native.KIND_INT4}
_EMPTY = torch.empty(0)


@dataclass
class PreparedLayer:
    """One MoE layer's routed experts in the executor's storage, with their torch products."""

    gate_up: Stored  # [E, 2I, H]
    down: Stored  # [E, H, I]
    num_experts: int
    hidden_size: int
    intermediate_size: int
    group_size: int
    prefill: tuple = field(default=())  # (gate_up, down) products for GEMM-shaped batches
    decode: tuple = field(default=())  # torch products for GEMV-shaped batches (no native kernel)

    @property
    def kind(self) -> int:
        w = self.gate_up
        return _KIND[w.dtype] if isinstance(w, torch.Tensor) else _KIND[type(w)]

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert's weights (scales included): what decode reads per touched expert."""
        return (_nbytes(self.gate_up) + _nbytes(self.down)) // self.num_experts

    def native_args(self) -> tuple:
        return (*_parts(self.gate_up), *_parts(self.down))


class CpuExpertExecutor:
    """Routed experts on CPU cores, in f32/bf16 ("none"), int8 or int4 weights.

    `threads` defaults to the cores this process was given; it sets torch's intra-op threads,
    which both the native kernel and the torch kernels use. `kernel`: "native" (fail when it
    cannot be built), "torch" (torch's kernels only) or "auto" (native when it builds).
    Batches of more than `prefill_tokens` tokens (default: `PREFILL_TOKENS` for the storage) use
    the GEMM path.
    """

    def __init__(
        self,
        layers: dict[int, ExpertWeights],
        *,
        threads: int | None = None,
        quant: str = "none",
        kernel: str = "auto",
        group_size: int = 32,
        prefill_tokens: int | None = None,
    ):
        check_quant(quant)
        if kernel not in KERNELS:
            raise ValueError(f"unknown expert kernel {kernel!r}; choose one of {KERNELS}")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        if prefill_tokens is not None and prefill_tokens < 0:
            raise ValueError(f"prefill_tokens must be >= 0, got {prefill_tokens}")
        self.threads = threads or available_cores()
        torch.set_num_threads(self.threads)
        self.quant, self.group_size = quant, group_size
        self._prefill_tokens = prefill_tokens  # None: by storage and kernel (see prefill_tokens)
        self.native = None if kernel == "torch" else native.load_kernel()
        if kernel == "native" and self.native is None:
            raise RuntimeError(f"native expert kernel unavailable: {native.unavailable_reason()}")
        self.layers: dict[int, PreparedLayer] = {}
        for i, w in layers.items():
            self.add_layer(i, w)
        self._local = threading.local()

    @property
    def prefill_tokens(self) -> int:
        """Tokens per call above which the GEMM path takes over: as given, else by the storage
        (PREFILL_TOKENS, or FLOAT_KERNEL_PREFILL_TOKENS where torch's float GEMM is the slower)."""
        return self._threshold(next(iter(self.layers.values()), None))

    def _threshold(self, p: PreparedLayer | None) -> int:
        if self._prefill_tokens is not None:
            return self._prefill_tokens
        if self.quant == "none" and p is not None and self.native is not None:
            isa = self.native.isa()
            if p.kind == native.KIND_BF16 and isa == "avx512bf16" and not _has_amx():
                return FLOAT_KERNEL_PREFILL_TOKENS
            if p.kind == native.KIND_F32 and isa.startswith("avx512") and _mkl_on_amd():
                return FLOAT_KERNEL_PREFILL_TOKENS
        return PREFILL_TOKENS[self.quant]

    @property
    def kernel(self) -> str:
        """"native" or "torch": what decode-shaped batches actually run on."""
        return "torch" if self.native is None else "native"

    def add_layer(self, layer: int, weights: ExpertWeights) -> None:
        """Serve `layer` from `weights`, converted now to this executor's storage: a loader hands
        layers over one at a time and drops each, so at most one is held unquantized."""
        self.layers[layer] = prepare_layer(weights, self.quant, self.group_size, torch_decode=self.native is None,
                                           integer_scales=self._integer_scales())

    def replace_weights(self, layer: int, gate_up: Stored, down: Stored) -> None:
        """Serve `layer` from these stored weights, of the same format and values as its own (a copy
        in shared memory: tandem.experts.shared_weights); its own are freed unless referred to elsewhere."""
        p = self.layers[layer]
        self.layers[layer] = prepare_layer(ExpertWeights(gate_up, down), self.quant, p.group_size,
                                           torch_decode=self.native is None, integer_scales=self._integer_scales())

    def _integer_scales(self) -> bool:
        """int4 scales stored as integers (quant.to_integer_scales) where the native kernel runs its
        AVX2 code: it then sums int4 rows in int32 over 256 weights (routed experts 1.08-1.14x as fast
        on Zen 1; benchmarks/RESULTS.md round nineteen). AVX-512 has vpdpbusd and keeps fp16 scales."""
        return self.native is not None and self.native.isa() == "avx2"

    def forward(self, layer, hidden, topk_ids, topk_weights):
        """hidden [T, H], topk_ids [T, k] int64, topk_weights [T, k] float32 -> [T, H] in hidden's dtype."""
        p = self.layers.get(layer)
        if p is None:
            raise ValueError(f"no routed experts for layer {layer}; this executor holds layers {sorted(self.layers)}")
        check_batch(hidden, topk_ids, topk_weights, p.hidden_size, p.num_experts)
        x = hidden.detach().float().contiguous()  # [T, H]
        out = torch.empty(x.shape, dtype=torch.float32)  # [T, H]
        threshold = self._threshold(p)
        if self.native is not None and x.shape[0] <= threshold:
            self._native_forward(p, x, topk_ids, topk_weights, out)
        else:
            groups = group_by_expert(topk_ids, topk_weights, p.num_experts)
            products = p.decode if x.shape[0] <= threshold else p.prefill
            moe_with_linears(x, groups, *products, out.zero_())
        return out.to(hidden.dtype)

    def _native_forward(self, p: PreparedLayer, x, topk_ids, topk_weights, out) -> None:
        t, k = topk_ids.shape
        need = t * k * p.intermediate_size  # the activations between the two projections
        self.native.moe_forward(
            x, topk_ids.long().contiguous(), topk_weights.float().contiguous(), p.kind, p.group_size,
            *p.native_args(), out, self._scratch(need),
        )

    def _scratch(self, numel: int) -> torch.Tensor:
        # One grow-only buffer per calling thread: decode allocates nothing large per step.
        buf = getattr(self._local, "scratch", None)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1 << 16), dtype=torch.float32)
            self._local.scratch = buf
        return buf


@functools.cache
def _has_amx() -> bool:
    """Whether torch's CPU GEMMs can run on AMX tiles (Sapphire Rapids and later)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


@functools.cache
def _mkl_on_amd() -> bool:
    """Whether torch's float GEMM is MKL's on an AMD CPU (MKL takes its AVX-512 code on Intel's only)."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "AuthenticAMD" in line for line in f)
    except OSError:
        return False


def prepare_layer(w: ExpertWeights, quant: str, group_size: int = 32, torch_decode: bool = False,
                  integer_scales: bool = False) -> PreparedLayer:
    """Check one layer's expert weights and convert them to the executor's storage (int4 with
    integer scales when `integer_scales`).

    Weights already quantized (`Int8Weight`s or `Int4Weight`s, e.g. from a GGUF file, see
    tandem.experts.gguf_experts) are taken as they are, both projections in one format, by an
    executor that quantizes (quant "int8" or "int4"; its quant sets the prefill threshold)."""
    gu, dn = w.gate_up, w.down
    if len(gu.shape) != 3 or len(dn.shape) != 3:
        raise ValueError(f"gate_up must be [E, 2I, H] and down [E, H, I], got {tuple(gu.shape)} and {tuple(dn.shape)}")
    e, two_i, h = gu.shape
    if two_i % 2 or tuple(dn.shape) != (e, h, two_i // 2):
        raise ValueError(f"down {tuple(dn.shape)} does not match gate_up {tuple(gu.shape)}: want [E, H, I]")
    if isinstance(gu, (Int8Weight, Int4Weight)) or isinstance(dn, (Int8Weight, Int4Weight)):
        if type(gu) is not type(dn) or quant == "none":
            raise ValueError(f"quantized expert weights need both projections in one format and quant int8 or "
                             f"int4 (got {type(gu).__name__} and {type(dn).__name__}, quant={quant!r})")
        gate_up, down = gu, dn
        if isinstance(gu, Int4Weight):
            if gu.group_size != dn.group_size:
                raise ValueError(f"int4 expert weights in groups of {gu.group_size} and {dn.group_size}")
            group_size = gu.group_size
    else:
        gate_up, down = quantize(gu, quant, group_size), quantize(dn, quant, group_size)
    if integer_scales and isinstance(gate_up, Int4Weight):
        gate_up, down = to_integer_scales(gate_up), to_integer_scales(down)
    layer = PreparedLayer(gate_up, down, e, h, two_i // 2, group_size)
    layer.prefill = (prefill_linear(gate_up), prefill_linear(down))
    if torch_decode:
        layer.decode = (decode_linear(gate_up), decode_linear(down))
    return layer


def _parts(w: Stored) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if isinstance(w, Int8Weight):
        return w.q, w.scale, _EMPTY
    if isinstance(w, Int4Weight):
        return w.packed, w.scale, w.min
    return w, _EMPTY, _EMPTY


def _nbytes(w: Stored) -> int:
    return w.nbytes if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()
