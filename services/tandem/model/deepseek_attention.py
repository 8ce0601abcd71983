"""DeepSeek-V3's multi-head latent attention (MLA) module: projections, rope, the latent KV cache.

Parameter names follow the checkpoint (`q_a_proj`, `q_a_layernorm`, `q_b_proj` or `q_proj`,
`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`); the attention itself is in
`deepseek_mla`.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.kv.tiered import LayerKV, StepAttention
from tandem.model.config import ModelConfig
from tandem.model.deepseek_mla import absorb_query, paged_latent_attention, unabsorb_output
from tandem.model.layers import RMSNorm, apply_rope

LATENT = "latent"  # the single KV cache entry MLA declares


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] whose rope dims come in (even, odd) pairs; cos/sin [T, D] as cat(freqs, freqs).

    The result lists the rotated even dims, then the odd ones: the same permutation for queries
    and keys, so their dot products are those of the interleaved layout (as transformers does).
    """
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]  # [T, 1, D/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]  # [T, heads, D/2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [T, heads, D]


class MlaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dims = d = cfg.mla
        self.num_heads = cfg.num_heads
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        if d.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, cfg.num_heads * d.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, d.q_lora_rank, bias=bias)
            # transformers builds these two norms with its default eps (1e-6), not rms_norm_eps.
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(d.q_lora_rank, cfg.num_heads * d.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, d.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(d.kv_lora_rank, cfg.num_heads * (d.qk_nope_head_dim + d.v_head_dim), bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d.v_head_dim, hidden, bias=cfg.o_proj_bias)
        self.rope = apply_rope_interleaved if d.rope_interleave else apply_rope
        # The checkpoint's calibrated fp8 scale of the latent (`self_attn.k_scale`, as vLLM reads it
        # for MLA; a `v_scale` is ignored), which an fp8 cache takes (tandem.kv.fp8); 1.0 when none.
        self.k_scale = self.v_scale = 1.0

    @staticmethod
    def kv_entries(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return ((LATENT, (cfg.mla.latent_dim,)),)

    def kv_scales(self) -> tuple[float, ...]:
        return (self.k_scale,)  # the latent's

    def forward(self, x: torch.Tensor, cos_sin, kv: LayerKV, step: StepAttention):
        t, d = x.shape[0], self.dims
        q = self._query(x).view(t, self.num_heads, d.qk_head_dim)  # [T, H, nope + rope]
        q_nope, q_pe = q.split((d.qk_nope_head_dim, d.qk_rope_head_dim), dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split((d.kv_lora_rank, d.qk_rope_head_dim), dim=-1)  # [T, r], [T, rope]
        c = self.kv_a_layernorm(c)  # [T, r]
        cos, sin = cos_sin
        q_pe = self.rope(q_pe, cos, sin)  # [T, H, rope]
        k_pe = self.rope(k_pe[:, None], cos, sin)[:, 0]  # [T, rope]
        step.write(kv, {LATENT: torch.cat((c, k_pe), dim=-1)})  # [T, r + rope]
        w = self.kv_b_proj.weight
        out = step.attend(  # [T, H, v]
            lambda rows: paged_latent_attention(q_nope[rows], q_pe[rows], kv.device[LATENT], step.device, w, d,
                                                kv.scale(LATENT)),
            lambda rows: self._cpu_tier_attention(q_nope[rows], q_pe[rows], kv, step))
        return self.o_proj(out.reshape(t, -1))  # [T, hidden]

    def _cpu_tier_attention(self, q_nope, q_pe, kv: LayerKV, step: StepAttention) -> torch.Tensor:
        # The CPU side holds no weights: it attends in the latent space (absorbed form) and the
        # value projection W_uv is applied here.
        d, w = self.dims, self.kv_b_proj.weight
        q_lat = absorb_query(q_nope, q_pe, w, d)  # [Tc, H, r + rope]
        latent_out = step.attend_cpu(kv, q_lat, d.softmax_scale, value_dim=d.kv_lora_rank)  # [Tc, H, r]
        return unabsorb_output(latent_out, w, d)  # [Tc, H, v]

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.dims.q_lora_rank is None:
            return self.q_proj(x)  # [T, H * qk]
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # [T, H * qk]
