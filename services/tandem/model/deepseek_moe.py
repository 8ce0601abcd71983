"""DeepSeek-V3's MoE block: group-limited sigmoid router, routed experts through the executor, shared experts.

Routing as DeepSeek-V3 trains it ("noaux_tc"): sigmoid scores; a per-expert correction bias that
steers which experts are chosen but not how much they weigh; experts split into `n_group` groups,
only the `topk_group` groups with the best top-2 sums eligible; top-k within those; weights
renormalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.experts.base import ExpertExecutor
from tandem.model.config import ModelConfig
from tandem.model.layers import DenseMLP
from tandem.model.moe import run_routed_experts


def route_grouped_sigmoid(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                          normalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32, bias [E] -> weights [T, k] float32, ids [T, k]."""
    t, num_experts = logits.shape
    scores = logits.sigmoid()  # [T, E]
    choice = scores + bias  # [T, E] for selection only
    per_group = choice.view(t, n_group, num_experts // n_group)  # [T, G, E/G]
    group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices  # [T, g]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)  # [T, G]
    expert_mask = group_mask.repeat_interleave(num_experts // n_group, dim=1)  # [T, E]
    choice = choice.masked_fill(~expert_mask, float("-inf"))  # [T, E]
    ids = choice.topk(top_k, dim=-1, sorted=False).indices  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class GroupedRouter(nn.Module):
    """`mlp.gate`: the router weight and the selection-only correction bias (kept in float32)."""

    keep_float32 = ("e_score_correction_bias",)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = cfg.top_k, cfg.n_group, cfg.topk_group
        self.normalize, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        return route_grouped_sigmoid(logits, self.e_score_correction_bias.float(), self.top_k, self.n_group,
                                     self.topk_group, self.normalize, self.scaling)


class DeepseekMoe(nn.Module):
    """Routed experts on the CPU socket via the executor; shared experts on the attention side."""

    def __init__(self, cfg: ModelConfig, layer: int, executor: ExpertExecutor):
        super().__init__()
        self.layer, self.executor = layer, executor
        self.gate = GroupedRouter(cfg)
        self.shared_experts = None
        if cfg.shared_expert_intermediate_size:
            self.shared_experts = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)  # [T, k]
        return self.combine(x, run_routed_experts(self.executor, self.layer, x, ids, weights))  # [T, H]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> routing weights [T, k] float32, expert ids [T, k] (see `SparseMoe.route`)."""
        return self.gate(x)

    def combine(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The block's output from its input x [T, H] and the routed experts' sum [T, H]."""
        return routed if self.shared_experts is None else routed + self.shared_experts(x)
