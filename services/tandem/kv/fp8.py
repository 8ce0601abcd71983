"""An fp8 KV cache (`--kv-cache-dtype fp8`, vLLM's flag): K and V stored as float8 e4m3, one byte a number.

A block then takes half the bytes of a bfloat16 one (a quarter of a float32 one), so each tier holds
twice the tokens in the same memory. Each layer's K and V (MLA: its latent) have one float scale
each: a write stores clamp(x / scale, ±448) in e4m3 (saturating, where a plain cast would give NaN),
a read is the stored number times the scale. The scale is 1.0 unless the checkpoint carries
calibrated ones (`self_attn.k_scale` / `v_scale`, see `tandem.model.loader`), as vLLM does.

The kernels never multiply the cache by its scales: attention is linear in them, so
softmax(q . (K ks)^T sm) = softmax(q . K^T (sm ks)) and the output's values times vs. They only
convert e4m3 to float.
"""

from __future__ import annotations

import math

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite number; it has no infinity
# --kv-cache-dtype's values (tandem.contract.KV_CACHE_DTYPES): "auto" keeps the model's dtype;
# "fp8" and vLLM's other name for it, "fp8_e4m3", are e4m3.
NAMES = {"fp8": FP8, "fp8_e4m3": FP8}


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for --kv-cache-dtype `name`."""
    if name == "auto":
        return model_dtype
    if name not in NAMES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(NAMES)}; got {name!r}")
    return NAMES[name]


def check_scale(scale: float, what: str) -> float:
    if not (isinstance(scale, (int, float)) and 0 < scale < math.inf):
        raise ValueError(f"{what} must be a finite number > 0, got {scale!r}")
    return float(scale)


def quantize(values: torch.Tensor, scale: float) -> torch.Tensor:
    """values (any float dtype) -> e4m3 of values / scale, saturated at ±448 (NaN stays NaN).

    Times the reciprocal, as the native decode layer computes it (experts/csrc/decode_layer.cpp),
    so both write the same bytes."""
    x = values.float()
    if scale != 1.0:
        x = x * (1.0 / scale)
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as uint8 (a view): torch has no index_copy_ or masked fill for float8."""
    return t.view(torch.uint8) if t.dtype == FP8 else t
