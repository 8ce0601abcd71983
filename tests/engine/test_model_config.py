"""config.json read as transformers' model reads it: which projections carry biases, which layers
slide a window, the activation; what Tandem cannot compute is a ModelError, not another model."""

from __future__ import annotations

import pytest

from tandem.demo import demo_config
from tandem.model.config import ModelError, from_hf_config

CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "llama": "LlamaForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def config(arch: str, **overrides):
    return from_hf_config(CLASSES[arch], demo_config(arch, 300, **overrides))


@pytest.mark.parametrize("arch", sorted(CLASSES))
@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_an_activation_other_than_silu_is_refused_for_every_architecture(arch, act):
    with pytest.raises(ModelError, match=f"hidden_act '{act}' is not supported"):
        config(arch, hidden_act=act)
    assert config(arch, hidden_act="swish").architecture == CLASSES[arch]  # transformers' other name for SiLU


@pytest.mark.parametrize("arch, overrides, biases", [
    # (q/k/v, o, dense MLP), as each architecture's transformers model builds its Linear layers
    ("llama", dict(attention_bias=True), (True, True, False)),
    ("llama", dict(mlp_bias=True), (False, False, True)),
    ("qwen3_moe", dict(attention_bias=True), (True, True, False)),
    ("qwen2_moe", dict(qkv_bias=True, attention_bias=True), (True, False, False)),
    ("qwen2_moe", dict(qkv_bias=False), (False, False, False)),
    ("mixtral", dict(attention_bias=True, mlp_bias=True), (False, False, False)),
    ("deepseek_v3", dict(attention_bias=True, mlp_bias=True), (True, True, False)),
])
def test_biases_are_where_transformers_puts_them(arch, overrides, biases):
    cfg = config(arch, **overrides)
    assert (cfg.attention_bias, cfg.o_proj_bias, cfg.mlp_bias) == biases


@pytest.mark.parametrize("arch, overrides, window", [
    ("mixtral", dict(sliding_window=8), 8),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8), 8),
    ("qwen3_moe", dict(use_sliding_window=False, sliding_window=None), None),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"] * 2), 8),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=8, layer_types=["full_attention"] * 2), None),
    ("llama", dict(sliding_window=8), None),
    ("deepseek_v3", dict(sliding_window=8), None),
])
def test_the_window_is_the_one_transformers_slides(arch, overrides, window):
    assert config(arch, **overrides).sliding_window == window


def test_a_window_on_some_layers_only_is_refused():
    # Qwen2-MoE's default layer_types with use_sliding_window slide every other layer.
    with pytest.raises(ModelError, match=r"layers \[0\] slide a window"):
        config("qwen2_moe", use_sliding_window=True, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ModelError, match="no sliding_window"):
        config("qwen2_moe", sliding_window=0, layer_types=["sliding_attention"] * 2)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("top_k", [0, 9])
def test_experts_per_token_lie_between_one_and_the_experts(arch, top_k):
    with pytest.raises(ModelError, match=rf"num_experts_per_tok {top_k} must lie in \[1, 8\]"):
        config(arch, num_experts_per_tok=top_k)


@pytest.mark.parametrize("generation_eos, want", [
    ([7, 2], (2, 7)),  # config.json's first, each id once
    (9, (2, 9)),
    (None, (2,)),
])
def test_generation_config_adds_its_eos_tokens_as_transformers_generate_stops_on_them(tmp_path, generation_eos, want):
    import json

    from transformers import GenerationConfig

    from tandem.model.config import load_config

    demo_config("mixtral", 300, eos_token_id=2, architectures=["MixtralForCausalLM"]).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    cfg = load_config(tmp_path)
    assert cfg.eos_token_ids == want
    reference = GenerationConfig.from_pretrained(tmp_path).eos_token_id  # what generate() stops on
    reference = [] if reference is None else reference if isinstance(reference, list) else [reference]
    assert set(reference) <= set(cfg.eos_token_ids)


def test_a_bad_generation_config_eos_is_refused_naming_the_file(tmp_path):
    import json

    from tandem.model.config import load_config

    demo_config("mixtral", 300, eos_token_id=2, architectures=["MixtralForCausalLM"]).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ModelError, match="generation_config.json: eos_token_id must be a token id"):
        load_config(tmp_path)
