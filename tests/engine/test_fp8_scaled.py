"""FP8 checkpoints with per-tensor or per-channel `weight_scale` and static activation scales, as
AutoFP8 and llm-compressor (compressed-tensors' "float-quantized" format) save them, dequantized on load.

The test quantizes a random Mixtral the way those tools save it: every attention and expert linear
weight float8_e4m3fn with a `weight_scale` ([] for AutoFP8, [1] per tensor or [N, 1] per channel for
compressed-tensors, whose own initialize_qparams makes those shapes) and an `input_scale`; the router,
embeddings, norms and LM head unquantized and named in the config's ignore list. transformers runs the
same weights dequantized (w = fp8 * scale, compressed-tensors' own dequantize) as an ordinary
checkpoint; Tandem loads the fp8 one itself and must agree.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_parity import hf_greedy, prompt_for, tandem_greedy

from tandem.model.config import ModelError
from tandem.model.fp8 import Fp8Scheme, dequantize, fp8_scheme, weight_of
from tandem.model.loader import load_expert_weights, load_model

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$")
IGNORE = ["lm_head", "re:.*block_sparse_moe.gate$"]  # llm-compressor's MoE recipes leave the router alone


def compressed_tensors_config(strategy: str) -> dict:
    """quantization_config as llm-compressor writes it for its FP8 scheme (static per-tensor activations),
    weights per `strategy`."""
    args = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None,
            "block_structure": None, "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**args, "strategy": strategy},
                                          "input_activations": {**args, "strategy": "tensor"},
                                          "output_activations": None}},
            "ignore": IGNORE, "kv_cache_scheme": None, "global_compression_ratio": None}


# name -> (quantization_config, weight_scale shape per weight [N, K], scale dtype)
FORMATS = {
    "autofp8": ({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
                lambda n: (), torch.float32),
    "compressed-tensors-tensor": (compressed_tensors_config("tensor"), lambda n: (1,), torch.float32),
    "compressed-tensors-channel": (compressed_tensors_config("channel"), lambda n: (n, 1), torch.bfloat16),
}


def quantize(w: torch.Tensor, shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], scale of `shape`): the largest |w| of each channel, or of the tensor, to 448."""
    amax = w.abs().amax(dim=1, keepdim=True) if shape == (w.shape[0], 1) else w.abs().amax()
    scale = (amax.clamp(min=1e-12) / FP8_MAX).to(dtype).reshape(shape)
    return (w / scale.float().reshape(-1, 1)).to(FP8), scale


def write_checkpoints(src, fp8_dir, ref_dir, fmt: str, also_quantize: str | None = None) -> None:
    """`fp8_dir`: `src` saved in `fmt`; `ref_dir`: the same weights dequantized, for transformers."""
    config, scale_shape, scale_dtype = FORMATS[fmt]
    fp8, ref = {}, {}
    g = torch.Generator().manual_seed(0)
    for name, t in load_file(str(src / "model.safetensors")).items():
        if QUANTIZED.match(name) or name == also_quantize:
            q, scale = quantize(t, scale_shape(t.shape[0]), scale_dtype)
            module = name.removesuffix(".weight")
            fp8[name], fp8[f"{module}.weight_scale"] = q, scale
            fp8[f"{module}.input_scale"] = (torch.rand(scale_shape(1), generator=g) + 0.01).to(scale_dtype)
            ref[name] = q.float() * scale.float().reshape(-1, 1)
        else:
            fp8[name] = ref[name] = t
    hf = json.loads((src / "config.json").read_text())
    for d, tensors, cfg in ((fp8_dir, fp8, {**hf, "quantization_config": config}), (ref_dir, ref, hf)):
        d.mkdir()
        shutil.copy(src / "tokenizer.json", d / "tokenizer.json")
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def checkpoints(demo_model_dir, tmp_path_factory):
    src = demo_model_dir("mixtral", initializer_range=0.2)

    def make(fmt: str, also_quantize: str | None = None):
        root = tmp_path_factory.mktemp(fmt)
        write_checkpoints(src, root / "fp8", root / "ref", fmt, also_quantize)
        return root / "fp8", root / "ref"

    return make


@pytest.mark.parametrize("fmt", FORMATS)
def test_scaled_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(fmt, checkpoints):
    fp8_dir, ref_dir = checkpoints(fmt)
    assert "model.layers.1.block_sparse_moe.experts.7.w2.input_scale" in load_file(str(fp8_dir / "model.safetensors"))
    prompt = prompt_for(1, 11)
    ref_tokens, ref_logits = hf_greedy(ref_dir, prompt, 24)
    [tokens], [logits], _ = tandem_greedy(fp8_dir, [prompt], 24)
    assert tokens == ref_tokens and len(set(tokens)) > 3
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    # the experts process of the split deployment reads the same experts
    ref = load_file(str(ref_dir / "model.safetensors"))
    experts = load_expert_weights(fp8_dir)[1]
    assert torch.equal(experts.gate_up[7, :128], ref["model.layers.1.block_sparse_moe.experts.7.w1.weight"])
    assert torch.equal(experts.down[7], ref["model.layers.1.block_sparse_moe.experts.7.w2.weight"])


