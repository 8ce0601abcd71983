"""The DeepSeek-V3 / R1 part of `ModelConfig`: latent-attention dimensions and grouped routing.

Read from transformers' `DeepseekV3Config`, checked here so a malformed checkpoint fails at load
time with a message rather than deep inside a forward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.model.config import ModelError


@dataclass(frozen=True)
class MlaDims:
    """Multi-head latent attention: per-head query/key split, latent ranks, softmax scale."""

    q_lora_rank: int | None  # None: queries come from one full projection (`q_proj`)
    kv_lora_rank: int  # width of the compressed latent the KV cache stores
    qk_nope_head_dim: int  # per-head key part without position, expanded from the latent
    qk_rope_head_dim: int  # key part with position, one head shared by all query heads
    v_head_dim: int
    rope_interleave: bool  # the checkpoint's rope dims come in (even, odd) pairs
    softmax_scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What one token stores per layer: the normalised latent, then the roped key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def deepseek_fields(hf, num_layers: int) -> dict:
    """The ModelConfig fields that differ from the defaults for a `DeepseekV3ForCausalLM` checkpoint."""
    experts, top_k = hf.n_routed_experts, hf.num_experts_per_tok
    groups, topk_group = hf.n_group or 1, hf.topk_group or 1
    _check_routing(experts, groups, topk_group, top_k)
    dense = hf.first_k_dense_replace or 0
    if not 0 <= dense <= num_layers:
        raise ModelError(f"first_k_dense_replace {dense} must lie in [0, num_hidden_layers={num_layers}]")
    return dict(
        num_experts=experts,
        top_k=top_k,
        moe_intermediate_size=hf.moe_intermediate_size,
        norm_topk_prob=bool(hf.norm_topk_prob),
        shared_expert_intermediate_size=hf.moe_intermediate_size * (hf.n_shared_experts or 0),
        moe_layers=tuple(range(dense, num_layers)),
        mla=mla_dims(hf),
        n_group=groups,
        topk_group=topk_group,
        routed_scaling_factor=float(hf.routed_scaling_factor),
        mtp_layers=getattr(hf, "num_mtp_layers", 0) or 0,
    )


def _check_routing(experts: int, groups: int, topk_group: int, top_k: int) -> None:
    if experts < 1 or groups < 1 or experts % groups:
        raise ModelError(f"n_routed_experts {experts} must be a positive multiple of n_group {groups}")
    per_group = experts // groups
    if per_group < 2:
        # Groups are ranked by the sum of their two best experts.
        raise ModelError(f"each expert group needs at least 2 experts, got {per_group} ({experts} / {groups})")
    if not 1 <= topk_group <= groups:
        raise ModelError(f"topk_group {topk_group} must lie in [1, n_group={groups}]")
    if not 1 <= top_k <= topk_group * per_group:
        raise ModelError(f"num_experts_per_tok {top_k} must lie in [1, {topk_group * per_group}]: "
                         f"the experts of the {topk_group} selected group(s)")


def mla_dims(hf) -> MlaDims:
    dims = dict(kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
                qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim)
    for name, value in dims.items():
        if not value or value < 1:
            raise ModelError(f"{name} must be a positive integer, got {value!r}")
    q_lora_rank = hf.q_lora_rank
    if q_lora_rank is not None and q_lora_rank < 1:
        raise ModelError(f"q_lora_rank must be a positive integer or null, got {q_lora_rank!r}")
    qk_head_dim = dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]
    return MlaDims(q_lora_rank=q_lora_rank, **dims, rope_interleave=bool(getattr(hf, "rope_interleave", True)),
                   softmax_scale=softmax_scale(qk_head_dim, getattr(hf, "rope_parameters", None) or {}))


def softmax_scale(qk_head_dim: int, rope_parameters: dict) -> float:
    """1/sqrt(d), times YaRN's mscale squared when the config asks for `mscale_all_dim`.

    YaRN scales the rotary cos/sin by mscale/mscale_all_dim; DeepSeek folds the remaining factor
    into the softmax scale, so long-context checkpoints keep their attention temperature.
    """
    scale = qk_head_dim**-0.5
    if rope_parameters.get("rope_type", "default") != "default":
        mscale_all_dim = rope_parameters.get("mscale_all_dim", 0)
        factor = rope_parameters.get("factor", 1.0)
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale
