"""Dense weights in int8: every `nn.Linear` that is not a routed expert, swapped after load.

llama.cpp's Q8_0 quantizes every matrix of the model; quantizing only the routed experts left
Tandem reading the attention projections and the LM head in float32 on every decode step (on
the benchmark Mixtral, 106 MB a token beside 0.1 GB of int8 experts). `quantize_dense_(model,
"int8")` replaces those layers with `Int8Linear`: weights int8 per output channel (the experts'
format, `tandem.experts.quant.quantize_int8`), computed by the native expert kernel for
decode-shaped batches (activations quantized per 32 values, as Q8_0) and by MKL's GEMM on the
dequantized weight for prefill-shaped ones.

Kept in full precision, by choice:
- the MoE routers (`mlp.gate`, `shared_expert_gate`): a few KB per layer, and an int8 error there
  moves routing weights and can flip which experts a token goes to, which costs more quality
  than any other matrix of the same size;
- weights the model reads as raw tensors rather than through the layer (DeepSeek's `kv_b_proj`,
  which MLA splits per head), and a tied LM head (it is also the embedding table).

The LM head is quantized. The model computes logits with `F.linear(hidden, lm_head.weight)`, so
`Int8Linear.weight` is an `Int8RowWeight`: an int8 tensor that runs the same kernel when handed
to `F.linear` and acts as its dequantized float32 weight for any other torch function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem import contract
from tandem.experts import native
from tandem.experts.quant import Int8Weight, quantize_int8
from tandem.experts.torch_kernels import Int8Linear as TorchInt8Linear

DENSE_QUANTS = contract.DENSE_QUANTS
# Never quantized: routers (routing flips), and weights read raw by their module (see above).
KEEP_FULL_PRECISION = ("gate", "shared_expert_gate", "kv_b_proj")
_TENSOR_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.device.__get__, torch.Tensor.size, torch.Tensor.dim,
    torch.Tensor.numel, torch.Tensor.ndim.__get__, torch.Tensor.is_contiguous,
    torch.Tensor.requires_grad.__get__, torch.Tensor.is_floating_point,
}


def check_dense_quant(mode: str, device: torch.device | str = "cpu") -> None:
    """Refuse an unknown mode, or int8 for a model on another device than the CPU (its kernel's)."""
    if mode not in DENSE_QUANTS:
        raise ValueError(f"unknown dense quantization {mode!r}; choose one of {DENSE_QUANTS}")
    if mode != "none" and torch.device(device).type != "cpu":
        raise ValueError(f"dense quantization {mode} runs on the CPU's int8 kernel, not on {torch.device(device)}: "
                         "use --device cpu, or leave the dense layers unquantized")


class Int8RowWeight(torch.Tensor):
    """An int8 [N, K] weight with one float32 scale per row (w = q * scale), standing in for the
    float weight it replaces: `F.linear(x, w)` runs the int8 kernel; other torch functions see
    the dequantized float32 weight (correct, and slow: only metadata is answered without it)."""

    @staticmethod
    def __new__(cls, q: torch.Tensor, scale: torch.Tensor, kernel: "Int8Kernel"):
        t = torch.Tensor._make_subclass(cls, q)
        t.scale, t.kernel = scale, kernel
        return t

    def dequantize(self) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return self.float() * self.scale[:, None]  # [N, K]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(w, Int8RowWeight) and not isinstance(x, Int8RowWeight):
                return w.kernel(x, bias)
        if func is torch.Tensor.dtype.__get__:
            return torch.float32  # what it stands for: callers cast activations to this
        with torch._C.DisableTorchFunctionSubclass():
            if func in _TENSOR_METADATA:
                return func(*args, **kwargs)
            args = [a.dequantize() if isinstance(a, Int8RowWeight) else a for a in args]
            return func(*args, **kwargs)


DEQUANT_BYTES = 4 << 20  # a prefill GEMM's block of dequantized weight rows: a few MiB, cache-sized
# Batches up to this many tokens run the native kernel, larger ones the GEMM: on 2 AVX2 cores of a Zen 1
# EPYC the kernel is 1.1-2.1x the GEMM at 64 and 128 tokens (N x K from 3072 x 1024 to 8000 x 1024 and
# 4096 x 4096), even at 256 (0.93-1.16x), 0.7-0.85x at 512 where K is 1024
# (`benchmarks/dense_prefill.py --against-native`). Cores with AVX-512 VNNI favour the kernel more.
PREFILL_TOKENS = 256


class Int8Kernel:
    """y = x W^T (+ bias) for one int8 weight: the native kernel for up to `prefill_tokens`
    tokens, else MKL's GEMM on the dequantized weight (prefill is compute-bound, not memory-bound)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, prefill_tokens: int = PREFILL_TOKENS):
        self.q, self.scale, self.prefill_tokens = q, scale, prefill_tokens  # [N, K] int8, [N] f32
        self.native = native.load_kernel()
        # Without the native kernel: torch's int8 GEMV (bf16 activations) for decode.
        self.torch_decode = None if self.native else TorchInt8Linear(Int8Weight(q[None], scale[None]))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2:  # [..., K]: as [T, K]
            return self(x.reshape(-1, x.shape[-1]), bias).reshape(*x.shape[:-1], -1)
        t = x.shape[0]
        # decode runs this ~25 times a step: no conversion or copy that is not needed
        x32 = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()  # [T, K]
        if t > self.prefill_tokens:
            y = self._dequantized_linear(x32)
        elif self.native is not None:
            y = torch.empty((t, self.q.shape[0]), dtype=torch.float32)  # [T, N]
            self.native.linear_forward(x32, native.KIND_INT8, self.q, self.scale, y)
        else:
            y = self.torch_decode(0, x32)  # [T, N]
        if bias is not None:
            y += bias
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _dequantized_linear(self, x32: torch.Tensor) -> torch.Tensor:
        """x32 [T, K] -> [T, N] through MKL's GEMM, the weight dequantized DEQUANT_BYTES of rows at a
        time: never the whole weight in float32 (2.4 GB for a 150k-token vocabulary's LM head), and
        each block still in cache for its GEMM (1.1-5.3x faster than dequantizing it whole,
        `benchmarks/RESULTS.md` round twenty-two)."""
        n, k = self.q.shape
        rows = max(8, DEQUANT_BYTES // (4 * k))
        y = torch.empty((x32.shape[0], n), dtype=torch.float32)
        for start in range(0, n, rows):
            w = self.q[start:start + rows].float().mul_(self.scale[start:start + rows, None])
            y[:, start:start + rows] = F.linear(x32, w)
        return y


class Int8Linear(nn.Module):
    """A bias-optional linear layer with int8 weights per output channel (see `Int8Kernel`)."""

    def __init__(self, linear: nn.Linear, prefill_tokens: int = PREFILL_TOKENS):
        super().__init__()
        w = linear.weight.detach()
        if w.device.type != "cpu":
            raise ValueError(f"int8 dense weights run on the CPU kernel; this layer is on {w.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = quantize_int8(w.float()[None])  # [1, N, K]
        q, scale = packed.q[0], packed.scale[0]  # [N, K] int8, [N] f32
        self.kernel = Int8Kernel(q, scale, prefill_tokens)
        self.weight = Int8RowWeight(q, scale, self.kernel)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    @property
    def nbytes(self) -> int:
        """Bytes one decode step reads: the int8 codes and their scales."""
        return self.kernel.q.nbytes + self.kernel.scale.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.bias)  # [..., N]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per output channel"


def quantize_dense_(model: nn.Module, mode: str, *, prefill_tokens: int = PREFILL_TOKENS) -> list[str]:
    """Swap, in place, every dense `nn.Linear` of `model` for an `Int8Linear` (mode "int8"); mode
    "none" changes nothing. Routed experts are not modules here (the executor holds them);
    routers and raw-read weights are kept (`KEEP_FULL_PRECISION`). Idempotent. Returns the
    names of the layers swapped."""
    check_dense_quant(mode)
    if mode == "none":
        return []
    tied = getattr(getattr(model, "cfg", None), "tie_word_embeddings", False)
    swapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear) or child_name in KEEP_FULL_PRECISION:
                continue
            if tied and child_name == "lm_head" and module is model:
                continue
            setattr(module, child_name, Int8Linear(child, prefill_tokens))
            swapped.append(f"{name}.{child_name}" if name else child_name)
    return swapped


def dense_nbytes(model: nn.Module) -> int:
    """Bytes of the quantized dense weights in `model` (codes and scales)."""
    return sum(m.nbytes for m in model.modules() if isinstance(m, Int8Linear))
