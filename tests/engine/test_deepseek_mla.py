"""Multi-head latent attention over the paged latent cache: both forms, both tiers, the cache size."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tandem.kv.attention import AttentionMetadata, write_kv
from tandem.kv.cache import CPU, DEVICE, KVCache, KVLayout
from tandem.model.config import load_config
from tandem.model.deepseek_attention import LATENT, MlaAttention, apply_rope_interleaved
from tandem.model.deepseek_config import MlaDims
from tandem.model.deepseek_mla import absorbed_decode, expanded_attention, paged_latent_attention

DIMS = MlaDims(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
               rope_interleave=True, softmax_scale=24**-0.5)
HEADS, BLOCK = 4, 4


def random_batch(seed: int, starts: list[int], lens: list[int], tables: list[list[int]], num_blocks: int = 16,
                 heads: int = HEADS):
    """A cache whose blocks hold random latents, and queries for `lens` new tokens per sequence."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(num_blocks, BLOCK, DIMS.latent_dim)
    for start, n, table in zip(starts, lens, tables):
        ctx = AttentionMetadata.build([0], [start + n], [table], BLOCK, torch.device("cpu"))
        write_kv(cache, ctx.slot_mapping, torch.randn(start + n, DIMS.latent_dim, generator=g))
    meta = AttentionMetadata.build(starts, lens, tables, BLOCK, torch.device("cpu"))
    t = sum(lens)
    q_nope = torch.randn(t, heads, DIMS.qk_nope_head_dim, generator=g)
    q_pe = torch.randn(t, heads, DIMS.qk_rope_head_dim, generator=g)
    kv_b = torch.randn(heads * (DIMS.qk_nope_head_dim + DIMS.v_head_dim), DIMS.kv_lora_rank, generator=g) * 0.2
    return q_nope, q_pe, cache, meta, kv_b


@pytest.mark.parametrize("heads", [HEADS, 32])  # 32 on one latent: the native kernel's tiles of 4 heads, 8 times
def test_absorbed_form_equals_expanded_form(heads):
    # Three sequences decoding, with blocks scattered over the cache.
    q_nope, q_pe, cache, meta, kv_b = random_batch(0, [4, 10, 8], [1, 1, 1], [[3, 1], [0, 5, 9], [12, 2, 4]],
                                                   heads=heads)
    absorbed = absorbed_decode(q_nope, q_pe, cache, meta, kv_b, DIMS)
    expanded = expanded_attention(q_nope, q_pe, cache, meta, kv_b, DIMS)
    assert absorbed.shape == (3, heads, DIMS.v_head_dim)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)
    assert absorbed.abs().max() > 0.1  # not trivially zero


def test_mixed_step_routes_decodes_and_prefills_to_the_same_result():
    # Sequence 0 and 2 decode one token each, sequence 1 prefills a chunk of 4.
    q_nope, q_pe, cache, meta, kv_b = random_batch(1, [9, 2, 5], [1, 4, 1], [[3, 1, 7], [0, 5], [12, 2]])
    mixed = paged_latent_attention(q_nope, q_pe, cache, meta, kv_b, DIMS)
    torch.testing.assert_close(mixed, expanded_attention(q_nope, q_pe, cache, meta, kv_b, DIMS),
                               rtol=1e-5, atol=1e-5)
    # Each sequence alone gives its own rows: nothing leaks between sequences.
    offsets = [0, 1, 5, 6]
    for i, (start, n, table) in enumerate([(9, 1, [3, 1, 7]), (2, 4, [0, 5]), (5, 1, [12, 2])]):
        alone = AttentionMetadata.build([start], [n], [table], BLOCK, torch.device("cpu"))
        rows = slice(offsets[i], offsets[i + 1])
        out = paged_latent_attention(q_nope[rows], q_pe[rows], cache, alone, kv_b, DIMS)
        torch.testing.assert_close(out, mixed[rows], rtol=1e-5, atol=1e-5)


def test_slots_past_a_sequence_end_stay_out_of_both_forms():
    """Unwritten slots hold what earlier requests left there, a NaN among them: no form may read them."""
    starts, lens, tables = [5, 2, 7], [1, 3, 1], [[3, 1], [0, 5], [12, 2]]
    q_nope, q_pe, cache, meta, kv_b = random_batch(3, starts, lens, tables)
    whole = AttentionMetadata.build([0] * 3, [s + n for s, n in zip(starts, lens)], tables, BLOCK, torch.device("cpu"))
    dirty = torch.full_like(cache, float("nan")).view(-1, DIMS.latent_dim)  # [slots, latent]
    dirty[whole.slot_mapping] = cache.view(-1, DIMS.latent_dim)[whole.slot_mapping]
    dirty = dirty.view_as(cache)
    for form in (expanded_attention, paged_latent_attention):
        clean = form(q_nope, q_pe, cache, meta, kv_b, DIMS)
        torch.testing.assert_close(form(q_nope, q_pe, dirty, meta, kv_b, DIMS), clean, rtol=0, atol=0)