def test_a_quantized_module_the_config_leaves_unquantized_is_refused(checkpoints):
    fp8_dir, _ = checkpoints("compressed-tensors-channel", also_quantize="model.layers.0.block_sparse_moe.gate.weight")
    with pytest.raises(ModelError, match=r"model\.layers\.0\.block_sparse_moe\.gate\.weight\w* is fp8, but "
                                         r"quantization_config lists model\.layers\.0\.block_sparse_moe\.gate"):
        load_model(fp8_dir)
    fp8_dir, _ = checkpoints("autofp8", also_quantize="lm_head.weight")
    with pytest.raises(ModelError, match=r"lists lm_head among the modules it leaves unquantized"):
        load_model(fp8_dir)


def test_ignore_lists_match_as_their_tools_do():
    ct = Fp8Scheme("compressed-tensors", ignore=("lm_head", "re:.*mlp.gate$"))
    assert ct.ignores("lm_head") and ct.ignores("model.layers.3.mlp.gate")
    assert not ct.ignores("model.layers.3.mlp.gate_proj") and not ct.ignores("model.lm_head")
    hf = Fp8Scheme("fp8", ignore=("lm_head", "model.layers.1"))  # transformers' modules_to_not_convert
    assert hf.ignores("lm_head") and hf.ignores("model.layers.1.self_attn.q_proj")
    assert not hf.ignores("model.layers.11.self_attn.q_proj")


def test_per_channel_and_per_tensor_scales_multiply():
    q = (torch.randn(6, 5) * 50).to(FP8)
    channel, tensor = torch.rand(6, 1) + 0.5, torch.tensor([0.25])
    torch.testing.assert_close(dequantize(q, channel), q.float() * channel, rtol=0, atol=0)
    torch.testing.assert_close(dequantize(q, channel.reshape(6)), q.float() * channel, rtol=0, atol=0)
    torch.testing.assert_close(dequantize(q, tensor), q.float() / 4, rtol=0, atol=0)
    torch.testing.assert_close(dequantize(q, tensor.reshape(())), q.float() / 4, rtol=0, atol=0)
    with pytest.raises(ModelError, match=r"scale shape \(5, 1\) does not match weight \(6, 5\)"):
        dequantize(q, torch.ones(5, 1))


def test_scales_and_activation_scales_belong_to_their_weights():
    for suffix in ("weight_scale", "weight_scale_inv", "input_scale", "activation_scale", "weight"):
        assert weight_of(f"model.layers.0.self_attn.q_proj.{suffix}") == "model.layers.0.self_attn.q_proj.weight"
    stacked = "model.layers.0.mlp.experts.gate_up_proj"  # transformers' stacked experts
    for suffix in ("_scale_inv", "_activation_scale", ""):
        assert weight_of(stacked + suffix) == stacked
    assert weight_of("model.layers.0.input_layernorm.weight") == "model.layers.0.input_layernorm.weight"


@pytest.mark.parametrize("config,message", [
    ({**compressed_tensors_config("tensor"), "format": "pack-quantized",  # W4A16, GPTQ-style int4
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                                        "strategy": "group", "group_size": 128}}}},
     r"group 'group_0': format 'pack-quantized' with int 4-bit weights is not supported"),
    ({**compressed_tensors_config("group")}, r"fp8 weight strategy 'group' is not supported"),
    ({**compressed_tensors_config("tensor"), "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "float", "symmetric": False, "strategy": "tensor"}}}}, "asymmetric"),
    ({**compressed_tensors_config("tensor"), "kv_cache_scheme": {"num_bits": 8, "type": "int"}},
     r"kv_cache_scheme of int 8-bit numbers, strategy 'tensor' is not supported"),
    ({**compressed_tensors_config("tensor"), "kv_cache_scheme": {"num_bits": 8, "type": "float",
                                                                 "strategy": "attn_head"}},
     r"kv_cache_scheme of float 8-bit numbers, strategy 'attn_head' is not supported"),
    ({**compressed_tensors_config("block")}, r"block_structure must be two positive integers"),
    ({"quant_method": "awq", "bits": 4}, r"quantization method 'awq' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "per-token"}, r"activation_scheme 'per-token'"),
])
def test_unsupported_schemes_are_refused_by_name(config, message):
    with pytest.raises(ModelError, match=message):
        fp8_scheme(config)


def test_the_schemes_are_read():
    assert fp8_scheme(FORMATS["autofp8"][0]) == Fp8Scheme("fp8", None, ("lm_head",))
    assert fp8_scheme(compressed_tensors_config("channel")) == Fp8Scheme("compressed-tensors", None, tuple(IGNORE))
    block = compressed_tensors_config("block")  # llm-compressor's FP8_BLOCK
    block["config_groups"]["group_0"]["weights"]["block_structure"] = [128, 128]
    assert fp8_scheme(block).block == (128, 128)


def test_an_unsupported_scheme_is_refused_when_the_model_loads(checkpoints, tmp_path):
    fp8_dir, _ = checkpoints("compressed-tensors-tensor")
    shutil.copytree(fp8_dir, tmp_path / "w4a16")
    config = json.loads((tmp_path / "w4a16" / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["weights"].update(num_bits=4, type="int", strategy="group", group_size=128)
    config["quantization_config"]["format"] = "pack-quantized"
    (tmp_path / "w4a16" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="format 'pack-quantized' with int 4-bit weights is not supported"):
        load_model(tmp_path / "w4a16")
