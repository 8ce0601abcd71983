"""Model configuration read from a Hugging Face `config.json`.

Parsing goes through transformers' own config classes, so legacy fields (`rope_theta`,
`rope_scaling`) and new ones (`rope_parameters`) are normalised exactly as transformers does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.model.deepseek_config import MlaDims

SUPPORTED_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "LlamaForCausalLM",
    "DeepseekV3ForCausalLM",
)
# RoPE variants whose frequencies do not depend on the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ModelError(ValueError):
    """A checkpoint Tandem cannot serve, with a message saying why."""


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    # mixture of experts (num_experts 0 for dense models)
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # 0 when none
    moe_layers: tuple[int, ...]
    hf_config: object  # transformers PreTrainedConfig, for RoPE initialisation
    # DeepSeek-V3: latent attention and grouped sigmoid routing (the defaults mean neither)
    mla: MlaDims | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # block-scaled FP8 checkpoints: (rows, cols) of one weight_scale_inv block; None when unquantized
    fp8_block_size: tuple[int, int] | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers


def load_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise ModelError(f"model directory {str(model_dir)!r} does not exist")
    if not path.is_file():
        raise ModelError(f"{model_dir} has no config.json: not a Hugging Face checkpoint directory")
    raw = json.loads(path.read_text())
    architectures = raw.get("architectures") or []
    arch = architectures[0] if architectures else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"unsupported architecture {arch!r} in {path}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return from_hf_config(arch, hf)


def from_hf_config(arch: str, hf) -> ModelConfig:
    rope_type = (getattr(hf, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ModelError(f"rope type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}")
    num_layers = hf.num_hidden_layers
    num_heads = hf.num_attention_heads
    eos = hf.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    common = dict(
        architecture=arch,
        model_type=hf.model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
        intermediate_size=hf.intermediate_size,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        eos_token_ids=eos_ids,
        bos_token_id=getattr(hf, "bos_token_id", None),
        attention_bias=bool(getattr(hf, "attention_bias", False) or getattr(hf, "qkv_bias", False)),
        qk_norm=hf.model_type == "qwen3_moe",
        sliding_window=_sliding_window(hf),
        hf_config=hf,
        fp8_block_size=_fp8_block_size(hf),
    )
    if arch == "LlamaForCausalLM":
        moe = dict(num_experts=0, top_k=0, moe_intermediate_size=0, norm_topk_prob=False,
                   shared_expert_intermediate_size=0, moe_layers=())
    elif arch == "MixtralForCausalLM":
        moe = dict(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                   moe_intermediate_size=hf.intermediate_size, norm_topk_prob=True,
                   shared_expert_intermediate_size=0, moe_layers=tuple(range(num_layers)))
    elif arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        moe = dict(num_experts=hf.num_experts, top_k=hf.num_experts_per_tok,
                   moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
                   shared_expert_intermediate_size=getattr(hf, "shared_expert_intermediate_size", 0) or 0,
                   moe_layers=tuple(i for i in range(num_layers) if _qwen_is_sparse(hf, i)))
    elif arch == "DeepseekV3ForCausalLM":
        from tandem.model.deepseek_config import deepseek_fields

        moe = deepseek_fields(hf, num_layers)
    else:
        raise ModelError(f"architecture {arch!r} is recognised but not yet served by this build")
    if moe["num_experts"] and moe["top_k"] > moe["num_experts"]:
        raise ModelError(f"num_experts_per_tok {moe['top_k']} exceeds the number of experts {moe['num_experts']}")
    return ModelConfig(**common, **moe)


def _fp8_block_size(hf) -> tuple[int, int] | None:
    from tandem.model.fp8 import fp8_block_size

    return fp8_block_size(getattr(hf, "quantization_config", None))


def _qwen_is_sparse(hf, layer: int) -> bool:
    mlp_only = getattr(hf, "mlp_only_layers", None) or []
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    return layer not in mlp_only and hf.num_experts > 0 and (layer + 1) % step == 0


def _sliding_window(hf) -> int | None:
    if hf.model_type == "qwen2_moe" and not getattr(hf, "use_sliding_window", False):
        return None
    return getattr(hf, "sliding_window", None)
