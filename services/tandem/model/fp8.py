"""Block-scaled FP8 checkpoints (DeepSeek-V3/R1, Qwen3 FP8): dequantized on load to the serving dtype.

Such a checkpoint stores each quantized linear weight `X.weight` as float8_e4m3fn [N, K] beside
`X.weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)]: one scale per bn x bk block, by which the
block is multiplied to recover the weight. The config says so in `quantization_config`:
{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [bn, bk]}.
DeepSeek-V3.1 adds "scale_fmt": "ue8m0": its scales are powers of two, stored as float32, or (as
transformers reads MXFP8 checkpoints) as the bytes of float8_e8m0fnu, 2^(byte - 127).
Unquantized tensors (embeddings, norms, the router, the LM head) pass through untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tandem.model.config import ModelError

SCALE_SUFFIX = "_scale_inv"  # `X.weight_scale_inv` scales `X.weight`
FP8_DTYPES = (torch.float8_e4m3fn,)


def fp8_block_size(quantization_config) -> tuple[int, int] | None:
    """The (rows, cols) of one scale block from a config's `quantization_config`; None when unquantized."""
    if quantization_config is None:
        return None
    q = quantization_config.to_dict() if hasattr(quantization_config, "to_dict") else dict(quantization_config)
    method = q.get("quant_method")
    if method != "fp8":
        raise ModelError(f"quantization method {method!r} is not supported; supported: 'fp8' (block-scaled e4m3)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelError(f"fp8 format {fmt!r} is not supported; supported: 'e4m3'")
    scale_fmt = q.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        raise ModelError(f"fp8 scale_fmt {scale_fmt!r} is not supported; supported: 'float', 'ue8m0'")
    expert_dtype = q.get("expert_dtype") or "fp8"
    if expert_dtype != "fp8":  # DeepSeek-V4's experts: fp4 packed in int8, which this module does not unpack
        raise ModelError(f"fp8 checkpoints with expert_dtype {expert_dtype!r} are not supported; supported: 'fp8'")
    # Activation scales (activation_scheme "static") are not needed: weights are served dequantized.
    block = q.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelError(f"fp8 weight_block_size must be two positive integers, e.g. [128, 128]; got {block!r}")
    return int(block[0]), int(block[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight fp8 [..., N, K], scale_inv [..., ceil(N/bn), ceil(K/bk)] -> float32 [..., N, K] (the
    leading dims: experts stacked as transformers' FP8Experts saves them, `experts.gate_up_proj_scale_inv`)."""
    if weight.dim() not in (2, 3):
        raise ModelError(f"fp8 weight must be [N, K] or stacked [E, N, K], got shape {tuple(weight.shape)}")
    (n, k), (bn, bk) = weight.shape[-2:], block
    expected = (*weight.shape[:-2], -(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != expected:
        raise ModelError(f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight "
                         f"{tuple(weight.shape)} in {bn}x{bk} blocks: expected {expected}")
    scale = _scales(scale_inv).repeat_interleave(bn, dim=-2)[..., :n, :]  # [..., N, K/bk]
    scale = scale.repeat_interleave(bk, dim=-1)[..., :k]  # [..., N, K]
    return weight.float() * scale  # [..., N, K]


def _scales(scale_inv: torch.Tensor) -> torch.Tensor:
    """Block scales as float32: float tensors as they are, bytes as UE8M0 (the one byte format of them)."""
    if scale_inv.dtype == torch.uint8:
        return scale_inv.view(torch.float8_e8m0fnu).float()
    if not scale_inv.is_floating_point():
        raise ModelError(f"weight_scale_inv must be floating point (or UE8M0 bytes), got {scale_inv.dtype}")
    return scale_inv.float()


def dequantize_stream(tensors: Iterable[tuple[str, torch.Tensor]],
                      block: tuple[int, int] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass (name, tensor) pairs through, replacing each fp8 weight and its scale by the float32 weight.

    A weight and its scale may come in either order (and from different shards), so the first of
    the pair waits until the second arrives; checkpoints list them side by side, so few wait.
    """
    waiting_weights: dict[str, torch.Tensor] = {}
    waiting_scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith(SCALE_SUFFIX):
            weight_name = name[: -len(SCALE_SUFFIX)]
            _require_block(block, name)
            if weight_name in waiting_weights:
                yield weight_name, dequantize(waiting_weights.pop(weight_name), tensor, block)
            else:
                waiting_scales[weight_name] = tensor
        elif tensor.dtype in FP8_DTYPES:
            _require_block(block, name)
            if name in waiting_scales:
                yield name, dequantize(tensor, waiting_scales.pop(name), block)
            else:
                waiting_weights[name] = tensor
        else:
            yield name, tensor
    if waiting_weights:
        raise ModelError(f"{len(waiting_weights)} fp8 weights have no {SCALE_SUFFIX} tensor, "
                         f"e.g. {sorted(waiting_weights)[0]}")
    if waiting_scales:
        raise ModelError(f"{len(waiting_scales)} {SCALE_SUFFIX} tensors have no fp8 weight, "
                         f"e.g. {sorted(waiting_scales)[0]}{SCALE_SUFFIX}")


def _require_block(block: tuple[int, int] | None, name: str) -> None:
    if block is None:
        raise ModelError(f"{name} is block-scaled fp8 but config.json has no fp8 quantization_config "
                         "with weight_block_size")
