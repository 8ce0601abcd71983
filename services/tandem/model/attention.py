"""Grouped-query attention over the paged KV cache (Llama, Mixtral, Qwen2-MoE, Qwen3-MoE)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.kv.attention import paged_attention
from tandem.kv.tiered import LayerKV, StepAttention
from tandem.model.config import ModelConfig
from tandem.model.layers import RMSNorm, apply_rope


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.head_dim**-0.5
        # The checkpoint's calibrated fp8 KV scales (`self_attn.k_scale`, `v_scale`), which an fp8
        # cache takes (tandem.kv.fp8); 1.0 when it has none.
        self.k_scale = self.v_scale = 1.0

    @staticmethod
    def kv_entries(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return (("k", (cfg.num_kv_heads, cfg.head_dim)), ("v", (cfg.num_kv_heads, cfg.head_dim)))

    def kv_scales(self) -> tuple[float, ...]:
        return self.k_scale, self.v_scale  # in kv_entries' order

    def forward(self, x: torch.Tensor, cos_sin, kv: LayerKV, step: StepAttention):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        step.write(kv, {"k": k, "v": v})
        out = step.attend(  # [T, H, D]
            lambda rows: paged_attention(q[rows], kv.device["k"], kv.device["v"], step.device, self.scale,
                                         k_scale=kv.scale("k"), v_scale=kv.scale("v")),
            lambda rows: step.attend_cpu(kv, q[rows], self.scale))
        return self.o_proj(out.reshape(t, -1))  # [T, hidden]
