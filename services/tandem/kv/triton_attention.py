"""Decode-time paged attention and KV writes as Triton kernels, for CUDA graphs.

A decode step captured in a CUDA graph replays with fixed launch shapes and no host syncs, so
attention cannot gather blocks or build masks on the host as `tandem.kv.attention` does. These
kernels launch grids fixed by the batch's shape, read each sequence's length and block table on
the device, and touch only that sequence's own keys.

CUDA tensors run compiled kernels. CPU tensors run the same kernel source in Triton's
interpreter: that path exists for the tests (no GPU on the CI machine), not for serving. Each
kernel is wrapped once per mode on first use, so the choice follows the tensors' device and not
the TRITON_INTERPRET variable read when `@triton.jit` decorates.
"""

from __future__ import annotations

import contextlib
import functools

import torch

try:
    import triton
    import triton.language as tl
    from triton.language import core as tl_core  # noqa: F401 (for the interpreter: see _Interpreted)
except ImportError:  # CI may lack triton; `available()` then says no and callers fall back
    triton = tl = tl_core = None

LOG2E = 1.4426950408889634  # the kernels take exp2: exp(x) = exp2(x * log2(e))
MAX_PARTITIONS = 64  # key ranges one sequence's attention is split into, at most
PROGRAMS_PER_SM = 4  # decode programs the default partitioning aims for
WRITE_CHUNK = 1024  # entry elements one write_kv program copies
DOT_TILE = 16  # query heads of one KV head from which a program's scores are a matrix product (tl.dot)


