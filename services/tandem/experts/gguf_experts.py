"""Routed-expert weights from a llama.cpp GGUF file, into the expert executor's formats.

People who run MoE models on CPUs often have them as GGUF files already quantized by llama.cpp
(Q8_0, Q4_0, Q4_K_M). `tandem serve --experts-gguf FILE` takes the routed experts from such a
file and everything else from the Hugging Face checkpoint (attention, norms, routers, the LM
head: GGUF reorders attention rows for its rope, and those stay on the GPU at their own dtype).

llama.cpp stores a layer's experts as three stacked tensors, `blk.{layer}.ffn_{gate,up,down}_exps.weight`,
[E, I, H], [E, I, H] and [E, H, I] in row-major order: the executor's [N, K] rows, as they are. Newer
conversions (convert_hf_to_gguf.py --fuse-gate-up-exps, and models whose checkpoints fuse them) store
gate and up as one `blk.{layer}.ffn_gate_up_exps.weight` [E, 2I, H]: the converter concatenates
torch.cat([gate, up], dim=1), and llama.cpp's build_moe_ffn reads gate from rows 0..I-1 and up from rows
I..2I-1 of each expert. It is split there: a row is whole blocks in every type, so the halves
are the file's bytes as they are and convert as two separate tensors would.
The file's types decide the layer's format, as close to the file's own numbers as the
executor's kernels can hold:
- Q4_0 and Q4_K become int4 with groups of 32 (`Int4Weight`, w = q * scale + min): the 4-bit
  codes are the file's. Q4_0's block (an fp16 d, w = d (q - 8)) is int4's packing byte for byte,
  scale d and min -8d, exactly. Q4_K's 256-weight super-block has 8 sub-blocks of 32 with 6-bit
  scales and minimums under two fp16 factors, w = d sc_j q - dmin m_j: each sub-block's scale
  d sc_j and minimum -dmin m_j are rounded to fp16 (a relative error of at most 2^-11 on
  each, an absolute one of 2^-25 below fp16's normal range; llama.cpp computes them in float32).
- Any other layer becomes int8 with a scale per row: every tensor of the layer is dequantized by
  the gguf package's reference code and requantized to its row's largest |w| / 127 (`quantize_int8`).
  For Q8_0 that adds at most half a step to the file's own rounding; a layer in another type, or
  whose three tensors do not share Q4_0/Q4_K (Q4_K_M keeps some layers' ffn_down_exps in Q6_K),
  keeps more precision than a 6-bit type has rather than dropping to 4 bits, and reads more bytes.

A tensor's float32 copy exists only while it is converted. A model split by llama.cpp's gguf-split
(PREFIX-00001-of-0000N.gguf, as large models are published) is named by its first shard and read
from all N.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tandem.experts.base import ExpertWeights
from tandem.experts.quant import Int4Weight, Int8Weight, pack_int4, quantize_int8

_log = logging.getLogger(__name__)

_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.weight$")
_SHARD_NAME = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")  # gguf-split's (and llama.cpp's) shard names
_PROJS = ("gate", "up", "down")
_Q4_0_BYTES = 18  # 32 weights: an fp16 d and 16 bytes of codes
_Q4_K_BYTES, _Q4_K_WEIGHTS = 144, 256  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 of codes
_INT4_GROUP = 32
_FP16_MAX = 65504.0


def load_gguf_experts(path: str | Path) -> dict[int, ExpertWeights]:
    """layer -> ExpertWeights (gate_up [E, 2I, H], down [E, H, I]) as `Int4Weight`s or
    `Int8Weight`s, one format a layer, for `make_expert_executor(..., quant=gguf_quant(layers))`.
    ValueError names the file or tensor that cannot be read."""
    return {layer: _layer(layer, tensors) for layer, tensors in sorted(_expert_tensors(path).items())}


def gguf_expert_shapes(path: str | Path) -> dict[int, dict[str, tuple[int, ...]]]:
    """layer -> {"gate", "up", "down": [E, N, K]} of the file's routed-expert tensors, from its tensor
    index alone (nothing read or dequantized): what a checkpoint's config is checked against first."""
    return {layer: {proj: tuple(int(n) for n in reversed(t.shape)) for proj, t in tensors.items()}  # GGUF: [K, N, E]
            for layer, tensors in _expert_tensors(path).items()}


