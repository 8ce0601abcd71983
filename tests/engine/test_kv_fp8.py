"""An fp8 KV cache (--kv-cache-dtype fp8): every attention path over its blocks, its quality against
transformers, the checkpoint's calibrated scales, and its size.

Two references. transformers with its attention reading K and V rounded as an fp8 cache stores them
(`fp8_transformers`) must equal Tandem to float32 precision on every path: that says each path
writes and reads the blocks right, scales included. Plain transformers measures what fp8 costs.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tandem.cli import main
from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.kv import fp8
from tandem.kv.cache import CPU, DEVICE, KVLayout
from tandem.model.config import ModelError
from tier_probe import count_tier_traffic

FP8 = torch.float8_e4m3fn
NEW_TOKENS = 24
# Scales as a calibration gives them (|K| and |V| reach ~0.56 here: 2^-8 maps them to ~143, well inside
# e4m3's 448), exact in float32 as the checkpoint stores them.
SCALES = {"k": 2.0**-8, "v": 3 * 2.0**-9}


def prompts(n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 300, (9 + 2 * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def model_dir(demo_model_dir):
    # The default demo Mixtral (transformers' initializer_range 0.02), as the int8 quality tests use: the
    # wider-init model's attention and routing are so sharp that any rounding flips near-ties.
    return demo_model_dir("mixtral")


def with_kv_scales(src, dst, scales: dict[str, float], names: str = "{layer}.self_attn.{kind}_scale"):
    """A copy of checkpoint `src` with calibrated KV scales, as llm-compressor writes them: a k_scale and a
    v_scale tensor a layer, and a compressed-tensors quantization_config with a kv_cache_scheme."""
    dst = shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    for layer in range(config["num_hidden_layers"]):
        for kind, value in scales.items():
            tensors[f"model.layers.{names.format(layer=layer, kind=kind)}"] = torch.tensor([value])
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                            "symmetric": True}}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def scaled_dir(model_dir, tmp_path_factory):
    return with_kv_scales(model_dir, tmp_path_factory.mktemp("kv-scales") / "ckpt", SCALES)


def engine(model_dir, dtype: str = "float32", **config) -> LLMEngine:
    return LLMEngine.from_pretrained(model_dir, device="cpu", dtype=dtype, config=EngineConfig(**config))


def generate(eng: LLMEngine, batch: list[list[int]], n: int = NEW_TOKENS):
    """Greedy continuations and every step's logits [n, V], per prompt."""
    logits = {}
    eng.runner.logits_hook = lambda rid, row: logits.setdefault(rid, []).append(row.float().cpu())
    done = eng.generate(batch, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [(c.token_ids, torch.stack(logits[c.request_id])) for c in done], done


def reference_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' logits [n, V] at each position of `tokens` (Tandem's continuation), given the same prefix."""
    with torch.no_grad():
        return model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float()


def fp8_transformers(model_dir, scales: dict[str, float] | None = None):
    """transformers' model whose attention reads K / k_scale and V / v_scale rounded to e4m3 (saturated
    at 448) and scaled back: what Tandem's fp8 cache holds for every key it attends to."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ks, vs = (scales or {}).get("k", 1.0), (scales or {}).get("v", 1.0)

    def rounded(x, s):
        return fp8.quantize(x, s).to(x.dtype) * s

    def attention(module, query, key, value, *args, **kwargs):
        return sdpa_attention_forward(module, query, rounded(key, ks), rounded(value, vs), *args, **kwargs)

    name = f"tandem_fp8_kv_{ks}_{vs}"
    AttentionInterface.register(name, attention)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.set_attn_implementation(name)
    return model


def assert_matches(eng: LLMEngine, reference, batch: list[list[int]], n: int = NEW_TOKENS, tol: float = 1e-4):
    """Tandem's greedy tokens are the reference's argmax at every step, logits within `tol`."""
    results, done = generate(eng, batch, n)
    for prompt, (tokens, logits) in zip(batch, results):
        want = reference_logits(reference, prompt, tokens)
        diff = (logits - want).abs().max().item()
        assert diff <= tol, f"max abs logit diff {diff:.2e}"
        assert tokens == want.argmax(-1).tolist()
    return done


