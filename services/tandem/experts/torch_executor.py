"""The reference expert executor: torch ops, tokens grouped per expert, no per-token loops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.experts.base import ExpertWeights


class TorchExpertExecutor:
    """Holds routed-expert weights in CPU memory (or any device) and computes with torch kernels."""

    def __init__(self, layers: dict[int, ExpertWeights], threads: int | None = None):
        self.layers = layers
        if threads:
            torch.set_num_threads(threads)

    def forward(self, layer, hidden, topk_ids, topk_weights):
        w = self.layers[layer]
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, H]
        flat_ids = topk_ids.reshape(-1)  # [T*k]
        order = torch.argsort(flat_ids, stable=True)  # [T*k], grouped by expert
        counts = torch.bincount(flat_ids, minlength=w.num_experts).tolist()
        token_of = order // topk_ids.shape[1]  # [T*k]
        weight_of = topk_weights.reshape(-1)[order]  # [T*k]
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            tokens = token_of[start : start + n]  # [n]
            x = hidden[tokens]  # [n, H]
            y = expert_mlp(x, w.gate_up[expert], w.down[expert])  # [n, H]
            out.index_add_(0, tokens, y.float() * weight_of[start : start + n, None])
            start += n
        return out.to(hidden.dtype)


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert: down(silu(gate(x)) * up(x)). x [n, H], gate_up [2I, H], down [H, I]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # [n, I] each
    return F.linear(F.silu(gate) * up, down)  # [n, H]
