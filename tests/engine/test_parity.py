"""Numerics equal Hugging Face transformers on the same checkpoint: the test that matters.

Each architecture: a random-weight checkpoint written by transformers' own classes is loaded by
Tandem; greedy generation of 32+ tokens must be identical to transformers' `generate`, and the
logits of every step must agree (float32: max abs diff <= 1e-4).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.sampling_params import SamplingParams

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "llama"]
NEW_TOKENS = 40


def hf_greedy(model_dir, prompt, n, dtype=torch.float32, use_cache=True):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: always n tokens, nothing suppressed
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, use_cache=use_cache,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.stack([step[0].float() for step in out.logits])  # [n, V]
    return tokens, logits


def tandem_greedy(model_dir, prompts, n, dtype="float32", config=None, native_decode=True):
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", dtype=dtype, config=config or EngineConfig())
    engine.model.native_decode = native_decode
    logits = {}
    engine.runner.logits_hook = lambda rid, row: logits.setdefault(rid, []).append(row.clone())
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, params)
    return [r.token_ids for r in results], [torch.stack(logits[r.request_id]) for r in results], engine


def prompt_for(seed: int, length: int, vocab: int = 300) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def assert_float32_matches(model_dir, name: str, new_tokens: int = NEW_TOKENS, native_decode: bool = True,
                           use_cache: bool = True):
    """Greedy tokens identical to transformers' and every step's logits within 1e-4; returns the engine."""
    prompt = prompt_for(1, 11)
    ref_tokens, ref_logits = hf_greedy(model_dir, prompt, new_tokens, use_cache=use_cache)
    [tokens], [logits], engine = tandem_greedy(model_dir, [prompt], new_tokens, native_decode=native_decode)
    assert tokens == ref_tokens
    assert len(set(tokens)) > 3, "degenerate checkpoint: generation should not be one repeated token"
    diff = (logits - ref_logits).abs().max().item()
    assert diff <= 1e-4, f"{name}: max abs logit diff {diff:.2e}"
    return engine


# Architectures whose CPU decode steps run the native decode layer (tandem.model.native_decode).
NATIVE_DECODE_ARCHS = {"mixtral", "qwen2_moe", "qwen3_moe", "llama"}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_and_logits_match_transformers_float32(arch, demo_model_dir):
    engine = assert_float32_matches(demo_model_dir(arch, initializer_range=0.2), arch)
    path = engine.model.native_path
    if arch in NATIVE_DECODE_ARCHS:  # every decode step after the prefill took the native path
        assert path is not None and path.steps == NEW_TOKENS - 1
        assert path.greedy_steps == 0  # the logits hook watches: each step samples in Python
    else:
        assert path is None


@pytest.mark.parametrize("arch, overrides", [("mixtral", {}), ("qwen3_moe", {}), ("qwen2_moe", {}), ("llama", {}),
                                             ("mixtral", {"tie_word_embeddings": True})])
@pytest.mark.parametrize("steps", [1, 8])
def test_native_greedy_runs_match_transformers_float32(arch, overrides, steps, demo_model_dir):
    # Nothing watches the logits: every decode step is a native greedy run (embedding, layers, head and
    # argmax in one call; `steps` of them per engine step), with the head tied to the embedding or not.
    model_dir = demo_model_dir(arch, initializer_range=0.2, **overrides)
    prompt = prompt_for(1, 11)
    ref_tokens, _ = hf_greedy(model_dir, prompt, NEW_TOKENS)
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", dtype="float32",
                                       config=EngineConfig(num_scheduler_steps=steps))
    [result] = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert result.token_ids == ref_tokens
    assert engine.model.native_path.greedy_steps == NEW_TOKENS - 1


@pytest.mark.parametrize("arch", sorted(NATIVE_DECODE_ARCHS))
def test_torch_decode_path_matches_transformers_float32(arch, demo_model_dir):
    # The path the native one replaces still serves everything it cannot take (CUDA, MLA, shared experts, ...).
    engine = assert_float32_matches(demo_model_dir(arch, initializer_range=0.2), arch, native_decode=False)
    assert engine.model.native_path is None


def test_sliding_window_matches_transformers_float32(demo_model_dir):
    # A window shorter than the generation: the native kernel and transformers' mask both drop old keys.
    engine = assert_float32_matches(demo_model_dir("mixtral", initializer_range=0.2, sliding_window=8), "mixtral")
    assert engine.model.native_path.steps == NEW_TOKENS - 1


def test_qwen2_moe_slides_the_layers_its_layer_types_name(demo_model_dir, tmp_path):
    # transformers' Qwen2-MoE slides exactly the layers `layer_types` calls sliding_attention: here all.
    src = demo_model_dir("qwen2_moe", initializer_range=0.2, use_sliding_window=True, sliding_window=8)
    model_dir = shutil.copytree(src, tmp_path / "sliding")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(dict(config, layer_types=["sliding_attention"] * 2)))
    engine = assert_float32_matches(model_dir, "qwen2_moe")
    assert engine.model.cfg.sliding_window == 8


def test_llama_never_slides_whatever_its_config_holds(demo_model_dir):
    # transformers' Llama attends to every key (a stray sliding_window only makes its generate's cache
    # drop keys in decode steps, not the prefill's mask): the reference is its model without a cache.
    model_dir = demo_model_dir("llama", initializer_range=0.2, sliding_window=8)
    engine = assert_float32_matches(model_dir, "llama", use_cache=False)
    assert engine.model.cfg.sliding_window is None


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_bfloat16_tracks_transformers(arch, demo_model_dir):
    # bf16 keeps ~3 significant digits and the two sides sum in different orders (we accumulate
    # experts in float32), so logits agree to a few bf16 ulps and tokens agree until the reference
    # meets a near-tie (top-2 margin within that tolerance), after which the contexts may differ.
    assert_bfloat16_tracks(demo_model_dir(arch, initializer_range=0.2), tol=0.2)


def assert_bfloat16_tracks(model_dir, tol: float) -> None:
    """Logits within `tol` of transformers' bf16 run; tokens equal until the reference's top-2 margin < tol."""
    checked = 0
    for seed in range(2, 6):
        prompt = prompt_for(seed, 9)
        ref_tokens, ref_logits = hf_greedy(model_dir, prompt, 8, dtype=torch.bfloat16)
        [tokens], [logits], _ = tandem_greedy(model_dir, [prompt], 8, dtype="bfloat16")
        assert (logits[0] - ref_logits[0]).abs().max().item() < tol
        for i, ref in enumerate(ref_tokens):
            top2 = ref_logits[i].topk(2).values
            if top2[0] - top2[1] < tol:
                break
            assert tokens[i] == ref, f"prompt {seed}, position {i}"
            assert (logits[i] - ref_logits[i]).abs().max().item() < tol
            checked += 1
    assert checked >= 4, "too few positions without near-ties to say anything"


def bfloat16_copy(model_dir, out):
    """The checkpoint with its weights rounded to bf16 and saved as bf16, as Mixtral and Qwen ship."""
    transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).save_pretrained(out)
    return out


@pytest.mark.parametrize("arch", sorted(NATIVE_DECODE_ARCHS))
def test_bfloat16_checkpoints_decode_natively_closer_to_float32_than_the_torch_path(arch, demo_model_dir, tmp_path):
    # A bf16 checkpoint at its own dtype decodes on the native path: weights and KV cache bf16, the
    # arithmetic float32. The reference is transformers in float32 over the same bf16 weights (exact in
    # float32). The native steps differ from it only by the bf16 KV cache and the prefill's bf16
    # arithmetic, so they track it: tokens equal until the reference meets a near-tie, logits close. The
    # torch path rounds every op to bf16, as transformers' bf16 does, and a router near-tie can then send
    # a token to other experts (logits off by whole units): it tracks the reference less closely.
    model_dir = bfloat16_copy(demo_model_dir(arch, initializer_range=0.2), tmp_path / "bf16")
    errors: dict[bool, list[float]] = {True: [], False: []}
    checked = 0
    for seed in range(2, 6):
        prompt = prompt_for(seed, 9)
        ref_tokens, ref_logits = hf_greedy(model_dir, prompt, 8)
        runs = {}
        for native in (True, False):
            [tokens], [logits], engine = tandem_greedy(model_dir, [prompt], 8, dtype=None, native_decode=native)
            assert engine.model.model.embed_tokens.weight.dtype == torch.bfloat16  # the checkpoint's dtype
            path = engine.model.native_path
            assert (path.steps == 7) if native else (path is None)
            runs[native] = tokens, logits
        tokens, logits = runs[True]
        for i, ref in enumerate(ref_tokens):
            diff = (logits[i] - ref_logits[i]).abs().max().item()
            assert diff < 0.3, f"prompt {seed}, position {i}"
            if tokens[i] != ref:  # only where the reference's top two are closer than the error can move them
                top2 = ref_logits[i].topk(2).values
                assert top2[0] - top2[1] <= 2 * diff, f"prompt {seed}, position {i}"
                break  # the contexts part here
            checked += 1
        # Each path's mean error over the decode steps (step 0 is the prefill's, the same torch path on
        # both) whose context is still the reference's on both paths.
        for i in range(1, len(ref_tokens)):
            if any(run_tokens[:i] != ref_tokens[:i] for run_tokens, _ in runs.values()):
                break
            for native, (_, run_logits) in runs.items():
                errors[native].append((run_logits[i] - ref_logits[i]).abs().mean().item())
    assert checked >= 16 and len(errors[True]) >= 10, "too few positions without near-ties to say anything"
    native_error, torch_error = (sum(e) / len(e) for e in (errors[True], errors[False]))
    assert native_error < torch_error, f"native {native_error:.4f} against the torch path's {torch_error:.4f}"


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "llama"])
def test_batch_of_different_lengths_equals_each_alone(arch, demo_model_dir):
    model_dir = demo_model_dir(arch, initializer_range=0.2)
    prompts = [prompt_for(s, n) for s, n in [(3, 5), (4, 23), (5, 1), (6, 40)]]
    # A small block size and token budget force chunked prefill beside decodes.
    config = EngineConfig(block_size=4, max_num_batched_tokens=24)
    batched, batched_logits, _ = tandem_greedy(model_dir, prompts, 32, config=config)
    for prompt, tokens, logits in zip(prompts, batched, batched_logits):
        [alone], [alone_logits], _ = tandem_greedy(model_dir, [prompt], 32)
        assert tokens == alone
        assert (logits - alone_logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch, overrides", [("qwen3_moe", {"attention_bias": True}),
                                             ("llama", {"attention_bias": True}), ("llama", {"mlp_bias": True})])
@pytest.mark.parametrize("native_decode", [True, False])
def test_projection_biases_match_transformers_float32(arch, overrides, native_decode, demo_model_dir):
    # attention_bias: Q/K/V and O biases (added after the fused Q/K/V projection on the native path);
    # Llama's mlp_bias: the MLP's three. The demo checkpoints' biases are random, as trained ones are.
    engine = assert_float32_matches(demo_model_dir(arch, initializer_range=0.2, **overrides), arch,
                                    native_decode=native_decode)
    path = engine.model.native_path
    assert (path.steps == NEW_TOKENS - 1) if native_decode else path is None
    layer = engine.model.model.layers[0]
    biased = [layer.self_attn.q_proj, layer.self_attn.o_proj] if "attention_bias" in overrides else [layer.mlp.up_proj]
    assert all(linear.bias is not None and linear.bias.abs().sum() > 0 for linear in biased)