def test_attention_reads_cpu_tier_blocks_after_swap():
    layout = KVLayout(((LATENT, (DIMS.latent_dim,)),), num_layers=2, dtype=torch.float32)
    cache = KVCache(layout, BLOCK, num_device_blocks=8, num_cpu_blocks=8, device="cpu")
    q_nope, q_pe, latents, meta, kv_b = random_batch(2, [10], [1], [[1, 3, 5]], num_blocks=8)
    cache.tiers[DEVICE][LATENT][1].copy_(latents)
    on_device = paged_latent_attention(q_nope, q_pe, cache.layer(1, DEVICE)[LATENT], meta, kv_b, DIMS)
    cache.swap([(1, 6), (3, 0), (5, 2)], DEVICE, CPU)
    cache.tiers[DEVICE][LATENT].zero_()  # the device copy is gone: only the CPU tier has the context
    moved = AttentionMetadata.build([10], [1], [[6, 0, 2]], BLOCK, torch.device("cpu"))
    on_cpu = paged_latent_attention(q_nope, q_pe, cache.layer(1, CPU)[LATENT], moved, kv_b, DIMS)
    torch.testing.assert_close(on_cpu, on_device)


def test_interleaved_rope_matches_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(5, HEADS, 8, generator=g), torch.randn(5, 1, 8, generator=g)
    freqs = torch.randn(5, 4, generator=g)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    ref_q, ref_k = apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None],
                                                   sin[None])  # [1, heads, T, D]
    torch.testing.assert_close(apply_rope_interleaved(q, cos, sin), ref_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rope_interleaved(k, cos, sin), ref_k[0].transpose(0, 1))


# DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3, also DeepSeek-R1's), verbatim.
PUBLISHED_CONFIG = json.loads("""
{
 "architectures": [
  "DeepseekV3ForCausalLM"
 ],
 "attention_bias": false,
 "attention_dropout": 0.0,
 "auto_map": {
  "AutoConfig": "configuration_deepseek.DeepseekV3Config",
  "AutoModel": "modeling_deepseek.DeepseekV3Model",
  "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"
 },
 "aux_loss_alpha": 0.001,
 "bos_token_id": 0,
 "eos_token_id": 1,
 "ep_size": 1,
 "first_k_dense_replace": 3,
 "hidden_act": "silu",
 "hidden_size": 7168,
 "initializer_range": 0.02,
 "intermediate_size": 18432,
 "kv_lora_rank": 512,
 "max_position_embeddings": 163840,
 "model_type": "deepseek_v3",
 "moe_intermediate_size": 2048,
 "moe_layer_freq": 1,
 "n_group": 8,
 "n_routed_experts": 256,
 "n_shared_experts": 1,
 "norm_topk_prob": true,
 "num_attention_heads": 128,
 "num_experts_per_tok": 8,
 "num_hidden_layers": 61,
 "num_key_value_heads": 128,
 "num_nextn_predict_layers": 1,
 "pretraining_tp": 1,
 "q_lora_rank": 1536,
 "qk_nope_head_dim": 128,
 "qk_rope_head_dim": 64,
 "quantization_config": {
  "activation_scheme": "dynamic",
  "fmt": "e4m3",
  "quant_method": "fp8",
  "weight_block_size": [
   128,
   128
  ]
 },
 "rms_norm_eps": 1e-06,
 "rope_scaling": {
  "beta_fast": 32,
  "beta_slow": 1,
  "factor": 40,
  "mscale": 1.0,
  "mscale_all_dim": 1.0,
  "original_max_position_embeddings": 4096,
  "type": "yarn"
 },
 "rope_theta": 10000,
 "routed_scaling_factor": 2.5,
 "scoring_func": "sigmoid",
 "seq_aux": true,
 "tie_word_embeddings": false,
 "topk_group": 4,
 "topk_method": "noaux_tc",
 "torch_dtype": "bfloat16",
 "transformers_version": "4.46.3",
 "use_cache": true,
 "v_head_dim": 128,
 "vocab_size": 129280
}
""")


@pytest.fixture
def published(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_CONFIG))
    return load_config(tmp_path)


def test_published_config_is_read(published):
    cfg = published
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.fp8.block == (128, 128)
    assert cfg.moe_layers == tuple(range(3, 61)) and (cfg.num_experts, cfg.top_k) == (256, 8)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == (8, 4, 2.5)
    assert cfg.mla.q_lora_rank == 1536 and cfg.mla.rope_interleave
    mscale = 0.1 * math.log(40) + 1.0  # YaRN factor 40, mscale_all_dim 1
    assert cfg.mla.softmax_scale == pytest.approx(192**-0.5 * mscale**2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_latent_cache_bytes_per_token_for_real_deepseek_v3(published, dtype):
    cfg = published
    assert (cfg.num_layers, cfg.num_heads, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim) == (61, 128, 512, 64)
    elem = torch.empty((), dtype=dtype).element_size()
    latent = KVLayout(MlaAttention.kv_entries(cfg), cfg.num_layers, dtype).bytes_per_token()
    full = KVLayout((("k", (cfg.num_heads, cfg.mla.qk_head_dim)), ("v", (cfg.num_heads, cfg.mla.v_head_dim))),
                    cfg.num_layers, dtype).bytes_per_token()
    assert latent == 61 * (512 + 64) * elem  # 70,272 bytes in bf16
    assert full == 61 * 128 * ((128 + 64) + 128) * elem  # 4,997,120 bytes in bf16
    assert full / latent > 71
