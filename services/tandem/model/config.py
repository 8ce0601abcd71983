"""Model configuration read from a Hugging Face `config.json`.

Parsing goes through transformers' own config classes, so legacy fields (`rope_theta`,
`rope_scaling`) and new ones (`rope_parameters`) are normalised exactly as transformers does.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.model.deepseek_config import MlaDims
    from tandem.model.fp8 import Fp8Scheme

# Each architecture served, and the model_type of its transformers config.
SUPPORTED_ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# RoPE variants whose frequencies do not depend on the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# transformers' names (ACT2FN) for SiLU, the one gate activation the MLP and expert kernels compute.
SILU_ACTIVATIONS = ("silu", "swish")


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
    attention_bias: bool  # q/k/v (DeepSeek-V3: its two down projections)
    o_proj_bias: bool
    mlp_bias: bool  # the dense MLP's three projections (Llama's mlp_bias)
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
    # FP8 checkpoints: how their weights are scaled (tandem.model.fp8); None when unquantized
    fp8: Fp8Scheme | None = None
    # DeepSeek-V3: multi-token-prediction layers stored after the last decoder layer, never run
    mtp_layers: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers


def load_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not model_dir.exists():
        raise ModelError(f"model directory {str(model_dir)!r} does not exist")
    if not model_dir.is_dir():
        raise ModelError(f"model path {str(model_dir)!r} is not a directory: give the checkpoint directory, "
                         "the one that holds config.json")
    if not path.is_file():
        raise ModelError(f"{model_dir} has no config.json: not a Hugging Face checkpoint directory")
    arch = _architecture(read_json(path), path)
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as exc:  # a field of the wrong type or value
        raise ModelError(f"{path}: transformers cannot read it: {' '.join(str(exc).split())}") from None
    if hf.model_type != SUPPORTED_ARCHITECTURES[arch]:
        raise ModelError(f"{path}: model_type {hf.model_type!r} is not {arch}'s {SUPPORTED_ARCHITECTURES[arch]!r}")
    cfg = from_hf_config(arch, hf)
    generation_eos = _generation_eos(model_dir / "generation_config.json")
    if generation_eos:  # config.json's first, then any generation_config.json adds
        cfg = dataclasses.replace(cfg, eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + generation_eos)))
    return cfg


def _generation_eos(path: Path) -> tuple[int, ...]:
    """The eos_token_id of generation_config.json, which transformers' generate and vLLM stop on too:
    chat models list more end tokens there than config.json (Qwen3's holds both <|im_end|> and
    <|endoftext|>). () without the file or the field."""
    if not path.is_file():
        return ()
    eos = read_json(path).get("eos_token_id")
    ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(ids)


def read_json(path: Path) -> dict:
    """The JSON object in `path`; ModelError naming the file when it holds anything else."""
    try:
        value = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ModelError(f"{path} must hold a JSON object, not a {type(value).__name__}")
    return value


def _architecture(raw: dict, path: Path) -> str:
    architectures = raw.get("architectures")
    if architectures is None:
        raise ModelError(f"{path} has no \"architectures\" list, so the model class is unknown; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if not isinstance(architectures, list) or not architectures:
        raise ModelError(f"\"architectures\" in {path} must be a non-empty list such as [\"MixtralForCausalLM\"], "
                         f"got {architectures!r}")
    arch = architectures[0]
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"unsupported architecture {arch!r} in {path}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def from_hf_config(arch: str, hf) -> ModelConfig:
    rope_type = (getattr(hf, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ModelError(f"rope type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}")
    act = getattr(hf, "hidden_act", "silu")
    if act not in SILU_ACTIVATIONS:
        raise ModelError(f"hidden_act {act!r} is not supported: the MLPs and experts compute SiLU-gated units "
                         f"({', '.join(repr(a) for a in SILU_ACTIVATIONS)})")
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
        **_biases(arch, hf),
        qk_norm=hf.model_type == "qwen3_moe",
        sliding_window=_sliding_window(arch, hf),
        hf_config=hf,
        fp8=_fp8_scheme(hf),
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
    if moe["num_experts"] and not 1 <= moe["top_k"] <= moe["num_experts"]:
        raise ModelError(f"num_experts_per_tok {moe['top_k']} must lie in [1, {moe['num_experts']}], "
                         "the number of experts")
    return ModelConfig(**common, **moe)


def _fp8_scheme(hf) -> Fp8Scheme | None:
    from tandem.model.fp8 import fp8_scheme

    return fp8_scheme(getattr(hf, "quantization_config", None))


def _qwen_is_sparse(hf, layer: int) -> bool:
    mlp_only = getattr(hf, "mlp_only_layers", None) or []
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    return layer not in mlp_only and hf.num_experts > 0 and (layer + 1) % step == 0


def _biases(arch: str, hf) -> dict:
    """Which projections carry a bias, as each architecture's transformers model builds them."""
    if arch == "MixtralForCausalLM":
        return dict(attention_bias=False, o_proj_bias=False, mlp_bias=False)
    if arch == "Qwen2MoeForCausalLM":  # Q/K/V only
        return dict(attention_bias=bool(hf.qkv_bias), o_proj_bias=False, mlp_bias=False)
    attention = bool(getattr(hf, "attention_bias", False))  # Llama, Qwen3-MoE, DeepSeek-V3: O's too
    return dict(attention_bias=attention, o_proj_bias=attention,
                mlp_bias=arch == "LlamaForCausalLM" and bool(getattr(hf, "mlp_bias", False)))


def _sliding_window(arch: str, hf) -> int | None:
    """The attention window of every layer, as transformers applies it (None: every key)."""
    if arch in ("LlamaForCausalLM", "DeepseekV3ForCausalLM"):
        return None  # their transformers models never slide, whatever the config holds
    window = getattr(hf, "sliding_window", None) or None
    if arch != "Qwen2MoeForCausalLM":
        return window  # Mixtral, Qwen3-MoE: every layer (Qwen3-MoE's config clears it without use_sliding_window)
    sliding = [i for i, kind in enumerate(hf.layer_types) if kind == "sliding_attention"]
    if not sliding:
        return None
    if len(sliding) < len(hf.layer_types):
        raise ModelError(f"layer_types: layers {sliding} slide a window and the others attend to every key; "
                         "only one window for every layer is supported")
    if window is None:
        raise ModelError("layer_types asks for sliding_attention, but the config has no sliding_window "
                         "(or use_sliding_window is false)")
    return window
