"""FP8 checkpoints: each float8_e4m3fn weight dequantized on load to the serving dtype, w = fp8 * scale.

Three ways of saving them, told apart by config.json's `quantization_config`:
- DeepSeek-V3/R1, Qwen3 FP8 (transformers' FineGrainedFP8): {"quant_method": "fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "weight_block_size": [bn, bk]}; `X.weight` [N, K] beside
  `X.weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)], one scale per bn x bk block, by which the block
  is multiplied (the name notwithstanding). DeepSeek-V3.1 adds "scale_fmt": "ue8m0": powers of two,
  stored as float32 or (as transformers reads MXFP8 checkpoints) as the bytes of float8_e8m0fnu.
- AutoFP8, and vLLM's reading of "fp8" without weight_block_size: {"quant_method": "fp8",
  "activation_scheme": "static", "ignored_layers": [...]}; `X.weight_scale` is one number per tensor.
- llm-compressor (compressed-tensors' "float-quantized" format: its FP8, FP8_DYNAMIC and FP8_BLOCK
  schemes): {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups":
  {name: {"weights": {"type": "float", "num_bits": 8, "symmetric": true, "strategy": ...}}}, "ignore": [...]};
  `X.weight_scale` is [1] (strategy "tensor"), [N, 1] ("channel") or [ceil(N/bn), ceil(K/bk)] ("block",
  "block_structure": [bn, bk]), and w = fp8 * scale as compressed-tensors' own dequantize computes it.
The scale's shape says which granularity it is; a shape that fits none is an error.

Static activation scales (`X.input_scale` of AutoFP8 and compressed-tensors, transformers'
`X.activation_scale`) are dropped: they quantize a layer's input to fp8 for fp8 matrix units, and
Tandem computes activations in bf16/f32, which is more precise than that, as vLLM does with fp8
weights on hardware without fp8 compute (weight-only, Marlin). Modules the config leaves unquantized
(`ignore`, `ignored_layers`, `modules_to_not_convert`) must be unquantized in the checkpoint too.
Unquantized tensors (embeddings, norms, the router, the LM head) pass through untouched.

compressed-tensors' `kv_cache_scheme` (fp8, one static scale per tensor: `self_attn.k_scale` and
`self_attn.v_scale` a layer, with or without quantized weights) is read by the loader
(`tandem.model.loader`): an fp8 KV cache (--kv-cache-dtype fp8, `tandem.kv.fp8`) stores K / k_scale
and V / v_scale; an "auto" one ignores them, as vLLM does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from tandem.model.config import ModelError

FP8_DTYPES = (torch.float8_e4m3fn,)
# The weight a weight scale scales: `X.weight_scale_inv` (and transformers' stacked experts'
# `experts.gate_up_proj_scale_inv`), `X.weight_scale`.
_WEIGHT_SCALE = re.compile(r"(.+)_scale_inv$|(.+\.weight)_scale$")
# The module an activation scale is of: `X.input_scale`, `X.activation_scale`, and the stacked experts'
# `experts.gate_up_proj_activation_scale` (whose weight is the module's own name).
_ACTIVATION_SCALE = re.compile(r"(.+)\.(?:input|activation)_scale$|(.+_proj)_activation_scale$")


@dataclass(frozen=True)
class Fp8Scheme:
    """A checkpoint's fp8 quantization, as far as loading it needs: the block of a block scale (None when
    the scales are per tensor or per output channel) and the modules left unquantized."""

    method: str  # "fp8" or "compressed-tensors"
    block: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()

    def ignores(self, module: str) -> bool:
        """Whether `module` (a checkpoint name, e.g. "lm_head") is one the config leaves unquantized, matched
        as the tool that wrote the list does."""
        if self.method == "compressed-tensors":  # compressed-tensors' match_name: "re:" + re.match, or equal
            return any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in self.ignore)
        # transformers' should_convert_module: a prefix up to a module boundary (as a regex), or a suffix
        return any(re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", module) or module.endswith(p) for p in self.ignore)


def fp8_scheme(quantization_config) -> Fp8Scheme | None:
    """The scheme of a config's `quantization_config`; None when unquantized. ModelError names what is
    not supported."""
    if quantization_config is None:
        return None
    q = quantization_config.to_dict() if hasattr(quantization_config, "to_dict") else dict(quantization_config)
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8(q)
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    raise ModelError(f"quantization method {method!r} is not supported; supported: 'fp8' (e4m3, block-scaled or "
                     "per tensor) and 'compressed-tensors' (float-quantized fp8 weights)")


def _fp8(q: dict) -> Fp8Scheme:
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelError(f"fp8 format {fmt!r} is not supported; supported: 'e4m3'")
    scale_fmt = q.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        raise ModelError(f"fp8 scale_fmt {scale_fmt!r} is not supported; supported: 'float', 'ue8m0'")
    expert_dtype = q.get("expert_dtype") or "fp8"
    if expert_dtype != "fp8":  # DeepSeek-V4's experts: fp4 packed in int8, which this module does not unpack
        raise ModelError(f"fp8 checkpoints with expert_dtype {expert_dtype!r} are not supported; supported: 'fp8'")
    activations = q.get("activation_scheme") or "dynamic"
    if activations not in ("dynamic", "static"):
        raise ModelError(f"fp8 activation_scheme {activations!r} is not supported; supported: 'dynamic', 'static'")
    block = q.get("weight_block_size")
    ignore = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
    return Fp8Scheme("fp8", None if block is None else _block(block, "fp8 weight_block_size"), _names(ignore))


def _compressed_tensors(q: dict) -> Fp8Scheme:
    groups = q.get("config_groups")
    kv_cache = q.get("kv_cache_scheme")
    if kv_cache:
        _check_kv_cache_scheme(kv_cache)
    if not isinstance(groups, dict) or (not groups and not kv_cache):
        raise ModelError("compressed-tensors quantization_config has no config_groups")
    blocks = set()
    for name, group in groups.items():
        fmt = group.get("format") or q.get("format")
        weights = group.get("weights") or {}
        kind = f"{weights.get('type')} {weights.get('num_bits')}-bit weights"
        if fmt != "float-quantized" or (weights.get("type"), weights.get("num_bits")) != ("float", 8):
            raise ModelError(f"compressed-tensors config group {name!r}: format {fmt!r} with {kind} is not "
                             "supported; supported: 'float-quantized' with float 8-bit (fp8) weights")
        if not weights.get("symmetric", True) or weights.get("dynamic"):
            raise ModelError(f"compressed-tensors config group {name!r}: fp8 weights that are asymmetric or "
                             "dynamic are not supported; supported: symmetric, static")
        strategy = weights.get("strategy")
        if strategy == "block":
            blocks.add(_block(weights.get("block_structure"), f"config group {name!r} block_structure"))
        elif strategy not in ("tensor", "channel"):
            raise ModelError(f"compressed-tensors config group {name!r}: fp8 weight strategy {strategy!r} is not "
                             "supported; supported: 'tensor', 'channel', 'block'")
    if len(blocks) > 1:
        raise ModelError(f"compressed-tensors config groups with different block_structures {sorted(blocks)} "
                         "are not supported")
    return Fp8Scheme("compressed-tensors", blocks.pop() if blocks else None, _names(q.get("ignore") or ()))


def _check_kv_cache_scheme(scheme) -> None:
    """The KV cache scheme an fp8 KV cache takes: e4m3 with a static scale per tensor (K's, V's) a layer."""
    if not isinstance(scheme, dict):
        raise ModelError(f"compressed-tensors kv_cache_scheme must be a mapping, got {scheme!r}")
    kind = f"{scheme.get('type')} {scheme.get('num_bits')}-bit"
    strategy = scheme.get("strategy") or "tensor"
    if ((scheme.get("type"), scheme.get("num_bits")) != ("float", 8) or strategy != "tensor"
            or scheme.get("dynamic") or not scheme.get("symmetric", True)):
        raise ModelError(f"compressed-tensors kv_cache_scheme of {kind} numbers, strategy {strategy!r}"
                         f"{', dynamic' if scheme.get('dynamic') else ''} is not supported; supported: float 8-bit "
                         "(fp8), strategy 'tensor', static and symmetric: a k_scale and v_scale a layer")


def _block(block, what: str) -> tuple[int, int]:
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelError(f"{what} must be two positive integers, e.g. [128, 128]; got {block!r}")
    return int(block[0]), int(block[1])


def _names(names) -> tuple[str, ...]:
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ModelError(f"quantization_config's list of unquantized modules must be a list of names, got {names!r}")
    return tuple(names)


def weight_of(name: str) -> str:
    """The weight a checkpoint tensor belongs to: itself, or the weight a scale of it scales."""
    if m := _WEIGHT_SCALE.match(name):
        return m[1] or m[2]
    if m := _ACTIVATION_SCALE.match(name):
        return f"{m[1]}.weight" if m[1] else m[2]
    return name


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """weight fp8 [..., N, K] times its scale -> float32 [..., N, K]. The scale is per bn x bk block
    [..., ceil(N/bn), ceil(K/bk)] (with `block`), per tensor (one number, or one per leading index), or per
    output channel [..., N, 1] or [..., N]. The leading dims: experts stacked as transformers' FP8Experts
    saves them, `experts.gate_up_proj_scale_inv`."""
    if weight.dim() not in (2, 3):
        raise ModelError(f"fp8 weight must be [N, K] or stacked [E, N, K], got shape {tuple(weight.shape)}")
    lead, (n, k) = tuple(weight.shape[:-2]), weight.shape[-2:]
    s, shape = _scales(scale), tuple(scale.shape)
    if block is not None and shape == (*lead, -(-n // block[0]), -(-k // block[1])):
        s = s.repeat_interleave(block[0], dim=-2)[..., :n, :]  # [..., N, K/bk]
        return weight.float() * s.repeat_interleave(block[1], dim=-1)[..., :k]  # [..., N, K]
    if s.numel() == 1:
        return weight.float() * s.reshape(())
    if lead and shape in (lead, (*lead, 1), (*lead, 1, 1)):  # one per expert
        return weight.float() * s.reshape(*lead, 1, 1)
    if shape in ((*lead, n), (*lead, n, 1)):
        return weight.float() * s.reshape(*lead, n, 1)
    expected = [f"{(*lead, n, 1)} per channel", "(1,) per tensor"]
    if block is not None:
        expected.insert(0, f"{(*lead, -(-n // block[0]), -(-k // block[1]))} in {block[0]}x{block[1]} blocks")
    raise ModelError(f"fp8 scale shape {shape} does not match weight {tuple(weight.shape)}: expected "
                     f"{', '.join(expected)}")


def _scales(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32: float tensors as they are, bytes as UE8M0 (the one byte format of them)."""
    if scale.dtype == torch.uint8:
        return scale.view(torch.float8_e8m0fnu).float()
    if not scale.is_floating_point():
        raise ModelError(f"fp8 weight scales must be floating point (or UE8M0 bytes), got {scale.dtype}")
    return scale.float()


