"""Paged attention with torch ops: KV written by slot, read through block tables.

One code path serves prefill chunks and decode alike: queries of every sequence are padded to the
longest chunk, keys gathered from each sequence's blocks, and a mask gives each query the keys at
or before its own position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tandem.kv import fp8, triton_attention


class DecodeSteps(NamedTuple):
    """`steps` decode steps in a row of B sequences, one token each a step, as CPU tensors: what the
    native greedy runs take (`CausalLM.greedy_steps`), and what the steps' `AttentionMetadata` is
    made from (`AttentionMetadata.decode_steps`)."""

    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0; they cover every step
    positions: torch.Tensor  # [steps, B] int64: in step i sequence j computes its token at starts[j] + i
    slots: torch.Tensor  # [steps, B] int64: where that token's KV goes
    max_position: int  # the largest of the positions
    sliding_window: int | None

    @classmethod
    def build(cls, starts: list[int], block_tables: list[list[int]], steps: int, block_size: int,
              sliding_window: int | None = None) -> "DecodeSteps":
        """From lists, in two tensor constructions: a decode step's Python runs right after the weights
        have flushed the caches, so every op it saves is a cold one."""
        num_seqs, max_blocks = len(starts), max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.long)
        positions = [p + i for i in range(steps) for p in starts]
        # positions and slots of every step: one tensor from one list, views of it
        flat = torch.tensor(positions + slots_of(positions, block_tables * steps, block_size), dtype=torch.long)
        n = steps * num_seqs
        return cls(tables, flat[:n].view(steps, num_seqs), flat[n:].view(steps, num_seqs), max(starts) + steps - 1,
                   sliding_window)


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer. B sequences, T tokens in all."""

    slot_mapping: torch.Tensor  # [T] block_id * block_size + offset, where each token's KV goes
    block_tables: torch.Tensor  # [B, max_blocks] padded with 0
    query_index: torch.Tensor  # [B, Qmax] index into the T tokens (padding points at token 0)
    query_valid: torch.Tensor  # [B, Qmax] bool
    query_pos: torch.Tensor  # [B, Qmax] each query's position in its sequence
    seq_lens: torch.Tensor  # [B] context length after this step
    key_len: int  # Lmax: keys per sequence as the torch path gathers them (max_blocks * block_size)
    sliding_window: int | None = None  # the mask's window, for kernels that apply it themselves
    _mask: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def mask(self) -> torch.Tensor:
        """[B, 1, Qmax, Lmax] bool, True where a query may attend a key. Built on first use: the
        native decode kernels apply causality and the window themselves and never read it."""
        if self._mask is None:
            key_pos = torch.arange(self.key_len, device=self.query_pos.device)
            mask = key_pos[None, None, :] <= self.query_pos[:, :, None]  # [B, Qmax, Lmax]
            if self.sliding_window is not None:
                mask &= key_pos[None, None, :] > self.query_pos[:, :, None] - self.sliding_window
            mask[:, :, 0] |= ~self.query_valid  # padded queries see key 0 so their softmax stays finite
            self._mask = mask[:, None]
        return self._mask

    @property
    def first_keys(self) -> torch.Tensor | None:
        """[B] the first key position any query of each sequence reads (its first query's window
        starts there), or None without a sliding window."""
        if self.sliding_window is None:
            return None
        return (self.query_pos[:, 0] - self.sliding_window + 1).clamp_min(0)

    @classmethod
    def build(cls, starts: list[int], lens: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device, sliding_window: int | None = None) -> "AttentionMetadata":
        """starts[i]: position of sequence i's first new token; lens[i]: its number of new tokens."""
        num_seqs = len(starts)
        q_max = max(lens)
        max_blocks = max(len(t) for t in block_tables)
        l_max = max_blocks * block_size
        if all(n == 1 for n in lens):  # decode: one token per sequence
            return cls.decode_steps(DecodeSteps.build(starts, block_tables, 1, block_size, sliding_window), block_size,
                                    device)[0]
        tables = torch.zeros(num_seqs, max_blocks, dtype=torch.long)
        query_index = torch.zeros(num_seqs, q_max, dtype=torch.long)
        query_pos = torch.zeros(num_seqs, q_max, dtype=torch.long)
        query_valid = torch.zeros(num_seqs, q_max, dtype=torch.bool)
        slots, offset = [], 0
        for i, (start, n, table) in enumerate(zip(starts, lens, block_tables)):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
            query_index[i, :n] = torch.arange(offset, offset + n)
            query_pos[i, :n] = torch.arange(start, start + n)
            query_valid[i, :n] = True
            pos = torch.arange(start, start + n)
            slots.append(tables[i, pos // block_size] * block_size + pos % block_size)
            offset += n
        slot_mapping = torch.cat(slots)
        seq_lens = torch.tensor([s + n for s, n in zip(starts, lens)], dtype=torch.long)
        tensors = (slot_mapping, tables, query_index, query_valid, query_pos, seq_lens)
        if device.type != "cpu":  # built on the CPU: moved only when the step runs elsewhere
            tensors = tuple(t.to(device) for t in tensors)
        return cls(*tensors, key_len=l_max, sliding_window=sliding_window)

    @classmethod
    def decode_steps(cls, steps: DecodeSteps, block_size: int, device: torch.device) -> list["AttentionMetadata"]:
        """Metadata of each of the decode steps in a row, on `device`."""
        tables, pos, slots = steps.block_tables, steps.positions, steps.slots
        num_seqs = tables.shape[0]
        shared = [tables, pos, slots, torch.arange(num_seqs).view(-1, 1), torch.ones(num_seqs, 1, dtype=torch.bool)]
        if device.type != "cpu":  # built on the CPU: moved only when the steps run elsewhere
            shared = [t.to(device) for t in shared]
        tables, pos, slots, query_index, query_valid = shared
        seq_lens = pos + 1
        return [cls(slots[i], tables, query_index, query_valid, pos[i].view(-1, 1), seq_lens[i],
                    key_len=tables.shape[1] * block_size, sliding_window=steps.sliding_window)
                for i in range(pos.shape[0])]


def slots_of(positions: list[int], block_tables: list[list[int]], block_size: int) -> list[int]:
    """The cache slot (block_id * block_size + offset) of each sequence's token at positions[i]."""
    return [t[p // block_size] * block_size + p % block_size for p, t in zip(positions, block_tables)]


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor, scale: float = 1.0) -> None:
    """cache [blocks, block_size, *entry]; values [T, *entry] go to their slots, in an fp8 cache as
    values / scale (`tandem.kv.fp8.quantize`; other caches ignore the scale). On CUDA a Triton
    kernel writes them, skipping slot -1 (the padding rows of a graphed decode batch)."""
    values = fp8.quantize(values, scale) if cache.dtype == fp8.FP8 else values.to(cache.dtype)
    if cache.device.type == "cuda" and triton_attention.available(cache.device):
        triton_attention.write_kv(cache, slot_mapping, values)
        return
    rows = fp8.as_bytes(cache).view(-1, *cache.shape[2:])
    rows.index_copy_(0, slot_mapping, fp8.as_bytes(values))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor | None = None,
              first_keys: torch.Tensor | None = None) -> torch.Tensor:
    """cache [blocks, block_size, *entry], block_tables [B, nb] -> [B, nb * block_size, *entry].

    With seq_lens [B], each sequence's slots from its length on come back as zeros. They hold what
    their blocks held before (another request's KV, a NaN it computed, an earlier run's bytes in a
    reused shared-memory tier): masked out of the scores, yet a NaN or inf there would still reach
    the output, as 0 * NaN, through the probabilities' product with the values. With first_keys [B]
    (AttentionMetadata.first_keys), so do the slots before them: those before a sliding window,
    whose blocks the sequence may have freed (tandem.kv.block_manager.FREED_BLOCK_ID stands in for them:
    a block another sequence may hold)."""
    # fp8 as bytes: torch neither fills nor (on every device) indexes float8 tensors; fp8 zero is the zero byte
    gathered = fp8.as_bytes(cache)[block_tables].flatten(1, 2)  # [B, L, *entry], a copy
    if seq_lens is not None:
        key_pos = torch.arange(gathered.shape[1], device=gathered.device)  # [L]
        outside = key_pos >= seq_lens[:, None]  # [B, L]
        if first_keys is not None:
            outside |= key_pos < first_keys[:, None]
        if gathered.device.type == "cpu":
            # By index, a few slots a sequence (more before a window): a mask over the whole copy cost a quarter
            # of a bf16 decode step.
            gathered.flatten(0, 1).index_fill_(0, outside.view(-1).nonzero().view(-1), 0)
        else:  # nonzero would wait for the device every layer; a masked write does not
            gathered.masked_fill_(outside.view(*outside.shape, *[1] * (gathered.dim() - 2)), 0)
    return gathered.view(cache.dtype)


_native_decode = None  # resolved on first use: the op, or False


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, *, k_scale: float = 1.0, v_scale: float = 1.0,
                    native_any_dtype: bool = False) -> torch.Tensor:
    """q [T, H, D] (exactly the tokens `meta` describes, in order); caches [blocks, block_size, Hkv, D]
    and [blocks, block_size, Hkv, Dv] -> [T, H, Dv] in q's dtype.

    Float32 decode steps on the CPU run the native kernel, which reads K and V in place; decode
    steps on CUDA run the Triton kernel (`tandem.kv.triton_attention`), which does too and which a
    CUDA graph can capture; everything else (prefill chunks, no compiler, no Triton) runs
    `sdpa_paged_attention`. On the CPU bf16 stays on SDPA too:
    the native kernel accumulates in float32 and rounds once, torch's attention rounds the probabilities
    to bf16, and a one-ulp difference can flip an expert choice downstream, so bf16 serving would
    stop tracking transformers (the kernel itself takes bf16; see tests/engine/test_native_attention.py).
    `native_any_dtype` lifts that for attention with no transformers counterpart (the CPU tier's).

    fp8 caches (`tandem.kv.fp8`) hold K / k_scale and V / v_scale; every path here takes them
    (other caches ignore the scales). On the CPU their decode steps run the native kernel whatever
    q's dtype: with the KV rounded to e4m3 there is no bf16 rounding of transformers' left to track.
    """
    decode_only = meta.query_index.shape[1] == 1  # one token per sequence, in sequence order
    block_size = k_cache.shape[1]
    if decode_only and triton_attention.available(q.device) and not block_size & (block_size - 1):
        return triton_attention.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                                       scale, meta.sliding_window or 0, k_scale=k_scale,
                                                       v_scale=v_scale)
    quantized = k_cache.dtype == fp8.FP8
    native_dtype = native_any_dtype or q.dtype == torch.float32 or quantized
    # Any group size: MLA's 128 query heads on one latent too, which the kernel's tiles of a group's
    # heads do faster than the torch path's batched GEMMs (benchmarks/RESULTS.md round twenty-six).
    same_dtype = k_cache.dtype == v_cache.dtype and (quantized or q.dtype == k_cache.dtype)
    if decode_only and q.device.type == "cpu" and same_dtype and native_dtype:
        kernel = native_decode_attention()
        if kernel is not None:
            return kernel(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, meta.sliding_window or 0,
                          k_scale, v_scale)
    return sdpa_paged_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale)


