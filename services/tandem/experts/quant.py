"""Weight-only quantization of expert matrices: int8 per output channel, int4 group-wise.

Both formats keep the [N, K] layout (rows are output channels), stacked over experts as
[E, N, ...], so one expert's row is one contiguous run of bytes a GEMV streams once.

int4 follows llama.cpp's Q4_1 idea: per group of `group_size` weights along K, a scale and
a minimum (fp16), w = q * scale + min with q in 0..15. Inside each 32-weight block, byte j
holds weight j in its low nibble and weight j + 16 in its high nibble, so a SIMD kernel
unpacks one 16-byte load into 32 consecutive weights with an AND and a shift.

The group scales come in one of two forms: fp16 (as quantized, and from GGUF files), or
integer (`to_integer_scales`): int16 scales over one float32 factor per row, for CPUs without
vpdpbusd, whose kernel multiplies by integer scales inside its integer dot products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUANTS = ("none", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
_INT4_BLOCK = 32  # weights per packed 16-byte block
_FP16_MAX = 65504.0
# The largest |int16 group scale| of integer scales: a kernel's int32 lane then adds 256 weights'
# products (4 x 2 x 7620 x 16383 < 2^31; 7620 = 2 x 2 x 15 x 127, two blocks' halves of u4 x s8 pairs).
INT4_ISCALE_MAX = 16383


@dataclass
class Int8Weight:
    """Symmetric int8 weights with one fp32 scale per output channel: w = q * scale."""

    q: torch.Tensor  # [E, N, K] int8
    scale: torch.Tensor  # [E, N] float32

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.q.shape)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


@dataclass
class Int4Weight:
    """Asymmetric int4 weights, group-wise along K: w = q * scale + min, q in 0..15."""

    packed: torch.Tensor  # [E, N, K/2] uint8, block layout described in the module docstring
    # [E, N, G] float16 (G = K/group_size), or integer scales: [E, N, G + 2] int16, a row's G
    # scales and then its float32 factor's bytes; a group's scale is then scale[g] * factor
    scale: torch.Tensor
    min: torch.Tensor  # [E, N, K/group_size] float16
    group_size: int

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, half_k = self.packed.shape
        return (e, n, 2 * half_k)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + self.min.nbytes

    @property
    def integer_scales(self) -> bool:
        return self.scale.dtype == torch.int16

    def group_scales(self) -> torch.Tensor:
        """The group scales as float32 [E, N, G], whichever form they are stored in."""
        if not self.integer_scales:
            return self.scale.float()
        g = self.scale.shape[-1] - 2
        return self.scale[..., :g].float() * self.scale[..., g:].contiguous().view(torch.float32)


Stored = torch.Tensor | Int8Weight | Int4Weight  # [E, N, K] as the CPU executor stores it
FORMATS = ("float", "int8", "int4")  # a stored weight's format (stored_format)


def stored_format(w: Stored) -> str:
    if isinstance(w, Int8Weight):
        return "int8"
    if isinstance(w, Int4Weight):
        return "int4"
    return "float"


def stored_parts(w: Stored) -> tuple[torch.Tensor, ...]:
    """The tensors a stored weight is made of, each indexed by expert first: (w,), (q, scale) for
    int8, (packed, scale, min) for int4."""
    if isinstance(w, Int8Weight):
        return w.q, w.scale
    if isinstance(w, Int4Weight):
        return w.packed, w.scale, w.min
    return (w,)


def from_parts(fmt: str, parts: tuple[torch.Tensor, ...], group_size: int = 0) -> Stored:
    """The stored weight of format `fmt` made of `parts` (stored_parts' inverse)."""
    if fmt == "int8":
        return Int8Weight(*parts)
    if fmt == "int4":
        return Int4Weight(*parts, group_size=group_size)
    if fmt == "float":
        (w,) = parts
        return w
    raise ValueError(f"unknown stored weight format {fmt!r}; one of {FORMATS}")


def check_quant(quant: str) -> None:
    if quant not in QUANTS:
        raise ValueError(f"unknown expert quantization {quant!r}; choose one of {QUANTS}")


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Quantize [E, N, K] float weights to int8 with a per-output-channel scale."""
    _check_stacked(w)
    w = w.float()
    _check_finite(w)
    scale = w.abs().amax(dim=-1) / 127.0  # [E, N]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(w / scale[..., None]).clamp_(-127, 127).to(torch.int8)  # [E, N, K]
    return Int8Weight(q=q.contiguous(), scale=scale.contiguous())


def dequantize_int8(w: Int8Weight) -> torch.Tensor:
    return w.q.float() * w.scale[..., None]  # [E, N, K]


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> Int4Weight:
    """Quantize [E, N, K] float weights to int4 with a scale and minimum per group along K."""
    _check_stacked(w)
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    e, n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 needs the input size K={k} to be a multiple of the group size {group_size}")
    w = w.float()
    _check_finite(w)
    if w.abs().max() > _FP16_MAX / 2:
        raise ValueError("weights too large for int4's fp16 scales")
    groups = w.reshape(e, n, k // group_size, group_size)  # [E, N, G, gs]
    lo = groups.amin(dim=-1)  # [E, N, G]
    hi = groups.amax(dim=-1)
    # Round scale and min to fp16 first, then quantize against the rounded values, so the
    # stored codes are the best ones for the scale the kernels will actually use.
    scale = ((hi - lo) / 15.0).half()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    mn = lo.half()
    q = torch.round((groups - mn.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15)
    return Int4Weight(
        packed=pack_int4(q.to(torch.uint8).reshape(e, n, k)),
        scale=scale.contiguous(),
        min=mn.contiguous(),
        group_size=group_size,
    )


def to_integer_scales(w: Int4Weight) -> Int4Weight:
    """The same codes and minimums with integer group scales: each row's scales rounded to int16
    multiples of one float32 factor, its largest |scale| / INT4_ISCALE_MAX (relative error under
    3e-5 of the row's largest scale, far below a 4-bit code's step)."""
    if w.integer_scales:
        return w
    scale = w.scale.float()  # [E, N, G]
    top = scale.abs().amax(dim=-1, keepdim=True)
    factor = torch.where(top > 0, top / INT4_ISCALE_MAX, torch.ones_like(top))  # [E, N, 1]
    isc = torch.round(scale / factor).clamp_(-INT4_ISCALE_MAX, INT4_ISCALE_MAX).to(torch.int16)
    return Int4Weight(packed=w.packed, scale=torch.cat((isc, factor.view(torch.int16)), dim=-1).contiguous(),
                      min=w.min, group_size=w.group_size)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [E, N, K] uint8 -> packed [E, N, K/2] uint8 in int4's block layout."""
    e, n, k = codes.shape
    q = codes.reshape(e, n, k // _INT4_BLOCK, 2, _INT4_BLOCK // 2)  # [.., block, lo|hi, 16]
    packed = q[..., 0, :] | (q[..., 1, :] << 4)  # [E, N, K/32, 16]
    return packed.reshape(e, n, k // 2).contiguous()


def unpack_int4(w: Int4Weight) -> torch.Tensor:
    """The 0..15 codes of an Int4Weight as [E, N, K] uint8."""
    e, n, k = w.shape
    blocks = w.packed.reshape(e, n, k // _INT4_BLOCK, _INT4_BLOCK // 2)  # [E, N, K/32, 16]
    q = torch.stack((blocks & 0x0F, blocks >> 4), dim=-2)  # [E, N, K/32, 2, 16]
    return q.reshape(e, n, k)


def dequantize_int4(w: Int4Weight) -> torch.Tensor:
    e, n, k = w.shape
    q = unpack_int4(w).float().reshape(e, n, k // w.group_size, w.group_size)  # [E, N, G, gs]
    deq = q * w.group_scales()[..., None] + w.min.float()[..., None]
    return deq.reshape(e, n, k)


def quantize(w: torch.Tensor, quant: str, group_size: int = 32) -> torch.Tensor | Int8Weight | Int4Weight:
    """Stacked weights in the executor's storage for `quant` ("none" keeps f32 or bf16)."""
    check_quant(quant)
    if quant == "int8":
        return quantize_int8(w)
    if quant == "int4":
        return quantize_int4(w, group_size)
    _check_stacked(w)
    if w.dtype not in (torch.float32, torch.bfloat16):
        w = w.float()
    return w.contiguous()


def dequantize(w: torch.Tensor | Int8Weight | Int4Weight) -> torch.Tensor:
    """Float32 [E, N, K] weights equal to what the quantized kernels compute with."""
    if isinstance(w, Int8Weight):
        return dequantize_int8(w)
    if isinstance(w, Int4Weight):
        return dequantize_int4(w)
    return w.float()


def _check_stacked(w: torch.Tensor) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise ValueError(f"expert weights must be a 3-d tensor [E, N, K], got {getattr(w, 'shape', type(w))}")
    if not w.is_floating_point():
        raise ValueError(f"expert weights must be floating point, got {w.dtype}")


def _check_finite(w: torch.Tensor) -> None:
    if not torch.isfinite(w).all():
        raise ValueError("expert weights contain NaN or infinity; cannot quantize")
