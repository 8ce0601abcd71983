"""Multi-head latent attention over a paged cache that holds only the latent.

Each cached token is one vector [kv_lora_rank + qk_rope_head_dim]: the normalised KV latent `c`
followed by the roped key part `k_pe` that all heads share. Per-head keys and values are
`kv_b_proj(c)` split into (k_nope [H, nope], v [H, v]). Two equal ways to attend:

- absorbed (decodes): fold k_nope's projection into the query, q_lat = q_nope @ W_uk [H, r], so
  scores are q_lat . c + q_pe . k_pe against the latent directly (one shared "KV head"); the
  weighted latent goes out through W_uv. Reads r + rope numbers per cached token, not H * (d + v).
- expanded (prefill): project every cached latent to full K and V and run ordinary attention,
  cheaper when many queries share the same keys.

The functions are device-agnostic: they run wherever their tensors are, GPU tier or CPU tier.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kv import fp8
from tandem.kv.attention import AttentionMetadata, gather_kv, paged_attention
from tandem.model.deepseek_config import MlaDims


def paged_latent_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                           kv_b_weight: torch.Tensor, dims: MlaDims, kv_scale: float = 1.0) -> torch.Tensor:
    """q_nope [T, H, nope], q_pe [T, H, rope] (roped), cache [blocks, block_size, r + rope] -> [T, H, v].
    An fp8 cache holds the latent / kv_scale (tandem.kv.fp8).

    Sequences with one new token (decodes) take the absorbed form, the others the expanded form.
    A step of decodes only (one token per sequence: its shapes say so) takes the absorbed form
    without looking at the data, so a CUDA graph can capture it.
    """
    if meta.query_index.shape[1] == 1:
        return absorbed_decode(q_nope, q_pe, cache, meta, kv_b_weight, dims, kv_scale)
    t, h = q_nope.shape[:2]
    out = q_nope.new_empty(t, h, dims.v_head_dim)  # [T, H, v]
    single = meta.query_valid.sum(dim=1) == 1  # [B]
    if bool(single.any()):
        tokens = meta.query_index[single, 0]  # [b] each decode's position in the T tokens
        out[tokens] = absorbed_decode(q_nope[tokens], q_pe[tokens], cache, decodes_of(meta, single), kv_b_weight,
                                      dims, kv_scale)
    if not bool(single.all()):
        sub = chunks_of(meta, ~single)
        out[sub.query_index[sub.query_valid]] = expanded_attention(q_nope, q_pe, cache, sub, kv_b_weight, dims,
                                                                   kv_scale)
    return out


def decodes_of(meta: AttentionMetadata, rows: torch.Tensor) -> AttentionMetadata:
    """A decode step's metadata for the sequences where `rows` [B] is True, each with one new token:
    its queries are the b tokens taken out in sequence order (query_index 0..b-1)."""
    b = int(rows.sum())
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[:0],  # attention writes nothing
        block_tables=meta.block_tables[rows],
        query_index=torch.arange(b, device=rows.device).view(b, 1),
        query_valid=torch.ones(b, 1, dtype=torch.bool, device=rows.device),
        query_pos=meta.query_pos[rows, :1],
        seq_lens=meta.seq_lens[rows],
        key_len=meta.key_len,
        sliding_window=meta.sliding_window,
    )


def chunks_of(meta: AttentionMetadata, rows: torch.Tensor) -> AttentionMetadata:
    """The metadata of the sequences where `rows` [B] is True, queries trimmed to their longest chunk
    and still indexing the step's T tokens."""
    valid = meta.query_valid[rows]  # [b, Qmax]
    q_max = int(valid.sum(dim=1).max())
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        block_tables=meta.block_tables[rows],
        query_index=meta.query_index[rows, :q_max],
        query_valid=valid[:, :q_max],
        query_pos=meta.query_pos[rows, :q_max],
        seq_lens=meta.seq_lens[rows],
        key_len=meta.key_len,
        sliding_window=meta.sliding_window,
    )


def split_kv_b(kv_b_weight: torch.Tensor, dims: MlaDims, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj.weight [H * (nope + v), r] -> W_uk [H, nope, r], W_uv [H, v, r] (views, no copy)."""
    w = kv_b_weight.view(num_heads, dims.qk_nope_head_dim + dims.v_head_dim, dims.kv_lora_rank)
    return w[:, : dims.qk_nope_head_dim], w[:, dims.qk_nope_head_dim:]


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_b_weight: torch.Tensor, dims: MlaDims) -> torch.Tensor:
    """q_nope [T, H, nope], q_pe [T, H, rope] -> queries in the latent space [T, H, r + rope]."""
    w_uk, _ = split_kv_b(kv_b_weight, dims, q_nope.shape[1])
    return torch.cat((torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe), dim=-1)


def unabsorb_output(latent_out: torch.Tensor, kv_b_weight: torch.Tensor, dims: MlaDims) -> torch.Tensor:
    """Attention output in the latent space [T, H, r] -> per-head values [T, H, v]."""
    _, w_uv = split_kv_b(kv_b_weight, dims, latent_out.shape[1])
    return torch.einsum("thr,hvr->thv", latent_out, w_uv)


def absorbed_decode(q_nope, q_pe, cache, meta: AttentionMetadata, kv_b_weight, dims: MlaDims,
                    kv_scale: float = 1.0) -> torch.Tensor:
    """Attention against the latent itself, one token per sequence, through `paged_attention`: every
    head on the latent as one shared KV head, its first r numbers the value. On CUDA that is the
    Triton decode kernel, which reads the blocks in place and which a CUDA graph captures."""
    q = absorb_query(q_nope, q_pe, kv_b_weight, dims)  # [T, H, r + rope]
    latent = cache[:, :, None]  # [blocks, block_size, 1, r + rope]: one KV head for all
    out = paged_attention(q, latent, latent[..., : dims.kv_lora_rank], meta, dims.softmax_scale,
                          k_scale=kv_scale, v_scale=kv_scale)  # [T, H, r]
    return unabsorb_output(out, kv_b_weight, dims)  # [T, H, v]


def expanded_attention(q_nope, q_pe, cache, meta: AttentionMetadata, kv_b_weight, dims: MlaDims,
                       kv_scale: float = 1.0) -> torch.Tensor:
    """Project the cached latents to per-head K and V, then ordinary attention."""
    h = q_nope.shape[1]
    latent = gather_kv(cache, meta.block_tables, meta.seq_lens)  # [B, L, r + rope], zeros past each length
    if cache.dtype == fp8.FP8:
        latent = latent.to(q_nope.dtype) * kv_scale
    c, k_pe = latent.split((dims.kv_lora_rank, dims.qk_rope_head_dim), dim=-1)
    b, length = latent.shape[:2]
    kv = F.linear(c, kv_b_weight).view(b, length, h, -1)  # [B, L, H, nope + v]
    k_nope, v = kv.split((dims.qk_nope_head_dim, dims.v_head_dim), dim=-1)
    k = torch.cat((k_nope, k_pe[:, :, None].expand(b, length, h, dims.qk_rope_head_dim)), dim=-1)  # [B, L, H, qk]
    q = torch.cat((q_nope, q_pe), dim=-1)[meta.query_index]  # [B, Q, H, qk]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=meta.mask, scale=dims.softmax_scale)  # [B, H, Q, v]
    return out.transpose(1, 2)[meta.query_valid]  # [t, H, v]