def dequantize_stream(tensors: Iterable[tuple[str, torch.Tensor]],
                      scheme: Fp8Scheme | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass (name, tensor) pairs through, replacing each fp8 weight and its scale by the float32 weight
    and dropping activation scales.

    A weight and its scale may come in either order (and from different shards), so the first of
    the pair waits until the second arrives; checkpoints list them side by side, so few wait.
    """
    waiting_weights: dict[str, torch.Tensor] = {}
    waiting_scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if scheme is not None and _ACTIVATION_SCALE.match(name):
            continue
        if m := _WEIGHT_SCALE.match(name):
            weight = m[1] or m[2]
            _check_quantized(scheme, name, weight)
            if weight in waiting_weights:
                yield weight, dequantize(waiting_weights.pop(weight), tensor, scheme.block)
            else:
                waiting_scales[weight] = tensor
        elif tensor.dtype in FP8_DTYPES:
            _check_quantized(scheme, name, name)
            if name in waiting_scales:
                yield name, dequantize(tensor, waiting_scales.pop(name), scheme.block)
            else:
                waiting_weights[name] = tensor
        else:
            yield name, tensor
    if waiting_weights:
        raise ModelError(f"{len(waiting_weights)} fp8 weights have no scale tensor (weight_scale_inv or "
                         f"weight_scale), e.g. {sorted(waiting_weights)[0]}")
    if waiting_scales:
        raise ModelError(f"{len(waiting_scales)} scale tensors have no fp8 weight, e.g. the scale of "
                         f"{sorted(waiting_scales)[0]}")


def _check_quantized(scheme: Fp8Scheme | None, name: str, weight: str) -> None:
    if scheme is None:
        raise ModelError(f"{name} is an fp8 weight or its scale, but config.json has no fp8 quantization_config")
    module = weight.removesuffix(".weight")
    if scheme.ignores(module):
        raise ModelError(f"{name} is fp8, but quantization_config lists {module} among the modules it leaves "
                         "unquantized")
