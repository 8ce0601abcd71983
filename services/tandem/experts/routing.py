"""Checking a routed batch and grouping its (token, expert) pairs by expert."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertGroups:
    """The (token, expert) assignments of a batch sorted by expert, with per-expert counts."""

    tokens: torch.Tensor  # [T*k] int64: the token of each assignment, grouped by expert
    weights: torch.Tensor  # [T*k] float32: its routing weight
    counts: list[int]  # [E]: assignments per expert, in expert order


def check_batch(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                hidden_size: int, num_experts: int) -> None:
    """Raise ValueError when a routed batch does not fit the layer it is sent to."""
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(f"hidden must be [T, {hidden_size}], got {tuple(hidden.shape)}")
    if not hidden.is_floating_point():
        raise ValueError(f"hidden must be floating point, got {hidden.dtype}")
    t = hidden.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids must be [{t}, k], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"topk_ids must be int64, got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    if topk_ids.numel():
        lo, hi = (int(v) for v in torch.aminmax(topk_ids))  # one pass: this runs once per layer per step
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"topk_ids must lie in [0, {num_experts}), got {lo}..{hi}")


def group_by_expert(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Sort the batch's assignments by expert with tensor ops (no per-token Python loop)."""
    flat_ids = topk_ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat_ids, stable=True)  # [T*k]
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    tokens = order // topk_ids.shape[1]  # [T*k]
    weights = topk_weights.reshape(-1).float()[order]  # [T*k]
    return ExpertGroups(tokens=tokens, weights=weights, counts=counts)
