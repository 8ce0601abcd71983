"""The sparse MoE block: router on the attention side, routed experts through the executor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.experts.base import ExpertExecutor
from tandem.model.config import ModelConfig
from tandem.model.layers import DenseMLP


def wrap_executors(model: nn.Module, wrap, select=lambda executor: True) -> list:
    """Replace each MoE block's expert executor for which select(executor) holds by wrap(executor),
    called once per executor: the blocks that shared one (the loader hands every block the same
    in-process executor) share its wrapper. Returns the wrappers."""
    wrapped = {}
    for module in model.modules():
        executor = getattr(module, "executor", None)
        if executor is None or not hasattr(executor, "forward") or not select(executor):
            continue
        if id(executor) not in wrapped:
            wrapped[id(executor)] = wrap(executor)
        module.executor = wrapped[id(executor)]
    return list(wrapped.values())


def route_softmax(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, top-k, optional renormalisation. logits [T, E] -> weights [T, k] f32, ids [T, k]."""
    probs = F.softmax(logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def run_routed_experts(executor: ExpertExecutor, layer: int, x: torch.Tensor, ids: torch.Tensor,
                       weights: torch.Tensor) -> torch.Tensor:
    """Call the expert executor; x [T, H], ids/weights [T, k] -> [T, H] on x's device."""
    if x.device.type == "cpu":
        return executor.forward(layer, x, ids, weights)
    # A large prefill chunk may run on the GPU with the weights streamed to it
    # (tandem.experts.device_prefill); wrappers that time or count calls are looked through.
    on_device = _device_path(executor)
    if on_device is not None and (out := on_device(layer, x, ids, weights)) is not None:
        return out
    # The experts live in the CPU socket's memory: hidden states cross to it and back.
    out = executor.forward(layer, x.cpu(), ids.cpu(), weights.cpu())
    return out.to(x.device, non_blocking=True)


def _device_path(executor):
    while executor is not None:
        if (method := getattr(executor, "forward_on_device", None)) is not None:
            return method
        executor = getattr(executor, "inner", None)
    return None


class SparseMoe(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, executor: ExpertExecutor):
        super().__init__()
        self.layer, self.executor = layer, executor
        self.top_k, self.normalize = cfg.top_k, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        # Qwen2-MoE rounds routing weights to the activation dtype; Mixtral keeps float32.
        self.round_weights = cfg.model_type == "qwen2_moe" or cfg.model_type == "qwen3_moe"
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)  # [T, k]
        return self.combine(x, run_routed_experts(self.executor, self.layer, x, ids, weights))  # [T, H]

    # The two halves around the routed experts, for callers that run the experts themselves
    # (tandem.engine.cuda_graph replays the halves from CUDA graphs, the experts in between).

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> routing weights [T, k] float32, expert ids [T, k]."""
        weights, ids = route_softmax(self.gate(x), self.top_k, self.normalize)
        if self.round_weights:
            weights = weights.to(x.dtype).float()
        return weights, ids

    def combine(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The block's output from its input x [T, H] and the routed experts' sum [T, H]."""
        if self.shared_expert is None:
            return routed
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
