"""Per-expert matrix products with torch's own CPU kernels, for each weight storage.

Two uses: the decode path when the native kernel cannot be built (torch's GEMV-shaped ops:
`F.linear`, `_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), and the prefill path,
where many tokens share an expert and dequantizing that expert once to feed MKL's GEMM
beats any GEMV.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.experts.quant import Int4Weight, Int8Weight, Stored, dequantize, unpack_int4
from tandem.experts.routing import ExpertGroups


class DenseLinear:
    """f32 or bf16 weights: `F.linear` in the weights' dtype (bf16 is fast only when stored [N, K])."""

    def __init__(self, w: torch.Tensor):
        self.w = w  # [E, N, K]

    def __call__(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.w.dtype), self.w[expert]).float()  # [n, N]


class Int8Linear:
    """int8 weight-only: torch's `_weight_int8pack_mm` wants bf16 activations and bf16 scales."""

    def __init__(self, w: Int8Weight):
        self.q = w.q  # [E, N, K] int8
        self.scale = w.scale.to(torch.bfloat16)  # [E, N]

    def __call__(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.q[expert], self.scale[expert])
        return y.float()  # [n, N]


class Int4Linear:
    """int4 group-wise: repacked once into torch's own int4 layout for `_weight_int4pack_mm_for_cpu`.

    torch computes w = (q - 8) * scale + zero with bf16 scale and zero, so zero = min + 8 * scale;
    bf16 rounding of zero makes this path slightly less exact than the native kernel.
    """

    def __init__(self, w: Int4Weight):
        codes = unpack_int4(w).to(torch.int32)  # [E, N, K]
        self.group_size = w.group_size
        self.packed = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(c.contiguous(), 1) for c in codes]
        scale = w.group_scales()  # [E, N, G]
        zero = w.min.float() + 8.0 * scale
        sz = torch.stack((scale, zero), dim=-1).transpose(1, 2)  # [E, G, N, 2]
        self.scales_and_zeros = sz.to(torch.bfloat16).contiguous()

    def __call__(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed[expert], self.group_size, self.scales_and_zeros[expert]
        )
        return y.float()  # [n, N]


class DequantLinear:
    """Dequantize one expert to f32 per call, then MKL's GEMM: for batches of many tokens."""

    def __init__(self, w: Stored):
        self.w = w

    def __call__(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), dequantize(expert_slice(self.w, expert))[0])  # [n, N]


def decode_linear(w: Stored):
    """The fastest torch-only product for a GEMV-shaped batch with this storage."""
    if isinstance(w, Int8Weight):
        return Int8Linear(w)
    if isinstance(w, Int4Weight):
        return Int4Linear(w)
    return DenseLinear(w)


def prefill_linear(w: Stored):
    """The product for a GEMM-shaped batch: dense weights as they are, quantized ones dequantized."""
    if isinstance(w, torch.Tensor) and w.dtype == torch.float32:
        return DenseLinear(w)
    return DequantLinear(w)


def expert_slice(w: Stored, expert: int) -> Stored:
    """One expert of stacked weights, still stacked ([1, N, ...]) and in the same storage."""
    s = slice(expert, expert + 1)
    if isinstance(w, Int8Weight):
        return Int8Weight(q=w.q[s], scale=w.scale[s])
    if isinstance(w, Int4Weight):
        return Int4Weight(packed=w.packed[s], scale=w.scale[s], min=w.min[s], group_size=w.group_size)
    return w[s]


def moe_with_linears(hidden: torch.Tensor, groups: ExpertGroups, gate_up, down, out: torch.Tensor) -> torch.Tensor:
    """out [T, H] f32 += the weighted SwiGLU experts, one product per touched expert."""
    start = 0
    for expert, n in enumerate(groups.counts):
        if n == 0:
            continue
        tokens = groups.tokens[start : start + n]  # [n]
        x = hidden.index_select(0, tokens)  # [n, H]
        gate, up = gate_up(expert, x).chunk(2, dim=-1)  # [n, I] each
        y = down(expert, F.silu(gate) * up)  # [n, H]
        out.index_add_(0, tokens, y * groups.weights[start : start + n, None])
        start += n
    return out
