"""The causal LM: embeddings, decoder layers, final norm and LM head, over flat token batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.experts import native
from tandem.experts.base import ExpertExecutor
from tandem.kv.attention import DecodeSteps
from tandem.kv.cache import KVCache
from tandem.kv.tiered import LayerKV, StepAttention
from tandem.model import native_decode
from tandem.model.attention import Attention
from tandem.model.config import ModelConfig
from tandem.model.deepseek_attention import MlaAttention
from tandem.model.deepseek_moe import DeepseekMoe
from tandem.model.layers import DenseMLP, RMSNorm, RotaryEmbedding
from tandem.model.moe import SparseMoe
from tandem.model.quant_linear import Int8Linear

# Per architecture: (attention class, sparse MoE block class); others use (Attention, SparseMoe).
_BLOCKS = {"DeepseekV3ForCausalLM": (MlaAttention, DeepseekMoe)}


def blocks_for(cfg: ModelConfig) -> tuple[type[nn.Module], type[nn.Module]]:
    """The attention and sparse-MoE classes an architecture's decoder layers are built from."""
    return _BLOCKS.get(cfg.architecture, (Attention, SparseMoe))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, executor: ExpertExecutor | None):
        super().__init__()
        attention, moe = blocks_for(cfg)
        self.self_attn = attention(cfg)
        if cfg.is_moe_layer(layer):
            self.mlp = moe(cfg, layer, executor)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos_sin, kv: LayerKV, step: StepAttention):
        x = self.attention_block(x, cos_sin, kv, step)  # [T, H]
        return x + self.mlp(self.post_attention_layernorm(x))  # [T, H]

    def attention_block(self, x, cos_sin, kv: LayerKV, step: StepAttention):
        """The layer's first residual block: x [T, H] -> x plus attention of its normed self."""
        return x + self.self_attn(self.input_layernorm(x), cos_sin, kv, step)


class CausalLM(nn.Module):
    """Parameter names follow the Hugging Face checkpoint (`model.layers.N...`, `lm_head`)."""

    def __init__(self, cfg: ModelConfig, executor: ExpertExecutor | None):
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, i, executor) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # CPU decode steps through native code (`tandem.model.native_decode`); False: torch only.
        self.native_decode = True
        self._native: tuple[tuple, native_decode.NativeDecode | None] | None = None  # (built from, path)

    def kv_entries(self):
        return blocks_for(self.cfg)[0].kv_entries(self.cfg)

    def kv_scales(self) -> tuple[tuple[float, ...], ...]:
        """Each layer's fp8 KV scales, in kv_entries' order: the checkpoint's calibrated ones, else 1.0."""
        return tuple(layer.self_attn.kv_scales() for layer in self.model.layers)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                step: StepAttention, max_position: int | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, H]: in the model's dtype, or float32 when
        the native decode path ran the step. `max_position`, the largest of the positions when the
        caller knows it, lets RoPE look its values up in a table.

        Tokens come device-tier sequences first, then CPU-tier ones (see `tandem.kv.tiered`)."""
        x = self.model.embed_tokens(input_ids)  # [T, H]
        if max_position is not None:
            self.rotary.reserve(max_position + 1, positions.device)
        fused = self._native_path() if self.native_decode else None
        if fused is not None and fused.serves(step, x.shape[0]):
            # float32 hidden states whatever the weights' dtype; the final norm included
            cos_sin = self.rotary.cos_sin(positions, torch.float32, max_position)
            return fused.forward(x.float(), cos_sin, cache, step)
        cos_sin = self.rotary.cos_sin(positions, x.dtype, max_position)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos_sin, LayerKV.of(cache, i), step)
        return self.model.norm(x)

    @torch.inference_mode()
    def greedy_steps(self, input_ids: torch.Tensor, steps: DecodeSteps, cache: KVCache, tokens: torch.Tensor,
                     on_step=None) -> bool:
        """Greedy decode steps in a row through the native path in one call: input_ids [B], one next
        token per sequence, `steps` where each step computes them; the argmax tokens go to tokens
        [B, S], each step's the next one's input, a column per step as it ends, and on_step(s) (if
        given) is called then; its false return ends the run. False (nothing run) when the native
        path cannot run them: the caller then runs and samples the steps one at a time."""
        fused = self._native_path() if self.native_decode else None
        if fused is None or not fused.runs_greedy(input_ids.shape[0]):
            return False
        rope = self.rotary.table(steps.max_position + 1, input_ids.device)  # [2, P, D]
        return fused.greedy(input_ids, rope, steps, cache, tokens, on_step)

    @property
    def native_path(self) -> native_decode.NativeDecode | None:
        """The native decode path as last built (None: not built yet, or the model cannot take it)."""
        return self._native[1] if self._native is not None else None

    def _native_path(self) -> native_decode.NativeDecode | None:
        # Built on first use and again whenever a layer's weights or executor were swapped
        # (dense quantization, an instrumenting wrapper).
        sig = native_decode.signature(self)
        if self._native is None or self._native[0] != sig:
            self._native = (sig, native_decode.build(self))
        return self._native[1]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> logits [B, V] in float32.

        A decode step's head is a GEMV over the largest dense weight; on the CPU it goes straight to
        the native kernel (int8 head: its `Int8Kernel`, without F.linear's dispatch through the
        weight's tensor subclass, ~90 us a call; float32: `linear_forward`, as the native layers'
        projections; a bfloat16 head times the native path's float32 hidden states too). Anything
        else is F.linear."""
        head = self.model.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head
        if isinstance(head, Int8Linear):
            return head.kernel(hidden)  # [B, V] float32
        weight = head.weight
        kernel = native.load_kernel() if weight.device.type == "cpu" else None
        kind = native_decode.DENSE_KINDS.get(weight.dtype)
        if (kernel is not None and kind is not None and hidden.dtype == torch.float32 and hidden.dim() == 2
                and hidden.shape[0] <= native_decode.DEFAULT_MAX_TOKENS):
            logits = torch.empty(hidden.shape[0], weight.shape[0])  # [B, V]
            kernel.linear_forward(hidden.contiguous(), kind, weight, _NO_SCALE, logits)
            return logits
        return F.linear(hidden.to(weight.dtype), weight).float()


_NO_SCALE = torch.empty(0)  # linear_forward's scale argument, unused for float weights
