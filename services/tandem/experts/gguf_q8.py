"""Routed-expert weights from a llama.cpp GGUF file in Q8_0, into the executor's int8 format.

llama.cpp stores a Mixtral-style layer's experts as three stacked tensors,
`blk.{layer}.ffn_{gate,up,down}_exps.weight` ([E, I, H], [E, I, H], [E, H, I] in row-major
order). Q8_0 keeps, per block of 32 weights along a row, an fp16 scale d and 32 int8 codes
(34 bytes). The executor's int8 keeps one float32 scale per row, so each row is requantized:
its scale is the largest |d_b q| over the row / 127, and each code is round(d_b q / scale).
That adds the per-row rounding (at most half a step) to Q8_0's own; a tensor's float32 copy
exists only while it is converted.

Only Q8_0 expert tensors are read; any other type is refused with its name. Attention and the
rest of the model still come from the Hugging Face checkpoint (GGUF reorders attention rows for
its rope).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from tandem.experts.base import ExpertWeights
from tandem.experts.quant import Int8Weight

_BLOCK, _BLOCK_BYTES = 32, 34  # Q8_0: 32 weights in an fp16 scale plus 32 int8 codes
_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


def load_q8_0_experts(path: str | Path) -> dict[int, ExpertWeights]:
    """layer -> ExpertWeights whose gate_up [E, 2I, H] and down [E, H, I] are `Int8Weight`s,
    for `make_expert_executor(..., quant="int8")`."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is not a file")
    reader = gguf.GGUFReader(str(path))
    parts: dict[int, dict[str, Int8Weight]] = {}
    for tensor in reader.tensors:
        m = _EXPERT_TENSOR.match(tensor.name)
        if not m:
            continue
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q8_0:
            raise ValueError(f"{tensor.name} is {tensor.tensor_type.name}; only Q8_0 expert tensors can be loaded")
        parts.setdefault(int(m[1]), {})[m[2]] = q8_0_to_int8(np.asarray(tensor.data))
    if not parts:
        raise ValueError(f"{path} has no routed-expert tensors (blk.N.ffn_gate_exps.weight ...)")
    return {layer: _stack(layer, p) for layer, p in sorted(parts.items())}


def q8_0_to_int8(blocks: np.ndarray) -> Int8Weight:
    """Q8_0 bytes [E, N, K/32 * 34] -> Int8Weight (q [E, N, K] int8, scale [E, N] float32)."""
    if blocks.dtype != np.uint8 or blocks.ndim != 3 or blocks.shape[2] % _BLOCK_BYTES:
        raise ValueError(f"Q8_0 data must be uint8 [E, N, K/32 * 34], got {blocks.dtype} {blocks.shape}")
    e, n, nbytes = blocks.shape
    raw = torch.from_numpy(np.array(blocks)).reshape(e, n, nbytes // _BLOCK_BYTES, _BLOCK_BYTES)
    d = raw[..., :2].contiguous().view(torch.float16).float()  # [E, N, K/32, 1]
    codes = raw[..., 2:].contiguous().view(torch.int8).float()  # [E, N, K/32, 32]
    w = (codes * d).reshape(e, n, -1)  # [E, N, K]
    scale = w.abs().amax(dim=-1) / 127.0  # [E, N]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q=q.contiguous(), scale=scale.contiguous())


def _stack(layer: int, p: dict[str, Int8Weight]) -> ExpertWeights:
    missing = {"gate", "up", "down"} - set(p)
    if missing:
        raise ValueError(f"layer {layer}: no ffn_{'/'.join(sorted(missing))}_exps tensor")
    gate, up, down = p["gate"], p["up"], p["down"]
    if gate.shape != up.shape or down.shape != (gate.shape[0], gate.shape[2], gate.shape[1]):
        raise ValueError(f"layer {layer}: expert shapes gate {gate.shape}, up {up.shape}, down {down.shape} "
                         "do not form [E, I, H], [E, I, H], [E, H, I]")
    gate_up = Int8Weight(q=torch.cat([gate.q, up.q], dim=1), scale=torch.cat([gate.scale, up.scale], dim=1))
    return ExpertWeights(gate_up=gate_up, down=down)
