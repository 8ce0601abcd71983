"""Write the comparison checkpoint: a random-weight Mixtral of ~1.8 GB of float32 weights.

hidden 1024, 8 experts, top-2, 6 layers, expert intermediate 2816, vocab 8000: 0.52 GB of
weights are active per token (2 experts x 6 layers, attention, LM head). Hugging Face format
(safetensors, legacy Mixtral tensor names, which transformers, Tandem and llama.cpp's
converter all read) plus a SentencePiece `tokenizer.model` trained here on a small built-in
text, because llama.cpp's converter needs a tokenizer it recognizes. Nothing is downloaded.

    python benchmarks/make_checkpoint.py OUT_DIR [--layers 6] [--hidden 1024] [--arch mixtral|qwen2_moe] ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_TEXT = """
The expert said that the model was too big for the memory of the GPU, so the experts went to the CPU.
Mixture of experts models route every token to a few experts chosen by a router.
Attention runs on the GPU; the routed experts run on the cores of one socket.
Decode reads every active weight once per step, so memory bandwidth sets the speed limit.
Quantized weights are smaller, so the same bandwidth moves more of them each second.
A paged key value cache grows in blocks; prefix caching shares blocks between requests.
Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.
Readability counts. Errors should never pass silently, unless explicitly silenced.
"""


def train_sentencepiece(out: Path, vocab_size: int) -> None:
    import sentencepiece as spm

    corpus = out / "tokenizer_corpus.txt"
    lines = [ln.strip() for ln in _TEXT.strip().splitlines()]
    # Vary the text a little so BPE sees enough pairs for a few hundred merges.
    corpus.write_text("\n".join(f"{ln} {i}" for i in range(50) for ln in lines) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(out / "tokenizer"), vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, hard_vocab_limit=False, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        minloglevel=2,
    )
    corpus.unlink()
    (out / "tokenizer.vocab").unlink(missing_ok=True)


def make_checkpoint(out_dir: str | Path, *, layers: int = 6, hidden: int = 1024, intermediate: int = 2816,
                    experts: int = 8, top_k: int = 2, vocab: int = 8000, heads: int = 16, kv_heads: int = 8,
                    seed: int = 0, arch: str = "mixtral") -> Path:
    """arch "mixtral", or "qwen2_moe": the same shapes plus a sigmoid-gated shared expert of the
    experts' width in every layer, and Q/K/V biases."""
    import torch
    import transformers as tf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shape = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, num_experts_per_tok=top_k, max_position_embeddings=4096,
                 bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rope_theta=1e6)
    if arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**shape, intermediate_size=intermediate, moe_intermediate_size=intermediate,
                                shared_expert_intermediate_size=intermediate, num_experts=experts,
                                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False, qkv_bias=True)
        model_cls = tf.Qwen2MoeForCausalLM
    else:
        cfg = tf.MixtralConfig(**shape, intermediate_size=intermediate, num_local_experts=experts)
        model_cls = tf.MixtralForCausalLM
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    with torch.no_grad():  # a wider router spreads tokens over all experts, as a trained one does
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0 / hidden**0.5)
    model.save_pretrained(out)
    train_sentencepiece(out, vocab_size=min(vocab, 500))
    (out / "tandem_checkpoint.json").write_text(json.dumps({"made_by": "benchmarks/make_checkpoint.py",
                                                            "seed": seed}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--arch", choices=["mixtral", "qwen2_moe"], default="mixtral")
    args = ap.parse_args()
    path = make_checkpoint(args.out_dir, layers=args.layers, hidden=args.hidden, intermediate=args.intermediate,
                           vocab=args.vocab, arch=args.arch)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"wrote {path} ({size / 1e9:.2f} GB of safetensors)")


if __name__ == "__main__":
    main()
