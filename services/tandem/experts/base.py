"""The one interface the model calls for routed experts, and the weights it computes with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class ExpertsUnavailable(RuntimeError):
    """The expert executor cannot be reached (the split deployment's experts process is down)."""


@dataclass
class ExpertWeights:
    """Routed-expert weights of one MoE layer, stacked over experts, stored [N, K] for `F.linear`."""

    gate_up: torch.Tensor  # [E, 2I, H]: gate rows first, then up rows
    down: torch.Tensor  # [E, H, I]

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.down.shape[2]


class ExpertExecutor(Protocol):
    """Computes the weighted sum of routed-expert outputs for a batch of tokens."""

    def forward(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T, H], topk_ids [T, k] int64, topk_weights [T, k] float32 -> [T, H] in hidden's dtype."""
        ...