def native_decode_attention():
    """torch.ops.tandem.paged_decode_attention (experts/csrc/paged_attention.cpp, built with the
    native expert kernel), or None where that kernel is not available."""
    global _native_decode
    if _native_decode is None:
        from tandem.experts.native import load_kernel

        ops = torch.ops.tandem if load_kernel() is not None else None
        _native_decode = getattr(ops, "paged_decode_attention", False) if ops is not None else False
    return _native_decode or None


def sdpa_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """`paged_attention` with torch ops: gather the blocks, one padded SDPA over the batch. fp8 blocks
    are gathered as they are, then converted to q's dtype; their scales go into the softmax's scale
    and the output."""
    decode_only = meta.query_index.shape[1] == 1  # one token per sequence, in sequence order: no gather
    qp = (q[:, None] if decode_only else q[meta.query_index]).transpose(1, 2)  # [B, H, Qmax, D]
    k = gather_kv(k_cache, meta.block_tables, meta.seq_lens, meta.first_keys).transpose(1, 2)  # [B, Hkv, L, D]
    v = gather_kv(v_cache, meta.block_tables, meta.seq_lens, meta.first_keys).transpose(1, 2)  # [B, Hkv, L, Dv]
    quantized = k_cache.dtype == fp8.FP8
    if quantized:
        k, v, scale = k.to(q.dtype), v.to(q.dtype), scale * k_scale  # e4m3 is exact in any float dtype
    heads = qp.shape[1]
    if k.shape[1] == 1 and heads > 1:
        out = shared_kv_head_attention(qp, k, v, meta.mask, scale)  # [B, H, Qmax, Dv]
    else:
        # Query head h reads KV head h // (H / Hkv); SDPA groups heads without copying K and V per head.
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=meta.mask, scale=scale,
                                             enable_gqa=k.shape[1] != heads)  # [B, H, Qmax, Dv]
    out = out.transpose(1, 2)  # [B, Qmax, H, Dv]
    if quantized and v_scale != 1.0:
        out = out * v_scale
    return out[:, 0] if decode_only else out[meta.query_valid]  # [T, H, Dv] in sequence order


def shared_kv_head_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """Attention of every query head against one shared KV head: q [B, H, Q, D], k [B, 1, L, D],
    v [B, 1, L, Dv] (may be a view narrower than k: MLA's latent), mask [B, 1, Q, L] -> [B, H, Q, Dv].

    Two batched GEMMs against the shared head. SDPA would take its math path here (the value is
    narrower than the key) and copy the keys once per head: 1.2 GB a layer for DeepSeek-V3's 128
    heads at 4096 tokens.
    """
    b, heads, q_len = q.shape[:3]
    # float32 throughout (a no-op for float32 models): bf16 products would round the scores twice.
    scores = torch.bmm(q.reshape(b, heads * q_len, -1).float(), k[:, 0].transpose(1, 2).float())  # [B, H*Q, L]
    scores = (scores * scale).view(b, heads, q_len, -1).masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)  # [B, H, Q, L]
    out = torch.bmm(probs.view(b, heads * q_len, -1), v[:, 0].float())  # [B, H*Q, Dv]
    return out.view(b, heads, q_len, -1).to(v.dtype)  # [B, H, Q, Dv]
