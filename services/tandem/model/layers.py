"""Small building blocks shared by every architecture: RMSNorm, rotary embedding, dense MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale after casting back, as transformers does (one fused op).
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE with frequencies from transformers' own initialisers (default, linear, llama3, yarn)."""

    def __init__(self, hf_config, head_dim: int | None = None):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            dim = head_dim or getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = scaling
        # cos and sin of positions [0, P) as [2, P, D] float32, grown by `reserve` (as vLLM's
        # cos_sin_cache): a decode step then looks its rows up in one op instead of computing them
        # in eight (~150 us a step on a CPU whose caches the weight reads keep cold).
        self._table: torch.Tensor | None = None

    def reserve(self, num_positions: int, device: torch.device) -> None:
        """Make `cos_sin(..., max_position=p)` a table lookup for every p < num_positions."""
        table = self._table
        if table is not None and table.shape[1] >= num_positions and table.device == device:
            return
        size = max(num_positions, 1024, 2 * table.shape[1] if table is not None else 0)
        self._table = torch.stack(self._compute(torch.arange(size, device=device)))  # [2, P, D]

    def table(self, num_positions: int, device: torch.device) -> torch.Tensor:
        """cos and sin of positions [0, P) as [2, P, D] float32, P >= num_positions (see `reserve`)."""
        self.reserve(num_positions, device)
        return self._table

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] of positions [T]. With `max_position` (the largest of them) inside the
        table that `reserve` made, looked up; else computed (the same values)."""
        table = self._table
        if (max_position is not None and table is not None and max_position < table.shape[1]
                and table.device == positions.device):
            cos, sin = table.index_select(1, positions)  # [T, D] each, contiguous
            return cos.to(dtype), sin.to(dtype)
        cos, sin = self._compute(positions)
        return cos.to(dtype), sin.to(dtype)

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos() * self.scaling, emb.sin() * self.scaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, D]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DenseMLP(nn.Module):
    """SwiGLU MLP on the attention side: dense layers and shared experts."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [T, H]
