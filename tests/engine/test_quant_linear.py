"""int8 dense layers (`--dense-quant int8`): the layer against F.linear, the module swap, the
loader hook and the flag, and greedy quality with dense and expert weights both in int8."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_experts_quality import engine, teacher_forced_agreement
from torch import nn

from tandem.experts import native
from tandem.model import native_decode
from tandem.model.loader import load_model
from tandem.model.quant_linear import PREFILL_TOKENS, Int8Linear, Int8RowWeight, dense_nbytes, quantize_dense_

# Why 2%: a row's int8 step is max|w| / 127 and its rounding error is uniform, so the relative
# weight error is about max|w| / (127 sqrt(12) sigma), 0.7% for Gaussian rows of 1024 (max ~3.2
# sigma); Q8 activations (per 32 values, max ~2.2 sigma) add ~0.5%: ~0.9% together. A kernel that
# drops a scale, a block or a row is off by 10% or more.
BOUND = 0.02


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def gaussian_linear(n: int, k: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0.0, k**-0.5)
        if bias:
            layer.bias.normal_()
    return layer


@pytest.fixture(scope="module")
def kernel_module():
    module = native.load_kernel()
    if module is None:
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    return module


# Tokens: 1 (decode), 5 (a tile of 4 plus 1), 40 (several tiles), 257 (above PREFILL_TOKENS: the dequantized GEMM).
# Shapes: the benchmark's attention and head; 96 is K off the 64-byte vector step; 7 an odd N.
@pytest.mark.parametrize("n,k", [(1024, 1024), (500, 1024), (7, 96)])
@pytest.mark.parametrize("tokens", [1, 5, 40, PREFILL_TOKENS + 1])
def test_int8_linear_is_close_to_f_linear(n, k, tokens):
    layer = gaussian_linear(n, k, bias=True)
    q = Int8Linear(layer)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1))
    want = F.linear(x, layer.weight, layer.bias)
    got = q(x)
    assert got.shape == (tokens, n) and got.dtype == torch.float32
    assert 0 < rel_err(got, want) < BOUND
    # against the weights it actually holds, only activation rounding remains (none for GEMM)
    exact = F.linear(x, q.weight.dequantize(), layer.bias)
    assert rel_err(got, exact) < (1e-6 if tokens > PREFILL_TOKENS else 0.012)


def test_prefill_gemm_in_row_blocks_is_the_whole_gemm(monkeypatch):
    """Above prefill_tokens the weight is dequantized a block of rows at a time: blocks of 64 rows
    over 500 (a short last block) must give what one GEMM on the whole dequantized weight gives."""
    from tandem.model import quant_linear

    layer = gaussian_linear(500, 1024, bias=True)
    q = Int8Linear(layer)
    x = torch.randn(PREFILL_TOKENS + 1, 1024, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(quant_linear, "DEQUANT_BYTES", 4 * 1024 * 64)
    torch.testing.assert_close(q(x), F.linear(x, q.weight.dequantize(), layer.bias), rtol=1e-5, atol=1e-5)


def test_every_instruction_set_gives_the_same_dense_result(kernel_module):
    q = Int8Linear(gaussian_linear(66, 256))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    before = kernel_module.isa()
    try:
        kernel_module.set_isa("scalar")  # f32 math on the int8 rows: no activation rounding
        exact = q(x)
        torch.testing.assert_close(exact, F.linear(x, q.weight.dequantize()), rtol=1e-5, atol=1e-5)
        for isa in kernel_module.supported_isas():
            kernel_module.set_isa(isa)
            assert rel_err(q(x), exact) < 0.012, isa
    finally:
        kernel_module.set_isa(before)


@pytest.mark.parametrize("dtype,kind", [(torch.float32, 0), (torch.bfloat16, 1)])
def test_native_linear_in_float_storage_equals_f_linear(kernel_module, dtype, kind):
    w = torch.randn(37, 80, generator=torch.Generator().manual_seed(3)).to(dtype)
    x = torch.randn(6, 80, generator=torch.Generator().manual_seed(4))
    out = torch.empty(6, 37)
    kernel_module.linear_forward(x, kind, w, torch.empty(0), out)
    # bf16 rows on avx512bf16 multiply bf16-rounded activations (vdpbf16ps), as a bf16 model's matmuls do
    xs = x.bfloat16().float() if dtype == torch.bfloat16 and kernel_module.isa() == "avx512bf16" else x
    torch.testing.assert_close(out, F.linear(xs, w.float()), rtol=1e-5, atol=1e-4)


@pytest.fixture
def chunked(chunk_settings):
    """The kernel on two threads with no floor on a chunk's bytes (these tests' matrices are far below
    the default floor, which would leave one chunk a thread); the test sets chunks a thread. All three
    settings are restored after (chunk_settings, tests/engine/conftest.py)."""
    torch.set_num_threads(2)
    chunk_settings.set_chunk_bytes(0)
    return chunk_settings


# 2,113 rows cut into chunks the threads take as they come free (moe_cpu.cpp's parallel_chunks):
# from one range a thread to 64 chunks a thread, every row lands in its place (F.linear's): a row
# lost at a chunk's bound would stay NaN.
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_native_linear_cut_into_chunks_computes_every_row(chunked, tokens):
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(2113, 96, generator=g), torch.randn(tokens, 96, generator=g)
    for chunks in (1, 3, 8, 64):
        chunked.set_chunks_per_thread(chunks)
        out = torch.full((tokens, 2113), float("nan"))
        chunked.linear_forward(x, 0, w, torch.empty(0), out)
        torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4, msg=f"{chunks} chunks")


# int8 rows come out of the kernels unscaled, and each chunk scales its own rows afterwards: with
# any cut into chunks, every row is its unscaled product (the same rows under unit scales) times its
# scale, once: a row left unscaled, or scaled twice, at a chunk's bound would differ.
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_native_int8_linear_cut_into_chunks_scales_every_row_once(chunked, tokens):
    kernel = Int8Linear(gaussian_linear(2113, 96, seed=6)).kernel
    x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(7))

    def product(scale):
        out = torch.full((tokens, 2113), float("nan"))
        chunked.linear_forward(x, native.KIND_INT8, kernel.q, scale, out)
        return out

    unscaled = product(torch.ones_like(kernel.scale))
    for chunks in (1, 3, 8, 64):
        chunked.set_chunks_per_thread(chunks)
        torch.testing.assert_close(product(kernel.scale), unscaled * kernel.scale, rtol=0, atol=0,
                                   msg=f"{chunks} chunks")


def test_native_linear_refuses_bad_shapes(kernel_module):
    with pytest.raises(RuntimeError, match="out must be"):
        kernel_module.linear_forward(torch.randn(2, 8), 0, torch.randn(4, 8), torch.empty(0), torch.empty(2, 5))
    with pytest.raises(RuntimeError, match="f32, bf16 or int8"):
        kernel_module.linear_forward(torch.randn(2, 8), 3, torch.randn(4, 8), torch.empty(0), torch.empty(2, 4))


def test_bf16_activations_come_back_bf16_and_batches_keep_their_shape():
    q = Int8Linear(gaussian_linear(32, 64))
    x = torch.randn(2, 3, 64).bfloat16()
    y = q(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 32)
    assert rel_err(y, q(x.float().reshape(6, 64)).reshape(2, 3, 32)) < 0.01


def test_the_weight_stands_in_for_a_float_weight():
    layer = gaussian_linear(48, 64)
    q = Int8Linear(layer)
    w = q.weight
    assert isinstance(w, Int8RowWeight) and w.shape == (48, 64) and w.dtype == torch.float32
    x = torch.randn(1, 64)
    torch.testing.assert_close(F.linear(x, w), q(x))  # what CausalLM.compute_logits does with lm_head
    # any other function sees the dequantized float32 weight, never the raw int8 codes
    torch.testing.assert_close(w.sum(), q.weight.dequantize().sum())
    torch.testing.assert_close(torch.matmul(x, w.t()), F.linear(x, w.dequantize()))
    assert rel_err(w.dequantize(), layer.weight) < 0.01
    assert q.nbytes == 48 * 64 + 48 * 4


def test_swap_takes_attention_and_head_and_keeps_the_routers(demo_model_dir):
    model, _ = load_model(demo_model_dir("mixtral"), device="cpu")
    params_before = sum(p.numel() * p.element_size() for p in model.parameters())
    swapped = quantize_dense_(model, "int8")
    layer = model.model.layers[0]
    assert {"lm_head", "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj"} <= set(swapped)
    assert isinstance(layer.self_attn.k_proj, Int8Linear) and isinstance(model.lm_head, Int8Linear)
    assert type(layer.mlp.gate) is nn.Linear  # the router stays float32
    assert quantize_dense_(model, "int8") == []  # idempotent
    assert 0 < dense_nbytes(model) < params_before / 3


def test_swap_takes_shared_experts_and_dense_mlps_but_not_their_gate(demo_model_dir):
    model, _ = load_model(demo_model_dir("qwen2_moe"), device="cpu")
    swapped = set(quantize_dense_(model, "int8"))
    assert "model.layers.0.mlp.shared_expert.up_proj" in swapped  # layer 0: MoE with a shared expert
    assert "model.layers.1.mlp.down_proj" in swapped  # layer 1: a dense MLP (mlp_only_layers)
    assert "model.layers.0.mlp.shared_expert_gate" not in swapped and "model.layers.0.mlp.gate" not in swapped
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # qkv bias kept


def test_swap_leaves_tied_heads_and_raw_read_weights(demo_model_dir):
    llama, _ = load_model(demo_model_dir("llama"), device="cpu")
    assert "lm_head" not in quantize_dense_(llama, "int8")  # tied: the head is the embedding table
    deepseek, _ = load_model(demo_model_dir("deepseek_v3"), device="cpu")
    swapped = quantize_dense_(deepseek, "int8")
    assert not any(name.endswith("kv_b_proj") for name in swapped) and "lm_head" in swapped


@pytest.mark.parametrize("dense_quant", ["none", "int8"])
def test_compute_logits_takes_the_native_head_for_decode_batches(demo_model_dir, kernel_module, monkeypatch,
                                                                  dense_quant):
    model, _ = load_model(demo_model_dir("mixtral"), device="cpu", dense_quant=dense_quant)
    weight = model.lm_head.weight.dequantize() if dense_quant == "int8" else model.lm_head.weight
    calls = []
    real = kernel_module.linear_forward
    monkeypatch.setattr(kernel_module, "linear_forward", lambda *a: (calls.append(a[1]), real(*a))[1])
    # a GEMM through F.linear above the threshold: the decode batch's for a float head, the int8 kernel's own
    limit = PREFILL_TOKENS if dense_quant == "int8" else native_decode.DEFAULT_MAX_TOKENS
    for rows in (1, 5, 40, PREFILL_TOKENS + 1):
        hidden = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
        calls.clear()
        logits = model.compute_logits(hidden)
        assert logits.shape == (rows, weight.shape[0]) and logits.dtype == torch.float32
        # int8: against its own dequantized weight, where only the activations' Q8 rounding differs
        atol = 0.02 if dense_quant == "int8" else 1e-5
        torch.testing.assert_close(logits, F.linear(hidden, weight), rtol=0, atol=atol)
        assert calls == ([] if rows > limit else [native.KIND_INT8 if dense_quant == "int8" else native.KIND_F32])


def test_none_changes_nothing_and_unknown_modes_are_refused(demo_model_dir):
    model, _ = load_model(demo_model_dir("mixtral"), device="cpu")
    assert quantize_dense_(model, "none") == []
    with pytest.raises(ValueError, match="unknown dense quantization 'int3'"):
        quantize_dense_(model, "int3")


def test_the_loader_quantizes_when_asked(demo_model_dir):
    path = demo_model_dir("mixtral")
    model, _ = load_model(path, device="cpu", dense_quant="int8")
    assert isinstance(model.lm_head, Int8Linear)
    model, _ = load_model(path, device="cpu")
    assert type(model.lm_head) is nn.Linear
    with pytest.raises(ValueError, match="unknown dense quantization 'fp4'"):
        load_model(path, device="cpu", dense_quant="fp4")


def test_bad_modes_and_devices_are_refused_before_any_weight_loads(demo_model_dir, monkeypatch):
    # The int8 kernel is a CPU one: on a GPU the model would load whole and then fail.
    from tandem.model import loader

    monkeypatch.setattr(loader, "checkpoint_tensors", lambda *a, **kw: pytest.fail("weights were read"))
    path = demo_model_dir("mixtral")
    with pytest.raises(ValueError, match="dense quantization int8 runs on the CPU's int8 kernel, not on cuda"):
        load_model(path, device="cuda", dense_quant="int8")
    with pytest.raises(ValueError, match="unknown dense quantization 'fp4'"):
        load_model(path, device="cpu", dense_quant="fp4")


def test_generate_flag_quantizes_and_bad_values_exit_2(demo_model_dir, capsys, monkeypatch):
    from tandem.cli import main
    from tandem.engine import llm_engine

    asked = []
    real = llm_engine.load_model
    monkeypatch.setattr(llm_engine, "load_model", lambda *a, **kw: (asked.append(kw["dense_quant"]), real(*a, **kw))[1])
    path = str(demo_model_dir("mixtral"))
    argv = ["generate", "--model", path, "--prompt-ids", "5,6,7", "--max-tokens", "3", "--device", "cpu", "--json"]
    assert main(argv + ["--dense-quant", "int8"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3
    assert main(argv) == 0
    assert asked == ["int8", "none"]  # the flag reaches the loader, and nothing outlives the call
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--dense-quant", "int4"])
    assert exc.value.code == 2


# The quality model is the default demo Mixtral (transformers' initializer_range 0.02), over 16
# seeded prompts (192 teacher-forced positions; measured 97%). Not test_experts_quality's
# wider-init model: with weights of std 0.2 on a 64-wide model, attention and routing are so sharp
# that any weight error flips near-ties (there, one int8 projection alone flips 4% of positions,
# bf16 attention weights 1.6%, all dense int8 ~10%; llama.cpp's Q8_0 blocks of 32 barely better),
# which measures that random model, not the format.
def quality_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 380, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g).tolist()
            for _ in range(16)]


def test_dense_and_expert_int8_greedy_tokens_agree_with_float32(demo_model_dir):
    path = demo_model_dir("mixtral")
    reference, quantized = engine(path, "none"), engine(path, "int8", dense_quant="int8")
    assert isinstance(quantized.model.lm_head, Int8Linear)
    agreement = teacher_forced_agreement(reference, quantized, quality_prompts())
    assert agreement >= 0.95, f"{agreement:.0%} of positions agree"


def test_dense_int8_logits_error_is_bounded(demo_model_dir):
    # The swap works on any module tree: on transformers' own Mixtral it takes the same matrices
    # (attention, head; its router is `gate` too). Bound: 9 matrices of ~0.6% error each (K = 64),
    # uncorrelated, give ~1.8% on the logits; measured 2.0%; a broken layer gives 10% or more.
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(demo_model_dir("mixtral"), dtype=torch.float32).eval()
    ids = torch.randint(3, 380, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        assert len(quantize_dense_(model, "int8")) == 9
        got = model(ids).logits
    assert 0 < rel_err(got, want) < 0.04


# Q, K and V in one call (decode_layer.cpp's project): a thread's four quarters walk runs of rows
# (row_run4), each cut where a quarter reaches the end of its matrix. Odd sizes put matrix ends
# inside runs and quarters; on every instruction set and chunk count, every row of every matrix
# is its F.linear row (a run carried past a matrix's end would read its neighbour's rows, or past
# the last one).
@pytest.mark.parametrize("tokens", [1, 5])
def test_native_linear_multi_walks_runs_across_matrix_ends(chunked, tokens):
    g = torch.Generator().manual_seed(11)
    ws = [torch.randn(n, 64, generator=g) / 8 for n in (37, 5, 70, 1, 130)]
    x = torch.randn(tokens, 64, generator=g)
    before = chunked.isa()
    try:
        for isa in chunked.supported_isas():
            chunked.set_isa(isa)
            for chunks in (1, 3):
                chunked.set_chunks_per_thread(chunks)
                for kind, dtype in ((native.KIND_F32, torch.float32), (native.KIND_BF16, torch.bfloat16)):
                    stored = [w.to(dtype) for w in ws]
                    outs = [torch.full((tokens, w.shape[0]), float("nan")) for w in ws]
                    chunked.linear_forward_multi(x, kind, stored, [], outs)
                    bf16_acts = dtype == torch.bfloat16 and isa == "avx512bf16"  # vdpbf16ps rounds x
                    xs = x.bfloat16().float() if bf16_acts else x
                    for w, out in zip(stored, outs):
                        torch.testing.assert_close(out, F.linear(xs, w.float()), rtol=1e-5, atol=1e-4,
                                                   msg=f"{isa} {chunks} chunks {dtype} {w.shape[0]} rows")
    finally:
        chunked.set_isa(before)


@pytest.mark.parametrize("n", [1, 5, 66, 127, 1030])
def test_native_linear_rows_in_four_streams_match_f_linear(kernel_module, n):
    # Rows are walked as four quarters of each thread's range plus the rows left over: every
    # remainder, on every instruction set, in float32 and int8 storage.
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, 128, generator=g) / 128**0.5
    q = Int8Linear(gaussian_linear(n, 128, seed=n))
    before = kernel_module.isa()
    try:
        for isa in kernel_module.supported_isas():
            kernel_module.set_isa(isa)
            for tokens in (1, 3, 7):
                x = torch.randn(tokens, 128, generator=g)
                out = torch.empty(tokens, n)
                kernel_module.linear_forward(x, 0, w, torch.empty(0), out)
                torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4, msg=isa)
                assert rel_err(q(x), F.linear(x, q.weight.dequantize())) < BOUND, isa
    finally:
        kernel_module.set_isa(before)