# Each way a sequence's KV is written and read: the native decode layer; the torch layers over the
# native decode-attention kernel, or over SDPA; prefill chunks and decodes on the CPU tier; swaps to the
# CPU tier and back. With scales 1.0 and the checkpoint's calibrated ones.
PATHS = {
    "native": {},
    "torch layers, native attention": {},
    "torch layers, sdpa": {},
    "cpu tier": dict(block_size=4, num_device_blocks=8, num_cpu_blocks=64, max_model_len=64, max_num_batched_tokens=16),
    "swaps": dict(block_size=4, num_device_blocks=16, num_cpu_blocks=64, max_model_len=64, cpu_decode=False),
}


@pytest.mark.parametrize("scaled", [False, True], ids=["scale 1", "calibrated scales"])
@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_equals_transformers_over_fp8_rounded_kv(model_dir, scaled_dir, path, scaled, monkeypatch):
    src = scaled_dir if scaled else model_dir
    reference = fp8_transformers(model_dir, SCALES if scaled else None)
    eng = engine(src, kv_cache_dtype="fp8", **PATHS[path])
    assert eng.cache.layout.dtype == FP8
    assert eng.cache.scales[1] == (SCALES if scaled else {"k": 1.0, "v": 1.0})
    eng.model.native_decode = not path.startswith("torch")
    if path == "torch layers, sdpa":
        monkeypatch.setattr("tandem.kv.attention._native_decode", False)
    swaps, cpu_tokens = count_tier_traffic(eng)
    assert_matches(eng, reference, prompts())
    if path == "native":
        assert eng.model.native_path.steps == NEW_TOKENS - 1
    if path == "cpu tier":
        assert swaps["out"] and cpu_tokens[0] >= NEW_TOKENS, (swaps, cpu_tokens)
    if path == "swaps":
        assert swaps["out"] and swaps["in"] and not cpu_tokens[0], (swaps, cpu_tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_cuda_graphs_over_fp8_blocks(demo_model_dir, model_dir, scaled_dir, arch):
    # Decode steps replayed from CUDA graphs: the KV write (quantized by torch, copied as bytes by the
    # Triton kernel) and the Triton decode kernel over e4m3 bytes, scales folded in.
    def cuda_engine(path, enforce_eager):
        return LLMEngine.from_pretrained(path, device="cuda", dtype="float32", config=EngineConfig(
            kv_cache_dtype="fp8", enforce_eager=enforce_eager, num_device_blocks=160, max_num_seqs=8))

    if arch == "mixtral":  # as transformers over the same rounding, calibrated scales included (CUDA: 1e-3)
        eng = cuda_engine(scaled_dir, enforce_eager=False)
        assert_matches(eng, fp8_transformers(model_dir, SCALES), prompts(), tol=1e-3)
        assert eng.runner.graphs is not None and eng.runner.graphs.steps == NEW_TOKENS - 1
    else:  # MLA's latent: graphed steps give the eager ones
        path = demo_model_dir(arch)
        graphed, eager = (generate(cuda_engine(path, e), prompts())[0] for e in (False, True))
        for (g_tokens, g_logits), (e_tokens, e_logits) in zip(graphed, eager):
            assert g_tokens == e_tokens and (g_logits - e_logits).abs().max().item() <= 1e-3


def test_prefix_cache_hits_read_the_fp8_blocks_written_before(model_dir):
    reference = fp8_transformers(model_dir)
    eng = engine(model_dir, kv_cache_dtype="fp8", block_size=4)
    shared = prompts(1)[0] + [7, 8, 9, 10, 11, 12, 13]  # 16 tokens: four full blocks
    assert_matches(eng, reference, [shared + [5]])
    [hit] = assert_matches(eng, reference, [shared + [40, 41]])
    assert hit.num_cached_tokens == 16


# Measured on this model over 8 prompts of 24 steps (192 positions), Tandem's own continuations against
# transformers given the same prefixes: 96% of greedy tokens agree (95% with the calibrated scales; a
# bfloat16 cache: 99%); each step's logit error relative to the logits' norm is 1.4% on average (bf16:
# 0.4%) and 11% at worst, at most 0.049 in absolute terms, the logits reaching ~0.7. e4m3 keeps 3 bits
# of mantissa: every number of K and V is off by up to 6%. The bounds leave a margin; a path reading
# the blocks wrong (a scale missed, bytes read as another type) is off by far more.
@pytest.mark.parametrize("scaled", [False, True], ids=["scale 1", "calibrated scales"])
def test_greedy_tokens_and_logits_stay_close_to_transformers(model_dir, scaled_dir, scaled):
    agreement, errors, worst = against_transformers(engine(scaled_dir if scaled else model_dir, kv_cache_dtype="fp8"),
                                                    model_dir, prompts(8))
    assert agreement >= 0.9, f"{agreement:.1%} of positions agree"
    assert errors.mean() < 0.03 and errors.max() < 0.25 and worst < 0.1, (errors.mean(), errors.max(), worst)


def against_transformers(eng: LLMEngine, model_dir, batch: list[list[int]]) -> tuple[float, torch.Tensor, float]:
    """Tandem's greedy continuations against transformers (float32) given the same prefixes: the share of
    positions where its token is transformers' argmax, each step's logit error relative to the logits'
    norm, and the largest absolute one."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results, _ = generate(eng, batch)
    agree, errors, worst = 0, [], 0.0
    for prompt, (tokens, logits) in zip(batch, results):
        want = reference_logits(reference, prompt, tokens)
        agree += (want.argmax(-1) == torch.tensor(tokens)).sum().item()
        errors.append((logits - want).norm(dim=-1) / want.norm(dim=-1))
        worst = max(worst, (logits - want).abs().max().item())
    return agree / (len(batch) * len(results[0][0])), torch.cat(errors), worst


def test_mla_latent_cache_in_fp8(demo_model_dir):
    # DeepSeek-V3's one latent a token, with one scale: prefill chunks (expanded form), decodes (absorbed),
    # and the CPU tier. Measured over 8 prompts: 99.5% of positions agree, relative logit error 1.3% on average.
    path = demo_model_dir("deepseek_v3")
    eng = engine(path, kv_cache_dtype="fp8", block_size=4, num_device_blocks=8, num_cpu_blocks=64,
                 max_model_len=64, max_num_batched_tokens=16)
    assert eng.cache.layout.entries[0][0] == "latent" and eng.cache.layout.dtype == FP8
    swaps, cpu_tokens = count_tier_traffic(eng)
    agreement, errors, _ = against_transformers(eng, path, prompts())
    assert swaps["out"] and cpu_tokens[0]
    assert agreement >= 0.9 and errors.mean() < 0.03, (agreement, errors.mean())


@pytest.mark.parametrize("native", [True, False])
def test_a_bfloat16_model_reads_fp8_blocks_on_both_decode_paths(model_dir, native):
    # bf16 weights, float32 query into the native kernel or bf16 through the torch layers, over fp8 blocks.
    eng = engine(model_dir, "bfloat16", kv_cache_dtype="fp8")
    eng.model.native_decode = native
    agreement, errors, _ = against_transformers(eng, model_dir, prompts())
    assert (eng.model.native_path is not None) == native
    assert agreement >= 0.9 and errors.mean() < 0.05, (agreement, errors.mean())


def test_calibrated_scales_decide_the_stored_bytes(model_dir, scaled_dir):
    # Layer 0's K and V do not depend on any cached value: the float32 cache of an "auto" engine holds them
    # exactly, and the fp8 cache holds those divided by the checkpoint's scales, rounded to e4m3.
    batch = prompts(1)
    plain = engine(model_dir, block_size=4)
    plain.generate(batch, SamplingParams(max_tokens=1, temperature=0.0))
    scaled = engine(scaled_dir, block_size=4, kv_cache_dtype="fp8")
    scaled.generate(batch, SamplingParams(max_tokens=1, temperature=0.0))
    for name, scale in SCALES.items():  # both engines put the prompt in the same blocks: compare whole tiers
        exact = plain.cache.tiers[DEVICE][name][0]  # [blocks, block_size, Hkv, D] float32
        stored = scaled.cache.tiers[DEVICE][name][0]
        assert stored.dtype == FP8 and exact.abs().sum() > 0
        assert torch.equal(stored.view(torch.uint8), fp8.quantize(exact, scale).view(torch.uint8))
        unscaled = fp8.quantize(exact, 1.0)  # what scale 1.0 stores: other bytes for these small numbers
        assert not torch.equal(stored.view(torch.uint8), unscaled.view(torch.uint8))
    # "auto" on the same checkpoint keeps the model's dtype and ignores the scales, as vLLM does
    auto = engine(scaled_dir, block_size=4)
    auto.generate(batch, SamplingParams(max_tokens=1, temperature=0.0))
    assert auto.cache.layout.dtype == torch.float32 and auto.cache.layout.scales == ()
    assert torch.equal(auto.cache.tiers[DEVICE]["k"][0], plain.cache.tiers[DEVICE]["k"][0])


def test_autofp8_output_scales_load_as_kv_scales(model_dir, tmp_path):
    # AutoFP8's older names (self_attn.k_proj.output_scale), which vLLM reads as k_scale / v_scale.
    path = with_kv_scales(model_dir, tmp_path / "autofp8", SCALES, names="{layer}.self_attn.{kind}_proj.output_scale")
    assert engine(path, kv_cache_dtype="fp8").cache.scales == [SCALES, SCALES]


@pytest.mark.parametrize("value, message", [
    (torch.tensor([0.5, 0.5]), r"a KV scale must be one float \(per tensor\), got torch.float32 of shape \(2,\)"),
    (torch.tensor([0.0]), "a KV scale must be finite and > 0, got 0.0"),
    (torch.tensor([float("inf")]), "a KV scale must be finite and > 0, got inf"),
])
def test_bad_kv_scales_are_refused_by_name(model_dir, tmp_path, value, message):
    path = with_kv_scales(model_dir, tmp_path / "bad", SCALES)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.self_attn.v_scale"] = value
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=rf"model.layers.1.self_attn.v_scale: {message}"):
        engine(path)


@pytest.mark.parametrize("dtype, ratio", [("bfloat16", 2), ("float32", 4)])
def test_fp8_blocks_take_a_byte_a_number_so_the_same_memory_holds_more(model_dir, dtype, ratio):
    sizes = dict(cpu_kv_gib=2**-7, device_kv_gib=2**-8, max_num_seqs=1000)  # no cap from max_num_seqs
    full, small = engine(model_dir, dtype, **sizes), engine(model_dir, dtype, kv_cache_dtype="fp8", **sizes)
    assert small.cache.layout.bytes_per_block(16) * ratio == full.cache.layout.bytes_per_block(16)
    for tier in (DEVICE, CPU):
        assert small.cache.num_blocks(tier) == ratio * full.cache.num_blocks(tier), tier
        assert small.cache.tiers[tier]["k"].dtype == FP8


def test_bad_kv_cache_dtypes_and_scales_are_refused(model_dir, capsys):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, got 'fp9'"):
        EngineConfig(kv_cache_dtype="fp9")
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", str(model_dir), "--prompt-ids", "5,6", "--kv-cache-dtype", "fp9"])
    assert exc.value.code == 2 and "invalid choice: 'fp9'" in capsys.readouterr().err
    entries = (("k", (2, 4)), ("v", (2, 4)))
    with pytest.raises(ValueError, match="KV scales are for an fp8 cache, not a torch.bfloat16 one"):
        KVLayout(entries, 1, torch.bfloat16, ((0.5, 0.5),))
    with pytest.raises(ValueError, match="layer 0's v scale must be a finite number > 0, got nan"):
        KVLayout(entries, 1, FP8, ((0.5, float("nan")),))
    with pytest.raises(ValueError, match="one per entry"):
        KVLayout(entries, 2, FP8, ((0.5, 0.5),))


def test_generate_takes_the_flag(model_dir, capsys):
    argv = ["generate", "--model", str(model_dir), "--prompt-ids", "5,6,7", "--max-tokens", "4", "--json"]
    assert main([*argv, "--kv-cache-dtype", "fp8"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 4
