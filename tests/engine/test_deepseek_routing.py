"""DeepSeek-V3 grouped sigmoid routing against transformers' router, and config checks."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from tandem.model.config import ModelError, from_hf_config
from tandem.model.deepseek_moe import GroupedRouter, route_grouped_sigmoid

ARCH = "DeepseekV3ForCausalLM"


def hf_config(**overrides):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, n_shared_experts=1,
                num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=None,
                kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    return transformers.DeepseekV3Config(**{**base, **overrides})


def sorted_by_id(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("groups,topk_group,norm", [(4, 2, True), (4, 1, False), (1, 1, True), (8, 3, True)])
def test_router_matches_transformers(groups, topk_group, norm):
    hf = hf_config(n_group=groups, topk_group=topk_group, norm_topk_prob=norm)
    torch.manual_seed(0)
    ref = DeepseekV3TopkRouter(hf)
    with torch.no_grad():
        ref.weight.normal_(0, 0.3)
        ref.e_score_correction_bias.normal_(0, 0.2)
    ours = GroupedRouter(from_hf_config(ARCH, hf))
    ours.load_state_dict({"weight": ref.weight, "e_score_correction_bias": ref.e_score_correction_bias})
    x = torch.randn(50, hf.hidden_size)
    _, ref_weights, ref_ids = ref(x)
    weights, ids = ours(x)
    ref_weights, ref_ids = sorted_by_id(ref_weights, ref_ids)
    weights, ids = sorted_by_id(weights, ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights)
    assert weights.dtype == torch.float32


def test_only_the_best_groups_are_eligible():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(200, 16, generator=g)
    _, ids = route_grouped_sigmoid(logits, torch.zeros(16), top_k=3, n_group=4, topk_group=1, normalize=True,
                                   scaling=1.0)
    groups = ids // 4  # [T, k]
    assert (groups == groups[:, :1]).all(), "top_k experts must come from the one selected group"
    # Without the group limit the best 3 experts span several groups for most tokens.
    _, free = logits.sigmoid().topk(3, dim=-1)
    assert ((free // 4) != (free // 4)[:, :1]).any(dim=1).float().mean() > 0.5


def test_bias_steers_selection_but_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 always wins selection
    weights, ids = route_grouped_sigmoid(logits, bias, top_k=2, n_group=1, topk_group=1, normalize=False,
                                         scaling=2.5)
    weights, ids = sorted_by_id(weights, ids)
    assert ids.tolist() == [[0, 3]]
    torch.testing.assert_close(weights, 2.5 * logits.sigmoid()[:, [0, 3]])


@pytest.mark.parametrize("overrides,message", [
    (dict(n_group=3), "multiple of n_group"),
    (dict(n_group=16, topk_group=2), "at least 2 experts"),
    (dict(topk_group=5), "topk_group"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(first_k_dense_replace=4), "first_k_dense_replace"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(kv_lora_rank=0), "kv_lora_rank"),
])
def test_bad_deepseek_configs_raise_clear_errors(overrides, message):
    with pytest.raises(ModelError, match=message):
        from_hf_config(ARCH, hf_config(**overrides))


def test_config_fields():
    cfg = from_hf_config(ARCH, hf_config(q_lora_rank=24, routed_scaling_factor=2.5))
    assert cfg.moe_layers == (1, 2) and cfg.num_experts == 16 and cfg.top_k == 4
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == (4, 2, 2.5)
    assert cfg.shared_expert_intermediate_size == 16
    assert cfg.mla.q_lora_rank == 24 and cfg.mla.latent_dim == 16 + 8
    assert cfg.mla.softmax_scale == pytest.approx(16**-0.5)
    assert cfg.fp8 is None


def test_yarn_mscale_enters_the_softmax_scale():
    yarn = dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
                mscale_all_dim=1.0, beta_fast=32, beta_slow=1, rope_theta=10000.0)
    cfg = from_hf_config(ARCH, hf_config(rope_parameters=yarn, max_position_embeddings=163840))
    mscale = 0.1 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert cfg.mla.softmax_scale == pytest.approx(16**-0.5 * mscale**2)