def available(device: torch.device | str) -> bool:
    """True where the compiled kernels can run: triton imports and `device` is CUDA."""
    return triton is not None and torch.device(device).type == "cuda"


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, sliding_window: int = 0,
                           out: torch.Tensor | None = None, *, k_scale: float = 1.0, v_scale: float = 1.0,
                           partitions: int | None = None) -> torch.Tensor:
    """One decode token per sequence: q [B, H, D]; caches [blocks, block_size, Hkv, D] and
    [blocks, block_size, Hkv, Dv] (views with any strides); block_tables [B, max_blocks] int64;
    seq_lens [B] int64 keys per sequence, the new token's included -> [B, H, Dv] in q's dtype.

    Query head h reads KV head h // (H // Hkv); groups of DOT_TILE heads or more (MLA: every head
    on one latent) are scored in tiles of DOT_TILE heads by matrix products. A sequence attends its
    last `sliding_window` keys when that is positive, else all of them. A row with seq_len 0 is
    padding: zeros, no cache read. Each sequence's keys are split into `partitions` ranges scored in
    parallel and then combined (flash-decoding); by default enough to fill the GPU, a number fixed
    by B, Hkv and H alone. `out`,
    when given ([B, H, Dv], any strides), is written in place and returned. Raises ValueError for
    a block size that is not a power of two (callers fall back to torch).

    fp8 caches (float8 e4m3, `tandem.kv.fp8`) hold K / k_scale and V / v_scale. The kernel reads
    their bytes and converts them (`_fp8_to_float`): with the GPU's own conversion from sm_89 on
    (Triton's float8 type needs it), else with integer operations, which every GPU and the interpreter
    run; the scales are folded into the softmax's scale and the output.
    """
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    v_dim = v_cache.shape[-1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two for the Triton kernel, got {block_size}")
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
    if out is None:
        out = q.new_empty(batch, heads, v_dim)
    group = heads // kv_heads
    # A large group (MLA's heads on its one latent) is cut into tiles of query heads, each a matrix
    # product against the keys; a small one (grouped-query attention) is one broadcast tile.
    dot = group >= DOT_TILE and min(head_dim, v_dim) >= 16  # tl.dot's operands: 16 or more a side
    tile = DOT_TILE if dot else _pad(group)
    tiles = -(-group // tile)
    parts = partitions or _partitions(batch * kv_heads * tiles, q.device)
    # ranges' partial results, combined by a second kernel: [B, H, parts] and [B, H, parts, Dv]
    part_max = part_sum = part_acc = out  # unread placeholders: one range writes `out` itself
    if parts > 1:
        part_max, part_sum = torch.empty(2, batch, heads, parts, device=q.device, dtype=torch.float32)
        part_acc = torch.empty(batch, heads, parts, v_dim, device=q.device, dtype=torch.float32)
    interpreted = q.device.type == "cpu"
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 != (v_cache.dtype == torch.float8_e4m3fn):
        raise ValueError(f"K and V caches must both be fp8 or neither, got {k_cache.dtype} and {v_cache.dtype}")
    if fp8:  # the bytes, converted in the kernel; its products and rounding in q's dtype
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        scale, out_scale = scale * k_scale, v_scale
    else:
        out_scale = 1.0
    cache_dtype = _tl_dtype(q.dtype if fp8 else v_cache.dtype)
    _kernel(_decode_kernel, interpreted)[(batch, kv_heads * tiles, parts)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_max, part_sum, part_acc, scale * LOG2E, out_scale,
        heads,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), seq_lens.stride(0), *out.stride(),
        GROUP=group, HEAD_DIM=head_dim, V_DIM=v_dim, BLOCK_SIZE=block_size, SLIDING_WINDOW=max(sliding_window, 0),
        PARTS=parts, TILES=tiles, TILE=tile, DOT=dot, D_PAD=_pad(head_dim), DV_PAD=_pad(v_dim),
        D_MAIN=_main(head_dim), D_REST=_rest(head_dim), ROUND=cache_dtype, FP8=fp8,
        NATIVE_FP8=fp8 and not interpreted and native_fp8(q.device),
        # Triton 3.6's interpreter multiplies bf16 operands of tl.dot as their bit patterns: float32 there
        OPERAND=tl.float32 if interpreted else cache_dtype,
        **_step(tile, _pad(max(head_dim, v_dim)), dot))
    if parts > 1:
        _kernel(_combine_kernel, interpreted)[(batch, heads)](
            out, part_max, part_sum, part_acc, out_scale, *out.stride(),
            V_DIM=v_dim, PARTS=parts, PARTS_PAD=_pad(parts), DV_PAD=_pad(v_dim))
    return out


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """cache [blocks, block_size, *entry]; values [T, *entry] go to slot_mapping [T] int64
    (block_id * block_size + offset), converted to the cache's dtype. Rows with a negative slot
    (a CUDA graph batch's padding) are skipped."""
    blocks, block_size = cache.shape[:2]
    if values.shape[1:] != cache.shape[2:]:
        raise ValueError(f"values entries {tuple(values.shape[1:])} do not match the cache's {tuple(cache.shape[2:])}")
    try:
        flat_cache = cache.view(blocks, block_size, -1)  # [blocks, block_size, E]: written in place, so a view
    except RuntimeError as e:
        raise ValueError("write_kv needs the cache's entry dimensions to flatten into one (a view)") from e
    # converted by torch, which rounds to nearest even as the tests' reference does (the interpreter truncates)
    flat_values = values.reshape(values.shape[0], -1).to(cache.dtype)  # [T, E]
    if cache.dtype == torch.float8_e4m3fn:  # bytes (quantized by the caller: tandem.kv.fp8), on any GPU
        flat_cache, flat_values = flat_cache.view(torch.uint8), flat_values.view(torch.uint8)
    entry = flat_cache.shape[2]
    grid = (values.shape[0], triton.cdiv(entry, WRITE_CHUNK))
    _kernel(_write_kv_kernel, interpreted=cache.device.type == "cpu")[grid](
        flat_cache, slot_mapping, flat_values, block_size, *flat_cache.stride(), *flat_values.stride(),
        slot_mapping.stride(0), ENTRY=entry, CHUNK=WRITE_CHUNK)


@functools.cache
def native_fp8(device: torch.device) -> bool:
    """Whether the GPU converts e4m3 itself: NVIDIA's from compute capability 8.9 (Ada, Hopper). Not
    ROCm's, whose version numbers are not NVIDIA's and whose MI300 converts e4m3fnuz, not e4m3fn."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9)


def _partitions(programs: int, device: torch.device) -> int:
    """Key ranges per sequence for at least PROGRAMS_PER_SM programs an SM, a power of two (on
    H100 three ranges ran slower than two or four); one range on the CPU."""
    if device.type != "cuda":
        return 1
    return min(MAX_PARTITIONS, _pad(-(-PROGRAMS_PER_SM * _sm_count(device) // programs)))


def _step(tile: int, width: int, dot: bool) -> dict:
    """Keys a loop step and warps a program, for a tile of `tile` query heads and keys of `width`
    (padded) numbers. Broadcast tiles: about 16K products a step on two warps ran fastest on H100
    for groups of 1 to 8. Matrix-product tiles: 32 keys a step on eight warps, which ptxas compiled
    for sm_90 in 128 registers (four warps spilled more); on an H100, MLA's decode ran 2.8-4.2x torch's
    (benchmarks/RESULTS.md, round twenty-seven)."""
    if dot:
        return dict(KEYS=32, num_warps=8)
    return dict(KEYS=max(16, min(64, 16384 // (tile * width))), num_warps=2)


def _tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _main(head_dim: int) -> int:
    """The largest power of two in `head_dim`: the part of a key a matrix-product tile reads whole."""
    return 1 << (head_dim.bit_length() - 1)


def _rest(head_dim: int) -> int:
    """The padded width of what `_main` leaves (MLA's 64 rope numbers after 512), 0 for none; at
    least 16, tl.dot's least."""
    rest = head_dim - _main(head_dim)
    return max(_pad(rest), 16) if rest else 0


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pad(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()  # next power of two: tl.arange takes nothing else


@functools.cache
def _kernel(fn, interpreted: bool):
    """`fn` compiled for CUDA, or wrapped for Triton's interpreter (tensors on the CPU)."""
    if triton is None:
        raise RuntimeError("triton is not installed; check tandem.kv.triton_attention.available() first")
    return _Interpreted(fn) if interpreted else triton.jit(fn)


class _Interpreted:
    """A kernel run by Triton's interpreter, in a process where triton otherwise compiles.

    Two things are swapped in for the length of a launch. triton.language's own helpers (tl.sum,
    tl.max) became JIT functions when triton was imported without TRITON_INTERPRET, and a JIT
    function refuses to be called from Python: they run as the interpreter's rewrite of their
    source instead. Their builtins come from triton.language.core, which the interpreter patches
    (and restores) because `tl_core` is among the kernels' globals. And Triton 3.6's interpreter
    takes a loop bound with int() of a one-element array, which numpy 2.4 refuses (upstream now
    squeezes it first).
    """

    def __init__(self, fn):
        self.kernel = _interpreted(fn)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from triton.runtime import interpreter

            patch_tensor = functools.partial(_patch_lang_tensor, interpreter._patch_lang_tensor)
            with (_swapped(triton.runtime.jit.JITFunction, "__call__", _call_interpreted),
                  _swapped(interpreter, "_patch_lang_tensor", patch_tensor)):
                return self.kernel[grid](*args, **kwargs)
        return launch


@contextlib.contextmanager
def _swapped(owner, name: str, value):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@functools.cache
def _interpreted(fn):
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


def _call_interpreted(jit_fn, *args, **kwargs):
    return _interpreted(jit_fn.fn).rewrite()(*args, **kwargs)


def _patch_lang_tensor(patch, tensor, scope):
    patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda t: int(t.handle.data.squeeze()))


# The kernels below are plain functions, wrapped by `_kernel`: `tl` is only looked up when they run.

def _fp8_to_float(bits, NATIVE: tl.constexpr):
    """e4m3 bytes (uint8) -> float32 values, exactly: sign, exponent and mantissa moved into a
    float16's (its bias 15, not 7: the value times 2^-8, subnormals included), widened, times 2^8;
    0x7f and 0xff are NaN. Integer operations and a widening, which every GPU has; with NATIVE (compute
    capability 8.9 and later: Ada, Hopper), the GPU's own e4m3 conversion, the same values."""
    if NATIVE:
        return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    b = bits.to(tl.uint16)
    half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), half.to(tl.float32) * 256.0)


def _decode_kernel(q, k_cache, v_cache, block_tables, seq_lens, out, part_max, part_sum, part_acc, scale_log2,
                   out_scale, num_heads,
                   stride_qb, stride_qh, stride_qd,
                   stride_kb, stride_ks, stride_kh, stride_kd,
                   stride_vb, stride_vs, stride_vh, stride_vd,
                   stride_tb, stride_tn, stride_len, stride_ob, stride_oh, stride_od,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   SLIDING_WINDOW: tl.constexpr, PARTS: tl.constexpr, TILES: tl.constexpr, TILE: tl.constexpr,
                   DOT: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, D_MAIN: tl.constexpr,
                   D_REST: tl.constexpr, ROUND: tl.constexpr, OPERAND: tl.constexpr, KEYS: tl.constexpr,
                   FP8: tl.constexpr, NATIVE_FP8: tl.constexpr):
    # One program per (sequence, KV head's tile of query heads, key range): the tile's heads share
    # each K/V load.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = (tl.program_id(1) // TILES).to(tl.int64)
    tile = tl.program_id(1) % TILES
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq * stride_len)
    if SLIDING_WINDOW > 0:
        first_key = tl.maximum(seq_len - SLIDING_WINDOW, 0)
    else:
        first_key = seq_len * 0
    # this program's range: a whole number of steps, empty for the last ones of a short sequence
    per_part = ((seq_len - first_key + PARTS - 1) // PARTS + KEYS - 1) // KEYS * KEYS
    lo = first_key + part * per_part
    hi = tl.minimum(lo + per_part, seq_len)

    rows = tile * TILE + tl.arange(0, TILE)  # [G] the tile's heads within the group
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, D_PAD)  # [D]
    v_dims = tl.arange(0, DV_PAD)  # [Dv]
    offsets = tl.arange(0, KEYS)  # [S]
    q_rows = q + seq * stride_qb + heads[:, None] * stride_qh  # [G, 1]
    if DOT:
        # Matrix products of the cache's own dtype into float32 (as flash attention computes), the
        # key in a power-of-two part and a rest (MLA: 512 + 64), not padded to 1024.
        main = tl.arange(0, D_MAIN)  # [DM]
        q_main = tl.load(q_rows + main[None, :] * stride_qd, mask=rows[:, None] < GROUP,
                         other=0.0).to(OPERAND)  # [G, DM]
        if D_REST > 0:  # none when the key's width is a power of two
            rest = D_MAIN + tl.arange(0, D_REST)  # [DR]
            q_rest = tl.load(q_rows + rest[None, :] * stride_qd,
                             mask=(rows[:, None] < GROUP) & (rest[None, :] < HEAD_DIM), other=0.0).to(OPERAND)
    else:
        q_ok = (rows[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
        q_tile = tl.load(q_rows + dims[None, :] * stride_qd, mask=q_ok, other=0.0).to(tl.float32) * scale_log2  # [G, D]

    # online softmax in base 2: running max, running sum, weighted values
    m = tl.full([TILE], float("-inf"), tl.float32)  # [G]
    total = tl.zeros([TILE], tl.float32)  # [G]
    acc = tl.zeros([TILE, DV_PAD], tl.float32)  # [G, Dv]
    # Every step holds at least one key (its first), so m is finite after it.
    for start in range(lo, hi, KEYS):
        pos = start + offsets  # [S]
        key_ok = pos < hi  # masked loads: nothing past the range is read, table entries included
        block_ids = tl.load(block_tables + seq * stride_tb + (pos // BLOCK_SIZE) * stride_tn, mask=key_ok, other=0)
        k_rows = block_ids * stride_kb + (pos % BLOCK_SIZE) * stride_ks  # [S]
        v_rows = block_ids * stride_vb + (pos % BLOCK_SIZE) * stride_vs  # [S]
        k_base = k_cache + k_rows[:, None] + kv_head * stride_kh  # [S, 1]
        if DOT:  # operands of the cache's dtype (float32 ones, in the interpreter, in full precision: no TF32)
            k_main = tl.load(k_base + main[None, :] * stride_kd, mask=key_ok[:, None], other=0.0)  # [S, DM]
            if FP8:
                k_main = _fp8_to_float(k_main, NATIVE_FP8)
            scores = tl.dot(q_main, tl.trans(k_main.to(OPERAND)), input_precision="ieee")  # [G, S]
            if D_REST > 0:
                k_rest = tl.load(k_base + rest[None, :] * stride_kd, mask=key_ok[:, None] & (rest[None, :] < HEAD_DIM),
                                 other=0.0)  # [S, DR]
                if FP8:
                    k_rest = _fp8_to_float(k_rest, NATIVE_FP8)
                scores += tl.dot(q_rest, tl.trans(k_rest.to(OPERAND)), input_precision="ieee")
            scores = scores * scale_log2
        else:
            k = tl.load(k_base + dims[None, :] * stride_kd, mask=key_ok[:, None] & (dims[None, :] < HEAD_DIM),
                        other=0.0)  # [S, D]
            if FP8:
                k = _fp8_to_float(k, NATIVE_FP8)
            scores = tl.sum(q_tile[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [G, S]
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # [G]
        rescale = tl.exp2(m - m_new)  # [G]
        p = tl.exp2(scores - m_new[:, None])  # [G, S]
        v = tl.load(v_cache + v_rows[:, None] + kv_head * stride_vh + v_dims[None, :] * stride_vd,
                    mask=key_ok[:, None] & (v_dims[None, :] < V_DIM), other=0.0)  # [S, Dv]
        if FP8:
            v = _fp8_to_float(v, NATIVE_FP8)
        total = total * rescale + tl.sum(p, axis=1)
        if DOT:  # the probabilities rounded to the cache's dtype, as flash attention does
            acc = acc * rescale[:, None] + tl.dot(p.to(ROUND).to(OPERAND), v.to(OPERAND),
                                                  input_precision="ieee")  # [G, Dv]
        else:
            acc = acc * rescale[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)  # [G, Dv]
        m = m_new

    head_ok = rows < GROUP
    if PARTS == 1:
        result = acc / tl.where(total > 0, total, 1.0)[:, None] * out_scale  # padding rows (no keys) stay zero
        tl.store(out + seq * stride_ob + heads[:, None] * stride_oh + v_dims[None, :] * stride_od,
                 result.to(out.dtype.element_ty), mask=head_ok[:, None] & (v_dims[None, :] < V_DIM))
    else:
        part_row = (seq * num_heads + heads) * PARTS + part  # [G] into [B, H, PARTS]
        tl.store(part_max + part_row, m, mask=head_ok)
        tl.store(part_sum + part_row, total, mask=head_ok)
        tl.store(part_acc + part_row[:, None] * V_DIM + v_dims[None, :], acc,
                 mask=head_ok[:, None] & (v_dims[None, :] < V_DIM))


def _combine_kernel(out, part_max, part_sum, part_acc, out_scale, stride_ob, stride_oh, stride_od,
                    V_DIM: tl.constexpr, PARTS: tl.constexpr, PARTS_PAD: tl.constexpr, DV_PAD: tl.constexpr):
    # One program per (sequence, query head): its ranges' softmax pieces rescaled to one maximum.
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    parts = tl.arange(0, PARTS_PAD)  # [P]
    v_dims = tl.arange(0, DV_PAD)  # [Dv]
    part_row = (seq * tl.num_programs(1) + head) * PARTS + parts  # [P]
    part_ok = parts < PARTS
    m = tl.load(part_max + part_row, mask=part_ok, other=float("-inf"))  # [P], -inf for empty ranges
    sums = tl.load(part_sum + part_row, mask=part_ok, other=0.0)  # [P]
    acc = tl.load(part_acc + part_row[:, None] * V_DIM + v_dims[None, :],
                  mask=part_ok[:, None] & (v_dims[None, :] < V_DIM), other=0.0)  # [P, Dv]
    m_all = tl.max(m, axis=0)
    weight = tl.exp2(m - tl.where(m_all > float("-inf"), m_all, 0.0))  # [P]; a padding row has no keys at all
    total = tl.sum(weight * sums, axis=0)
    result = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0) * out_scale  # [Dv]
    tl.store(out + seq * stride_ob + head * stride_oh + v_dims * stride_od, result.to(out.dtype.element_ty),
             mask=v_dims < V_DIM)


if triton is not None:  # a helper the kernels call: a JIT function (the interpreter runs its source, see _Interpreted)
    _fp8_to_float = triton.jit(_fp8_to_float)


def _write_kv_kernel(cache, slot_mapping, values, block_size,
                     stride_cb, stride_cs, stride_ce, stride_vt, stride_ve, stride_slot,
                     ENTRY: tl.constexpr, CHUNK: tl.constexpr):
    # One program per (token, CHUNK of its entry).
    token = tl.program_id(0).to(tl.int64)
    elems = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    slot = tl.load(slot_mapping + token * stride_slot)
    ok = (elems < ENTRY) & (slot >= 0)
    value = tl.load(values + token * stride_vt + elems * stride_ve, mask=ok)
    dst = cache + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + elems * stride_ce
    tl.store(dst, value, mask=ok)