def gguf_files(path: str | Path) -> list[Path]:
    """The files a GGUF model is read from: `path`, or all N shards when it is the first of a split
    model (PREFIX-00001-of-0000N.gguf)."""
    path = Path(path)
    m = _SHARD_NAME.fullmatch(path.name)
    if m is None or int(m[2]) != 1:
        return [path]
    count = int(m[3])
    return [path.with_name(f"{m[1]}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _expert_tensors(path: str | Path) -> dict[int, dict[str, object]]:
    """layer -> {"gate", "up", "down": the reader's tensor, or a half of a fused gate_up one} of the routed
    experts in `path` (all its shards), each of a type this module can convert."""
    found: dict[int, dict[str, object]] = {}
    for reader in _readers(Path(path)):
        for tensor in reader.tensors:
            if m := _EXPERT_TENSOR.match(tensor.name):
                _check_type(tensor)
                if m[2] in found.setdefault(int(m[1]), {}):
                    raise ValueError(f"{path}: {tensor.name} is in more than one shard")
                found[int(m[1])][m[2]] = tensor
    if not found:
        raise ValueError(f"{path} has no routed-expert tensors (blk.N.ffn_gate_exps.weight ...)")
    return {layer: _unfused(layer, tensors) for layer, tensors in found.items()}


@dataclass(frozen=True)
class _Rows:
    """The gate or up half of a fused ffn_gate_up_exps tensor, read as the tensor it would be unfused."""

    name: str
    tensor_type: object
    shape: tuple[int, ...]  # GGUF order, [K, N, E]
    data: np.ndarray  # [E, N, ...]: the file's rows (a view)


def _unfused(layer: int, tensors: dict[str, object]) -> dict[str, object]:
    """{"gate", "up", "down"}: a fused gate_up tensor [E, 2I, H] split into gate (rows 0..I-1 of each
    expert) and up (rows I..2I-1), as llama.cpp's build_moe_ffn reads it."""
    fused = tensors.pop("gate_up", None)
    if fused is None:
        return tensors
    if "gate" in tensors or "up" in tensors:
        raise ValueError(f"layer {layer}: {fused.name} and separate ffn_gate_exps/ffn_up_exps tensors; "
                         "a layer has one or the other")
    shape = tuple(int(n) for n in reversed(fused.shape))  # [E, 2I, H]
    if len(shape) != 3 or shape[1] % 2 or fused.data.shape[:2] != shape[:2]:
        raise ValueError(f"{fused.name}: expected stacked experts [E, 2I, H] (gate rows, then up rows), "
                         f"got shape {list(shape)}")
    e, i, h = shape[0], shape[1] // 2, shape[2]
    gate, up = fused.data[:, :i], fused.data[:, i:]  # [E, I, H or bytes]
    return {**tensors, "gate": _Rows(f"{fused.name} (gate rows)", fused.tensor_type, (h, i, e), gate),
            "up": _Rows(f"{fused.name} (up rows)", fused.tensor_type, (h, i, e), up)}


def _readers(path: Path) -> list:
    """A GGUF reader for each file of the model at `path` (see gguf_files)."""
    import gguf

    files = gguf_files(path)
    readers = [_reader(files[0])]
    field = readers[0].get_field(gguf.Keys.Split.LLM_KV_SPLIT_COUNT)
    count = 1 if field is None else int(field.contents())
    if count != len(files):
        if count > 1:
            raise ValueError(f"{path} is a shard of a GGUF model split in {count}: name its first shard, "
                             f"PREFIX-00001-of-{count:05d}.gguf")
        raise ValueError(f"{path} is named as the first of {len(files)} shards but is a whole GGUF file")
    return readers + [_reader(f) for f in files[1:]]


def _reader(path: Path):
    import gguf

    if not path.is_file():
        raise ValueError(f"{path} is not a file")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError... on a bad file
        raise ValueError(f"{path} is not a GGUF file gguf can read: {exc}") from None


def _check_type(tensor) -> None:
    """Refuse, before anything loads, a tensor type that is neither int4's (Q4_0, Q4_K) nor one the
    gguf package can dequantize (one block of zeros tells)."""
    import gguf

    qtype = tensor.tensor_type
    if qtype in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_K):
        return
    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        raise ValueError(f"{tensor.name}: tensor type {qtype.name} is not supported (Q4_0 and Q4_K load as int4, "
                         "any other type the gguf package can dequantize as int8 rows)") from None


def gguf_quant(layers: dict[int, ExpertWeights]) -> str:
    """The executor quantization for layers from `load_gguf_experts`: "int4" when any layer is."""
    return "int4" if any(isinstance(w.gate_up, Int4Weight) for w in layers.values()) else "int8"


def _layer(layer: int, tensors: dict) -> ExpertWeights:
    missing = [p for p in _PROJS if p not in tensors]
    if missing:
        raise ValueError(f"layer {layer}: no {', '.join(f'ffn_{p}_exps' for p in missing)} tensor")
    import gguf

    T = gguf.GGMLQuantizationType
    types = {p: tensors[p].tensor_type for p in _PROJS}
    data = {p: np.asarray(tensors[p].data) for p in _PROJS}
    if all(t in (T.Q4_0, T.Q4_K) for t in types.values()):
        w = {p: (q4_0_to_int4 if types[p] == T.Q4_0 else q4_k_to_int4)(data[p]) for p in _PROJS}
    else:
        _log.info("layer %d: experts in %s; requantized to int8 per row", layer,
                  ", ".join(f"ffn_{p}_exps {types[p].name}" for p in _PROJS))
        w = {p: quantize_int8(_dequantized(tensors[p], data[p])) for p in _PROJS}
    gate, up, down = w["gate"], w["up"], w["down"]
    if gate.shape != up.shape or down.shape != (gate.shape[0], gate.shape[2], gate.shape[1]):
        raise ValueError(f"layer {layer}: expert shapes gate {gate.shape}, up {up.shape}, down {down.shape} "
                         "do not form [E, I, H], [E, I, H], [E, H, I]")
    if isinstance(gate, Int4Weight):
        gate_up = Int4Weight(packed=torch.cat([gate.packed, up.packed], dim=1),
                             scale=torch.cat([gate.scale, up.scale], dim=1),
                             min=torch.cat([gate.min, up.min], dim=1), group_size=_INT4_GROUP)
    else:
        gate_up = Int8Weight(q=torch.cat([gate.q, up.q], dim=1), scale=torch.cat([gate.scale, up.scale], dim=1))
    return ExpertWeights(gate_up=gate_up, down=down)


def _dequantized(tensor, data: np.ndarray) -> torch.Tensor:
    import gguf

    try:
        w = gguf.quants.dequantize(data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(f"{tensor.name}: gguf cannot dequantize {tensor.tensor_type.name}") from None
    if w.ndim != 3:
        raise ValueError(f"{tensor.name}: expected stacked experts [E, N, K], got shape {w.shape}")
    w = np.ascontiguousarray(w, dtype=np.float32)
    return torch.from_numpy(w if w.flags.writeable else w.copy())  # F32 tensors come as the file's read-only map


def _blocks(data: np.ndarray, block_bytes: int, name: str) -> torch.Tensor:
    """Quantized bytes [E, N, K/B * block_bytes] -> a uint8 tensor [E, N, K/B, block_bytes] (a copy)."""
    if data.dtype != np.uint8 or data.ndim != 3 or data.shape[2] % block_bytes:
        raise ValueError(f"{name} data must be uint8 [E, N, blocks * {block_bytes}], got {data.dtype} {data.shape}")
    e, n, nbytes = data.shape
    return torch.from_numpy(np.array(data)).reshape(e, n, nbytes // block_bytes, block_bytes)


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    """Two bytes per entry (last dim) as float32."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _half(x: torch.Tensor, name: str) -> torch.Tensor:
    if not torch.isfinite(x).all() or x.abs().max() > _FP16_MAX:
        raise ValueError(f"{name}: a block scale is not finite or does not fit fp16")
    return x.half().contiguous()


def q4_0_to_int4(blocks: np.ndarray) -> Int4Weight:
    """Q4_0 bytes [E, N, K/32 * 18] -> Int4Weight with groups of 32, the same numbers: a block's
    16 code bytes are int4's packing (byte j: weight j low, weight j + 16 high)."""
    raw = _blocks(blocks, _Q4_0_BYTES, "Q4_0")
    e, n, nb = raw.shape[:3]
    d = _fp16(raw[..., :2])  # [E, N, K/32]
    return Int4Weight(packed=raw[..., 2:].reshape(e, n, nb * 16).contiguous(), scale=_half(d, "Q4_0"),
                      min=_half(-8.0 * d, "Q4_0"), group_size=_INT4_GROUP)


def q4_k_to_int4(blocks: np.ndarray) -> Int4Weight:
    """Q4_K bytes [E, N, K/256 * 144] -> Int4Weight with groups of 32 (a Q4_K sub-block each): the
    file's codes, each sub-block's scale d * sc and minimum -dmin * m rounded to fp16."""
    raw = _blocks(blocks, _Q4_K_BYTES, "Q4_K")
    e, n, nb = raw.shape[:3]
    d, dmin = _fp16(raw[..., 0:2]), _fp16(raw[..., 2:4])  # [E, N, K/256]
    s = raw[..., 4:16].long()  # [E, N, K/256, 12]: 8 six-bit scales and 8 six-bit minimums
    # ggml's get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7
    # (minimums); sub-blocks 4-7 in the nibbles of bytes 8-11, their top 2 bits in those bytes' top bits.
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], dim=-1)  # [.., 8]
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)  # [.., 8]
    scale = (d[..., None] * sc.float()).reshape(e, n, nb * 8)  # [E, N, K/32]
    minimum = (-dmin[..., None] * mn.float()).reshape(e, n, nb * 8)
    # 128 code bytes in 4 runs of 32: run c's low nibbles are sub-block 2c, its high ones 2c + 1.
    qs = raw[..., 16:].reshape(e, n, nb, 4, 1, 32)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-2).reshape(e, n, nb * _Q4_K_WEIGHTS)  # [E, N, K], natural order
    return Int4Weight(packed=pack_int4(codes), scale=_half(scale, "Q4_K"), min=_half(minimum, "Q4_K"),
                      group_size=_INT4_GROUP)
