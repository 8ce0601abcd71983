"""Small random-weight checkpoints in Hugging Face format, made with transformers' own classes.

Everything runs with no download: the tokenizer is a byte-level BPE trained here on a few
sentences, and the weights are transformers' random initialisation under a fixed seed.
"""

from __future__ import annotations

from pathlib import Path

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "llama", "deepseek_v3")

_CORPUS = """\
The expert said that the model was too big for the memory of the GPU, so the experts went to the CPU.
Mixture of experts models route every token to a few experts chosen by a router.
Attention runs on the GPU; the routed experts run on the cores of one socket.
A paged key value cache keeps blocks of tokens; blocks move between the device and the host.
Hello world. The quick brown fox jumps over the lazy dog. Tandem serves large models on small machines.
Once upon a time there was a scheduler that batched requests continuously, step after step.
"""

# Shapes shared by the demo checkpoints: tiny, so tests and the demo run in seconds on a laptop.
_BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=4096, rms_norm_eps=1e-5)


def demo_config(arch: str, vocab_size: int, **overrides):
    """The transformers config of a demo checkpoint of `arch`."""
    import transformers as tf

    base = dict(_BASE, vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if arch == "mixtral":
        cfg = tf.MixtralConfig(**base, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
                               rope_theta=1e6)
    elif arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**base, intermediate_size=128, moe_intermediate_size=64,
                                shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
                                qkv_bias=True, rope_theta=1e6)
    elif arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**base, head_dim=16, intermediate_size=128, moe_intermediate_size=64,
                                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, rope_theta=1e6)
    elif arch == "llama":
        base.update(tie_word_embeddings=True, max_position_embeddings=131072)
        cfg = tf.LlamaConfig(**base, intermediate_size=128, rope_theta=500000.0,
                             rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=8192))
    elif arch == "deepseek_v3":
        # Every DeepSeek-V3 feature at toy size: latent attention with a query LoRA, 2 expert groups
        # of which 1 is eligible, a dense first layer, a shared expert and YaRN rope scaling.
        base.update(num_hidden_layers=3, num_key_value_heads=4)  # MLA: one latent, no KV head groups
        cfg = tf.DeepseekV3Config(**base, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                                  n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                                  first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=32,
                                  kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                  rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024,
                                                    beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
                                  rope_theta=10000.0)
    else:
        raise ValueError(f"unknown demo architecture {arch!r}; choose from {', '.join(ARCHS)}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def _randomize_biases(model) -> None:
    # transformers initialises biases to zero, DeepSeek's selection bias included; trained checkpoints
    # have ones that change the outputs (and which experts win), so the demo has them too, and a
    # bias the loader dropped shows (seeded by the caller's manual_seed).
    import torch

    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape) * 0.1)
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape) * model.config.initializer_range)


def train_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on the built-in corpus (any text encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    return tok


def make_demo_model(out_dir: str | Path, arch: str = "mixtral", seed: int = 0, dtype: str = "float32",
                    **overrides) -> Path:
    """Write a random-weight checkpoint with a working tokenizer.json to `out_dir`."""
    import torch
    import transformers as tf

    if arch not in ARCHS:
        raise ValueError(f"unknown demo architecture {arch!r}; choose from {', '.join(ARCHS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    cfg = demo_config(arch, tok.get_vocab_size(), **overrides)
    torch.manual_seed(seed)
    model_cls = {"mixtral": tf.MixtralForCausalLM, "qwen2_moe": tf.Qwen2MoeForCausalLM,
                 "qwen3_moe": tf.Qwen3MoeForCausalLM, "llama": tf.LlamaForCausalLM,
                 "deepseek_v3": tf.DeepseekV3ForCausalLM}[arch]
    model = model_cls(cfg).to(getattr(torch, dtype))
    _randomize_biases(model)
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    return out
