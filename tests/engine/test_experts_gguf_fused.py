"""GGUF files whose layers store gate and up experts fused, `blk.N.ffn_gate_up_exps.weight` [E, 2I, H].

llama.cpp's layout (vendor/llama.cpp of llama-cpp-python 0.3.36): the converter's --fuse-gate-up-exps
writes torch.cat([gate, up], dim=1) of the [E, I, H] tensors; build_moe_ffn takes gate from the first
I rows of each expert's product and up from the next I; the gguf package maps transformers'
`mlp.experts.gate_up_proj` (gate rows first) to it unchanged. Each file here is written both ways
by the gguf package's writer and must load to the same numbers, and a whole model from the fused
file must match transformers on the file's weights.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from test_experts_gguf import random_blocks, reference, rel_err, write_gguf
from test_experts_quality import forced_against, transformers_logits

from tandem.engine.llm_engine import LLMEngine
from tandem.experts.base import ExpertWeights
from tandem.experts.gguf_experts import gguf_expert_shapes, load_gguf_experts
from tandem.experts.quant import Int4Weight, Int8Weight, dequantize_int4, dequantize_int8
from tandem.experts.torch_executor import TorchExpertExecutor

T = gguf.GGMLQuantizationType
E, H, I = 4, 256, 256


def tensor_of(qtype, shape: tuple[int, int, int], g: torch.Generator) -> tuple[np.ndarray, object]:
    """(data, type) for write_gguf: random weights in `qtype` (K-quants as random valid blocks)."""
    if qtype in (T.Q4_K, T.Q6_K):
        return random_blocks(qtype, *shape, g), qtype
    w = (torch.randn(*shape, generator=g) / 16).numpy()
    if qtype == T.F32:
        return w, None
    if qtype == T.F16:
        return w.astype(np.float16), None
    return gguf.quants.quantize(w, qtype), qtype


def fused_and_unfused(tmp_path, types: dict[str, object], g: torch.Generator):
    """Two files of the same layer 0: gate and up fused along the rows (gate first), and separate."""
    gate, up = tensor_of(types["gate_up"], (E, I, H), g), tensor_of(types["gate_up"], (E, I, H), g)
    down = tensor_of(types["down"], (E, H, I), g)
    fused = np.concatenate([gate[0], up[0]], axis=1)  # [E, 2I, row bytes]: whole blocks per row
    return (write_gguf(tmp_path / "fused.gguf", {"blk.0.ffn_gate_up_exps.weight": (fused, gate[1]),
                                                  "blk.0.ffn_down_exps.weight": down}),
            write_gguf(tmp_path / "unfused.gguf", {"blk.0.ffn_gate_exps.weight": gate,
                                                    "blk.0.ffn_up_exps.weight": up,
                                                    "blk.0.ffn_down_exps.weight": down}))


def dequantized(w) -> torch.Tensor:
    return dequantize_int4(w) if isinstance(w, Int4Weight) else dequantize_int8(w)


@pytest.mark.parametrize("gate_up,down,fmt", [
    (T.Q4_0, T.Q4_0, Int4Weight), (T.Q4_K, T.Q4_K, Int4Weight), (T.Q4_K, T.Q6_K, Int8Weight),
    (T.Q8_0, T.Q8_0, Int8Weight), (T.Q6_K, T.Q6_K, Int8Weight), (T.Q5_0, T.Q8_0, Int8Weight),
    (T.BF16, T.BF16, Int8Weight), (T.F16, T.F16, Int8Weight), (T.F32, T.F32, Int8Weight),
], ids=lambda v: getattr(v, "name", None) or v.__name__)
def test_a_fused_gate_up_tensor_loads_as_its_two_halves(tmp_path, gate_up, down, fmt):
    fused, unfused = fused_and_unfused(tmp_path, {"gate_up": gate_up, "down": down},
                                       torch.Generator().manual_seed(int(gate_up) * 100 + int(down)))
    assert gguf_expert_shapes(fused) == gguf_expert_shapes(unfused) == {
        0: {"gate": (E, I, H), "up": (E, I, H), "down": (E, H, I)}}
    got, want = load_gguf_experts(fused)[0], load_gguf_experts(unfused)[0]
    assert isinstance(got.gate_up, fmt) and isinstance(got.down, fmt)
    assert torch.equal(dequantized(got.gate_up), dequantized(want.gate_up))
    assert torch.equal(dequantized(got.down), dequantized(want.down))


def test_halves_are_not_swapped(tmp_path):
    # Gate rows all 1/16 and up rows all -1/16 (exact in Q8_0): the loaded gate_up keeps gate first.
    gate, up = np.full((E, I, H), 1 / 16, np.float32), np.full((E, I, H), -1 / 16, np.float32)
    down = gguf.quants.quantize(np.zeros((E, H, I), np.float32), T.Q8_0)
    fused = gguf.quants.quantize(np.concatenate([gate, up], axis=1), T.Q8_0)
    path = write_gguf(tmp_path / "fused.gguf", {"blk.0.ffn_gate_up_exps.weight": (fused, T.Q8_0),
                                                 "blk.0.ffn_down_exps.weight": (down, T.Q8_0)})
    w = dequantize_int8(load_gguf_experts(path)[0].gate_up)  # [E, 2I, H]
    torch.testing.assert_close(w[:, :I], torch.full((E, I, H), 1 / 16))
    torch.testing.assert_close(w[:, I:], torch.full((E, I, H), -1 / 16))


def test_fused_files_that_do_not_split_are_refused(tmp_path):
    g = torch.Generator().manual_seed(9)
    q4k = random_blocks(T.Q4_K, E, I, H, g)
    fused, down = (np.concatenate([q4k, q4k], 1), T.Q4_K), (random_blocks(T.Q4_K, E, H, I, g), T.Q4_K)
    both = write_gguf(tmp_path / "both.gguf", {"blk.0.ffn_gate_up_exps.weight": fused,
                                               "blk.0.ffn_gate_exps.weight": (q4k, T.Q4_K),
                                               "blk.0.ffn_down_exps.weight": down})
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate_up_exps\.weight and separate .* one or the other"):
        load_gguf_experts(both)
    odd = write_gguf(tmp_path / "odd.gguf", {"blk.0.ffn_gate_up_exps.weight": (random_blocks(T.Q4_K, E, 3, H, g),
                                                                               T.Q4_K),
                                             "blk.0.ffn_down_exps.weight": down})
    with pytest.raises(ValueError, match=r"gate_up_exps\.weight: expected stacked experts \[E, 2I, H\].*\[4, 3, 256\]"):
        gguf_expert_shapes(odd)
    no_down = write_gguf(tmp_path / "nodown.gguf", {"blk.0.ffn_gate_up_exps.weight": fused})
    with pytest.raises(ValueError, match="no ffn_down_exps tensor"):
        load_gguf_experts(no_down)


# A whole Qwen3-MoE model: its own experts quantized to Q4_0 as the converter writes them fused (gate_up
# [E, 2I, H] quantized as one tensor). transformers runs the checkpoint with the gguf package's reading of
# that file, unsplit, as its experts.gate_up_proj (gate rows first).

PROMPTS = [[5, 17, 42, 9, 100, 3], [250, 7, 7, 81], [11, 12, 13, 14, 15, 16, 17, 18]]
GEN = 10


def write_fused_model(src, out, types) -> tuple:
    """(fused GGUF file of `src`'s experts, the same experts unfused, reference checkpoint) under `out`,
    layer i's experts in types[i]."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    fused, unfused = {}, {}
    for layer, qtype in enumerate(types):
        experts = model.model.layers[layer].mlp.experts
        gate_up = gguf.quants.quantize(experts.gate_up_proj.detach().numpy(), qtype)  # [E, 2I, row bytes]
        down = (gguf.quants.quantize(experts.down_proj.detach().numpy(), qtype), qtype)
        n = gate_up.shape[1] // 2
        fused.update({f"blk.{layer}.ffn_gate_up_exps.weight": (gate_up, qtype),
                      f"blk.{layer}.ffn_down_exps.weight": down})
        unfused.update({f"blk.{layer}.ffn_gate_exps.weight": (gate_up[:, :n], qtype),
                        f"blk.{layer}.ffn_up_exps.weight": (gate_up[:, n:], qtype),
                        f"blk.{layer}.ffn_down_exps.weight": down})
        with torch.no_grad():
            experts.gate_up_proj.copy_(reference(gate_up, qtype))
            experts.down_proj.copy_(reference(*down))
    model.save_pretrained(out / "reference")
    return write_gguf(out / "fused.gguf", fused), write_gguf(out / "unfused.gguf", unfused), out / "reference"


@pytest.fixture(scope="module")
def fused_model(demo_model_dir, tmp_path_factory):
    """(checkpoint, fused GGUF file of its experts, the same experts unfused, reference checkpoint)."""
    src = demo_model_dir("qwen3_moe", hidden_size=H, moe_intermediate_size=I, initializer_range=0.2)
    return src, *write_fused_model(src, tmp_path_factory.mktemp("gguf-fused-model"), (T.Q4_0, T.Q4_0))


def test_a_model_with_fused_gguf_experts_matches_transformers_exactly(fused_model):
    # Q4_0 loads as int4 with the file's numbers exactly: run in float32 (not the kernels' int8
    # activations), the fused file's experts are transformers' to float32 rounding.
    src, fused, _, ref_dir = fused_model
    want_tokens, want = transformers_logits(ref_dir, PROMPTS, GEN)  # [prompts * GEN, V]
    exact = TorchExpertExecutor({layer: ExpertWeights(dequantize_int4(w.gate_up), dequantize_int4(w.down))
                                 for layer, w in load_gguf_experts(fused).items()})
    engine = LLMEngine.from_pretrained(src, device="cpu", dtype="float32", expert_executor=exact)
    agree, got = forced_against(engine, want_tokens, PROMPTS, GEN)
    assert agree == 1.0 and (got - want).abs().max().item() <= 1e-4


def test_a_model_with_fused_gguf_experts_runs_as_the_unfused_file(fused_model):
    src, fused, unfused, ref_dir = fused_model
    want_tokens, want = transformers_logits(ref_dir, PROMPTS, GEN)
    got = {}
    for name, path in (("fused", fused), ("unfused", unfused)):
        engine = LLMEngine.from_pretrained(src, device="cpu", dtype="float32", experts_gguf=path, expert_threads=2)
        assert engine.model.model.layers[0].mlp.executor.quant == "int4"
        agree, got[name] = forced_against(engine, want_tokens, PROMPTS, GEN)
    assert torch.equal(got["fused"], got["unfused"])  # the same bytes, the same kernels
    # against transformers: the kernels' int8 activations (measured 2.9%; gate and up swapped: ~100%)
    assert agree >= 0.9 and 0 < rel_err(got["fused"], want) < 0.05
