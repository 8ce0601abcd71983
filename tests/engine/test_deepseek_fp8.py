"""Block-scaled FP8 checkpoints in DeepSeek-V3's own format, dequantized on load.

The test quantizes a random checkpoint the way DeepSeek-V3 ships: every linear weight of the
decoder layers float8_e4m3fn with a float32 `weight_scale_inv` per block, the embeddings, norms,
router and LM head unquantized, an MTP layer past `num_hidden_layers`, two shards. Reference code
here dequantizes it block by block into an ordinary checkpoint that transformers loads; Tandem
loads the FP8 checkpoint itself and must agree.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import zlib

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_parity import hf_greedy, prompt_for, tandem_greedy

from tandem.model.config import ModelError
from tandem.model.fp8 import Fp8Scheme, dequantize, dequantize_stream, fp8_scheme
from tandem.model.loader import load_model

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(.+\.)?\w+_proj(_with_mqa)?\.weight$")


def quantize_blocks(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    q = torch.empty(n, k, dtype=FP8)
    scale = torch.empty(math.ceil(n / bn), math.ceil(k / bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s = block.abs().max().clamp(min=1e-12) / FP8_MAX
            scale[i, j] = s
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (block / s).to(FP8)
    return q, scale


def reference_dequantize(q: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    w = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= scale[i, j]
    return w


def write_fp8_checkpoint(src, fp8_dir, ref_dir, block: tuple[int, int]) -> None:
    """`fp8_dir`: DeepSeek-format FP8 checkpoint of `src`; `ref_dir`: the same, dequantized by the reference."""
    bn, bk = block
    tensors = load_file(str(src / "model.safetensors"))
    num_layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    fp8, ref = {}, {}
    for name, t in tensors.items():
        if QUANTIZED.match(name):
            q, scale = quantize_blocks(t, bn, bk)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            ref[name] = reference_dequantize(q, scale, bn, bk)
        else:
            fp8[name] = ref[name] = t
    # DeepSeek-V3's multi-token-prediction module rides along as one more layer; decoding ignores it.
    last = f"model.layers.{num_layers - 1}."
    for name in [n for n in fp8 if n.startswith(last)]:
        fp8[name.replace(last, f"model.layers.{num_layers}.")] = fp8[name].clone()
    fp8[f"model.layers.{num_layers}.eh_proj.weight"] = torch.zeros(8, 8, dtype=FP8)
    fp8[f"model.layers.{num_layers}.eh_proj.weight_scale_inv"] = torch.ones(1, 1)
    for d in (fp8_dir, ref_dir):
        d.mkdir()
        shutil.copy(src / "tokenizer.json", d / "tokenizer.json")
    _save_sharded(fp8, fp8_dir)
    save_file(ref, str(ref_dir / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (ref_dir / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [bn, bk]}
    (fp8_dir / "config.json").write_text(json.dumps(config))


def _save_sharded(tensors: dict, out) -> None:
    # Two shards chosen by name hash, so a weight and its scale often sit in different files.
    shards = [{}, {}]
    for name, t in tensors.items():
        shards[zlib.crc32(name.encode()) % 2][name] = t.contiguous()
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def checkpoints(demo_model_dir, tmp_path_factory):
    src = demo_model_dir("deepseek_v3", initializer_range=0.2)
    made = {}

    def make(block):
        if block not in made:
            root = tmp_path_factory.mktemp(f"fp8-{block[0]}x{block[1]}")
            write_fp8_checkpoint(src, root / "fp8", root / "ref", block)
            made[block] = (root / "fp8", root / "ref")
        return made[block]

    return make


@pytest.mark.parametrize("block", [(128, 128), (16, 32)])
def test_fp8_checkpoint_matches_transformers_on_reference_dequantization(block, checkpoints):
    fp8_dir, ref_dir = checkpoints(block)
    prompt = prompt_for(1, 11)
    ref_tokens, ref_logits = hf_greedy(ref_dir, prompt, 32)
    [tokens], [logits], _ = tandem_greedy(fp8_dir, [prompt], 32)
    assert tokens == ref_tokens
    assert len(set(tokens)) > 3
    assert (logits - ref_logits).abs().max().item() <= 1e-4


def test_fp8_weights_dequantize_to_the_serving_dtype(checkpoints):
    fp8_dir, ref_dir = checkpoints((16, 32))
    ref = load_file(str(ref_dir / "model.safetensors"))
    model, executor = load_model(fp8_dir, dtype="bfloat16")
    params = dict(model.named_parameters())
    for name in ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.2.mlp.shared_experts.up_proj.weight"):
        assert params[name].dtype == torch.bfloat16
        assert torch.equal(params[name], ref[name].to(torch.bfloat16)), name
    # The selection bias stays float32, as transformers keeps it.
    assert params["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert executor is not None
    index = json.loads((fp8_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.7.down_proj.weight_scale_inv" in index
    assert "model.layers.3.mlp.experts.0.up_proj.weight" in index  # the MTP layer, skipped on load


def test_dequantize_handles_partial_edge_blocks():
    w = torch.randn(40, 70)
    q, scale = quantize_blocks(w, 16, 32)
    assert scale.shape == (3, 3)
    torch.testing.assert_close(dequantize(q, scale, (16, 32)), reference_dequantize(q, scale, 16, 32),
                               rtol=0, atol=0)
    with pytest.raises(ModelError, match="does not match"):
        dequantize(q, scale[:2], (16, 32))


def test_stacked_experts_dequantize_expert_by_expert():
    # transformers' FP8Experts keeps a layer's experts stacked, [E, N, K] with scales [E, N/bn, K/bk],
    # named experts.gate_up_proj and experts.gate_up_proj_scale_inv.
    blocks = [quantize_blocks(torch.randn(40, 70), 16, 32) for _ in range(3)]
    q, scale = torch.stack([b[0] for b in blocks]), torch.stack([b[1] for b in blocks])  # [3, 40, 70], [3, 3, 3]
    want = torch.stack([reference_dequantize(qe, se, 16, 32) for qe, se in blocks])
    name = "model.layers.1.mlp.experts.gate_up_proj"
    out = dict(dequantize_stream([(name, q), (name + "_scale_inv", scale)], Fp8Scheme("fp8", (16, 32))))
    torch.testing.assert_close(out[name], want, rtol=0, atol=0)
    with pytest.raises(ModelError, match=r"expected \(3, 3, 3\)"):
        dequantize(q, scale[0], (16, 32))


def test_ue8m0_scales_saved_as_bytes_are_powers_of_two():
    # DeepSeek-V3.1's scale_fmt "ue8m0": scales 2^e, which MXFP8 checkpoints save as the bytes of
    # float8_e8m0fnu (e + 127); transformers views them as such. Read as numbers they would be 127x off.
    q, _ = quantize_blocks(torch.randn(40, 70), 16, 32)
    exponents = torch.tensor([[-9, -8, -7], [-6, 0, 3], [-12, -10, -8]])
    want = reference_dequantize(q, torch.pow(2.0, exponents.float()), 16, 32)
    for stored in ((exponents + 127).to(torch.uint8), torch.pow(2.0, exponents.float()).to(torch.float8_e8m0fnu)):
        torch.testing.assert_close(dequantize(q, stored, (16, 32)), want, rtol=0, atol=0)
    with pytest.raises(ModelError, match="must be floating point"):
        dequantize(q, exponents.int(), (16, 32))


def test_stream_pairs_weights_and_scales_in_either_order():
    q, scale = quantize_blocks(torch.randn(8, 8), 4, 4)
    expected = reference_dequantize(q, scale, 4, 4)
    for order in (["a.weight", "a.weight_scale_inv"], ["a.weight_scale_inv", "a.weight"]):
        items = {"a.weight": q, "a.weight_scale_inv": scale}
        stream = [("norm.weight", torch.ones(3))] + [(n, items[n]) for n in order]
        out = dict(dequantize_stream(stream, Fp8Scheme("fp8", (4, 4))))
        assert set(out) == {"norm.weight", "a.weight"}
        torch.testing.assert_close(out["a.weight"], expected, rtol=0, atol=0)


@pytest.mark.parametrize("items,scheme,message", [
    ([("a.weight", torch.zeros(4, 4, dtype=FP8))], Fp8Scheme("fp8", (4, 4)), "no scale tensor"),
    ([("a.weight_scale_inv", torch.ones(1, 1))], Fp8Scheme("fp8", (4, 4)), "no fp8 weight"),
    ([("a.weight", torch.zeros(4, 4, dtype=FP8))], None, "no fp8 quantization_config"),
    # DeepSeek's block scales under a config without weight_block_size (read as per tensor, as vLLM does)
    ([("a.weight", torch.zeros(8, 8, dtype=FP8)), ("a.weight_scale_inv", torch.ones(2, 2))], Fp8Scheme("fp8"),
     r"scale shape \(2, 2\) does not match weight \(8, 8\): expected \(8, 1\) per channel, \(1,\) per tensor"),
])
def test_stream_rejects_incomplete_checkpoints(items, scheme, message):
    with pytest.raises(ModelError, match=message):
        list(dequantize_stream(items, scheme))


@pytest.mark.parametrize("config,message", [
    ({"quant_method": "gptq", "bits": 4}, "not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "e5m2"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "e4m3"}, "scale_fmt 'e4m3'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp4"}, "expert_dtype 'fp4'"),
])
def test_unsupported_quantization_configs_raise(config, message):
    with pytest.raises(ModelError, match=message):
        fp8_scheme(config)


def test_deepseek_quantization_config_is_read():
    assert fp8_scheme({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [128, 128]}) == Fp8Scheme("fp8", (128, 128))
    assert fp8_scheme({"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",  # DeepSeek-V3.1
                       "weight_block_size": [128, 128]}) == Fp8Scheme("fp8", (128, 128))
    assert fp8_scheme(None) is None
