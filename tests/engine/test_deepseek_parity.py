"""DeepSeek-V3 numerics equal transformers' `DeepseekV3ForCausalLM` on random-weight checkpoints.

The demo config has everything at once: a query LoRA, 2 expert groups of which 1 is eligible, a
dense first layer, a shared expert, YaRN rope (its mscale in the softmax scale) and a nonzero
selection bias. A second config drops the query LoRA, uses 4 groups with 2 eligible, 2 dense
layers and non-interleaved rope.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_parity import assert_bfloat16_tracks, assert_float32_matches, prompt_for, tandem_greedy
from tier_probe import count_tier_traffic

from tandem.cli import main
from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.sampling_params import SamplingParams

CONFIGS = {
    "q_lora": dict(initializer_range=0.2),
    "no_q_lora": dict(initializer_range=0.2, q_lora_rank=None, n_group=4, topk_group=2, first_k_dense_replace=2,
                      num_hidden_layers=4, rope_interleave=False),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_and_logits_match_transformers(name, demo_model_dir):
    engine = assert_float32_matches(demo_model_dir("deepseek_v3", **CONFIGS[name]), name)
    # The cache holds the latent, not per-head K and V.
    assert list(engine.cache.tiers["device"]) == ["latent"]


def test_batch_of_different_lengths_equals_each_alone(demo_model_dir):
    # Block size 4 and a 24-token budget put prefill chunks (expanded attention) and decodes
    # (absorbed attention) in the same steps.
    model_dir = demo_model_dir("deepseek_v3", initializer_range=0.2)
    prompts = [prompt_for(s, n) for s, n in [(3, 5), (4, 23), (5, 1), (6, 40)]]
    config = EngineConfig(block_size=4, max_num_batched_tokens=24)
    batched, batched_logits, _ = tandem_greedy(model_dir, prompts, 32, config=config)
    for prompt, tokens, logits in zip(prompts, batched, batched_logits):
        [alone], [alone_logits], _ = tandem_greedy(model_dir, [prompt], 32)
        assert tokens == alone
        assert (logits - alone_logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("cpu_decode", [False, True], ids=["swap", "cpu-decode"])
def test_sequences_moved_to_the_cpu_tier_lose_nothing(demo_model_dir, cpu_decode):
    # swap: latent blocks go to the CPU tier and back. cpu-decode: they stay there and the
    # sequence decodes with absorbed attention over the CPU tier.
    model_dir = demo_model_dir("deepseek_v3", initializer_range=0.2)
    prompts = [prompt_for(s, n) for s, n in [(7, 10), (8, 15), (9, 8)]]
    # 12 device blocks of 4 tokens hold one sequence at full length (15 + 32), not three.
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", dtype="float32", config=EngineConfig(
        block_size=4, num_device_blocks=12, num_cpu_blocks=64, max_model_len=48, enable_prefix_caching=False,
        max_num_batched_tokens=16, cpu_decode=cpu_decode))
    swaps, cpu_tokens = count_tier_traffic(engine)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, params)
    if cpu_decode:
        assert swaps["out"] > 0 and swaps["in"] == 0 and cpu_tokens[0] > 0, (swaps, cpu_tokens)
    else:
        assert swaps["out"] > 0 and swaps["in"] > 0 and cpu_tokens[0] == 0, (swaps, cpu_tokens)
    for prompt, result in zip(prompts, results):
        [alone], _, _ = tandem_greedy(model_dir, [prompt], 32)
        assert result.token_ids == alone
    assert engine.stats().kv_blocks_used == {"device": 0, "cpu": 0}


def test_bfloat16_tracks_transformers(demo_model_dir):
    # As for the other architectures: logits within a few bf16 ulps (0.03 at |logit| ~6), tokens
    # equal until the reference meets a near-tie (top-2 margin within that tolerance).
    assert_bfloat16_tracks(demo_model_dir("deepseek_v3", initializer_range=0.2), tol=0.15)


def test_cli_makes_and_serves_a_deepseek_demo(tmp_path, capsys):
    out = tmp_path / "ds"
    assert main(["make-demo-model", str(out), "--arch", "deepseek_v3"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["q_lora_rank"] == 32
    assert config["rope_parameters"]["rope_type"] == "yarn"
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--prompt-ids", "5,6,7", "--max-tokens", "6", "--device", "cpu",
                 "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 6
