"""CpuExpertExecutor against the torch reference executor, for every storage and kernel.

Two kinds of check, kept apart on purpose:
- kernel correctness: the executor on quantized weights equals the reference run on the
  *dequantized* weights (the same numbers), to float32 rounding for the native kernel;
- quantization error: against the unquantized reference, bounded by what the format can do.
"""

from __future__ import annotations

import pytest
import torch

from tandem.experts import native
from tandem.experts.base import ExpertWeights
from tandem.experts.cpu_executor import PREFILL_TOKENS, CpuExpertExecutor
from tandem.experts.factory import make_expert_executor
from tandem.experts.quant import dequantize
from tandem.experts.torch_executor import TorchExpertExecutor

E, H, I, K = 8, 256, 192, 2  # I = 192 is not a multiple of 128, so int4 uses groups of 32 or 64


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def layers():
    g = torch.Generator().manual_seed(0)
    # Scaled so activations stay O(1), like a trained model's.
    return {
        3: ExpertWeights(torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5),
        5: ExpertWeights(torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5),
    }


@pytest.fixture(scope="module")
def kernel_module():
    module = native.load_kernel()
    if module is None:
        if native.unavailable_reason() and "TANDEM_EXPERTS_NO_NATIVE" in native.unavailable_reason():
            pytest.skip("native kernel disabled by TANDEM_EXPERTS_NO_NATIVE=1")
        pytest.fail(f"native kernel failed to build: {native.unavailable_reason()}")
    return module


def batch(t: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else torch.empty(0, K).long()
    weights = torch.rand(t, K, generator=g)
    return hidden, ids, weights / weights.sum(-1, keepdim=True).clamp_min(1e-6)


def dequantized_reference(ex: CpuExpertExecutor, layer: int) -> TorchExpertExecutor:
    p = ex.layers[layer]
    return TorchExpertExecutor({layer: ExpertWeights(dequantize(p.gate_up), dequantize(p.down))})


# Tokens: 1 (decode), 5 (a tile of 4 plus 1), 40 (float weights: above prefill_tokens, the GEMM
# path), 400 (quantized weights: the GEMM path on dequantized experts). The thresholds are the
# storage's defaults, given, since some CPUs keep float experts on the kernel for longer (see
# test_float_experts_stay_on_the_kernel_for_prefill_where_torchs_gemm_is_the_slower).
@pytest.mark.parametrize("tokens", [1, 5, 40, 400])
@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_native_equals_reference_on_the_same_weights(layers, kernel_module, quant, tokens):
    ex = CpuExpertExecutor(layers, quant=quant, kernel="native", threads=2, prefill_tokens=PREFILL_TOKENS[quant])
    hidden, ids, weights = batch(tokens)
    got = ex.forward(5, hidden, ids, weights)
    want = dequantized_reference(ex, 5).forward(5, hidden, ids, weights)
    assert got.shape == (tokens, H) and got.dtype == torch.float32
    assert_kernel_close(got, want, quant, gemm=tokens > ex.prefill_tokens, isa=kernel_module.isa())


# Most tokens on one expert, one on each of a few others: the threads' shares of the gate_up rows
# are cut by work (moe_cpu.cpp's gate_up_ranges), so the cuts fall inside experts, at rows no
# row-count split would pick. Every thread count must give the reference's numbers, and the same
# ones to float32 rounding (a row lost or left to no thread would be zeros: far off).
@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_skewed_routing_splits_the_work_without_losing_a_row(layers, kernel_module, quant):
    hidden, _, weights = batch(37, seed=3)
    ids = torch.tensor([[0, 1 + t % 3] if t < 34 else [4 + t % 4, 7 - t % 4] for t in range(37)])
    outs = {}
    for threads in (1, 2, 3, 4):
        ex = CpuExpertExecutor(layers, quant=quant, kernel="native", threads=threads)
        outs[threads] = ex.forward(3, hidden, ids, weights)
    want = dequantized_reference(ex, 3).forward(3, hidden, ids, weights)
    for threads, got in outs.items():
        assert_kernel_close(got, want, quant, isa=kernel_module.isa())
        torch.testing.assert_close(got, outs[1], rtol=1e-5, atol=1e-5 * outs[1].abs().max().item(), msg=threads)


# The threads take each parallel region's work in chunks as they come free (moe_cpu.cpp's
# parallel_chunks): from one range a thread to 64 chunks a thread, with no floor on a chunk's bytes
# (these layers are far below the default's) and with the default floor, the cut must give the
# reference's numbers, and the same ones to float32 rounding (a row lost at a chunk's bound would
# be zeros, one computed twice into the down sums twice its value: far off either way).
@pytest.mark.parametrize("tokens", [1, 16, 31])
@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_every_cut_into_chunks_gives_the_same_numbers(layers, chunk_settings, quant, tokens):
    ex = CpuExpertExecutor(layers, quant=quant, kernel="native", threads=2)
    hidden, ids, weights = batch(tokens, seed=4)
    floor, outs = chunk_settings.chunk_bytes(), {}  # the default floor; put back after (conftest.py)
    for chunks, chunk_bytes in ((1, 0), (3, 0), (8, 0), (64, 0), (8, floor), (64, 4096)):
        chunk_settings.set_chunks_per_thread(chunks)
        chunk_settings.set_chunk_bytes(chunk_bytes)
        outs[chunks, chunk_bytes] = ex.forward(3, hidden, ids, weights)
    one = outs[1, 0]  # one range a thread
    assert_kernel_close(one, dequantized_reference(ex, 3).forward(3, hidden, ids, weights), quant,
                        isa=chunk_settings.isa())
    for chunks, got in outs.items():
        torch.testing.assert_close(got, one, rtol=1e-5, atol=1e-5 * one.abs().max().item(), msg=chunks)


def test_chunks_per_thread_out_of_range_are_refused(kernel_module):
    before = kernel_module.chunks_per_thread()
    for bad in (0, 65):
        with pytest.raises(RuntimeError, match="chunks per thread must be in 1..64"):
            kernel_module.set_chunks_per_thread(bad)
    assert kernel_module.chunks_per_thread() == before


def test_chunk_bytes_out_of_range_are_refused(kernel_module):
    before = kernel_module.chunk_bytes()
    for bad in (-1, (1 << 30) + 1):
        with pytest.raises(RuntimeError, match="chunk bytes must be in 0..2\\^30"):
            kernel_module.set_chunk_bytes(bad)
    assert kernel_module.chunk_bytes() == before


# The weight streams' software prefetch (moe_cpu.cpp's set_weight_prefetch) changes when bytes
# arrive, never which: every distance, none included, must give the same numbers exactly, on every
# instruction set this CPU runs (the AVX2 and AVX-512 kernels each call it from their own loops).
@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_every_weight_prefetch_distance_gives_the_same_numbers(layers, kernel_module, quant):
    ex = CpuExpertExecutor(layers, quant=quant, kernel="native", threads=2)
    hidden, ids, weights = batch(5, seed=6)
    isa, before = kernel_module.isa(), kernel_module.weight_prefetch()
    try:
        for target in kernel_module.supported_isas():
            kernel_module.set_isa(target)
            outs = {}
            for ahead in (0, 64, 1024, 8192):
                kernel_module.set_weight_prefetch(ahead)
                assert kernel_module.weight_prefetch() == ahead
                outs[ahead] = ex.forward(5, hidden, ids, weights)
            for ahead, got in outs.items():
                assert torch.equal(got, outs[0]), (target, ahead)
    finally:
        kernel_module.set_isa(isa)
        kernel_module.set_weight_prefetch(before)
    assert_kernel_close(outs[0], dequantized_reference(ex, 5).forward(5, hidden, ids, weights), quant,
                        isa=kernel_module.supported_isas()[-1])


def test_weight_prefetch_out_of_range_or_off_a_cache_line_is_refused(kernel_module):
    before = kernel_module.weight_prefetch()
    for bad in (-64, 100, 8256):
        with pytest.raises(RuntimeError, match="weight prefetch must be 0..8192 bytes, a multiple of 64"):
            kernel_module.set_weight_prefetch(bad)
    assert kernel_module.weight_prefetch() == before


def assert_kernel_close(got, want, quant: str, gemm: bool = False, isa: str = "") -> None:
    """f32 rounding, except int8/int4 rows on SIMD kernels, whose activations are quantized to
    int8 per 32 values as llama.cpp's Q8_0 (rounding error ~0.3% per value, well under 2% after
    two products; int4 rows on AVX2 per 256 values as Q8_K, ~1.3x that: under 3%); the scalar
    kernel and the GEMM path compute in f32."""
    if quant in ("int8", "int4") and not gemm and isa != "scalar":
        assert 0 < rel_err(got, want) < (3e-2 if quant == "int4" and isa == "avx2" else 2e-2)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=isa)


@pytest.mark.parametrize("group_size,h,i", [(32, 256, 192), (32, 96, 224), (32, 1024, 352), (64, 192, 320),
                                              (128, 384, 640)])
def test_int4_integer_scales_compute_what_fp16_scales_do(kernel_module, monkeypatch, group_size, h, i):
    # Where the kernel runs AVX2 the executor stores int4 scales as integers (to_integer_scales)
    # and the kernel sums in int32 over 256-blocks; against the float-scale kernel on the same
    # codes (and the same activation rounding) they differ by the scales' rounding and the
    # activations' int8 rounding flips between the two projections: well under 1%. Sizes: K = 96
    # is one superblock and a block, 224 three and a block (a last 256-run of 224), 352 five and
    # a half; groups of 64 and 128 share a scale between blocks (K = 192, 320: runs of 3 and 1).
    if "avx2" not in kernel_module.supported_isas():
        pytest.skip("no AVX2 on this CPU")
    monkeypatch.setattr(kernel_module, "isa", lambda: "avx2")  # what the executor asks, on any CPU
    g = torch.Generator().manual_seed(5)
    ramp = torch.linspace(0.05, 2.0, h)  # group scales spread along the rows
    w = {0: ExpertWeights(torch.randn(4, 2 * i, h, generator=g) * ramp / h**0.5, torch.randn(4, h, i, generator=g) / i**0.5)}
    integer = CpuExpertExecutor(w, quant="int4", group_size=group_size, kernel="native", threads=2)
    monkeypatch.setattr(CpuExpertExecutor, "_integer_scales", lambda self: False)
    fp16 = CpuExpertExecutor(w, quant="int4", group_size=group_size, kernel="native", threads=2)
    assert integer.layers[0].gate_up.integer_scales and not fp16.layers[0].gate_up.integer_scales
    monkeypatch.undo()
    before = kernel_module.isa()
    try:
        kernel_module.set_isa("avx2")
        for tokens in (1, 2, 5, 9):
            hidden = torch.randn(tokens, h, generator=g)
            ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(tokens)])
            weights = torch.rand(tokens, 2, generator=g)
            got, want = integer.forward(0, hidden, ids, weights), fp16.forward(0, hidden, ids, weights)
            assert rel_err(got, want) < 1e-2, tokens
    finally:
        kernel_module.set_isa(before)


@pytest.mark.parametrize("group_size", [64, 128])
def test_int4_groups_wider_than_a_block_on_every_instruction_set(kernel_module, group_size):
    # A group's scale covers 2 or 4 of the kernel's 32-blocks: the scale lookup differs from groups of 32.
    g = torch.Generator().manual_seed(4)
    i = 256  # a multiple of 128
    wide = {3: ExpertWeights(torch.randn(E, 2 * i, H, generator=g) / H**0.5, torch.randn(E, H, i, generator=g) / i**0.5)}
    ex = CpuExpertExecutor(wide, quant="int4", group_size=group_size, kernel="native", threads=2)
    assert_every_isa_matches_reference(kernel_module, ex, "int4", batch(5, seed=3))


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_every_instruction_set_gives_the_same_result(layers, kernel_module, quant):
    ex = CpuExpertExecutor(layers, quant=quant, kernel="native", threads=2)
    assert_every_isa_matches_reference(kernel_module, ex, quant, batch(6, seed=2))


def assert_every_isa_matches_reference(kernel_module, ex: CpuExpertExecutor, quant: str, routed, layer: int = 3):
    """Layer `layer` of `ex` on each instruction set this CPU has, against the dequantized reference."""
    hidden, ids, weights = routed
    want = dequantized_reference(ex, layer).forward(layer, hidden, ids, weights)
    before = kernel_module.isa()
    try:
        for isa in kernel_module.supported_isas():
            kernel_module.set_isa(isa)
            assert_kernel_close(ex.forward(layer, hidden, ids, weights), want, quant, isa=isa)
    finally:
        kernel_module.set_isa(before)


def test_unknown_instruction_set_is_refused(kernel_module):
    with pytest.raises(RuntimeError, match="not supported"):
        kernel_module.set_isa("avx1024")


def bf16_rounded_reference(w: ExpertWeights, hidden, ids, weights) -> torch.Tensor:
    """The experts with their activations rounded to bf16 before each projection (as a bf16
    model's own matmuls and llama.cpp's BF16 rows take them), products and sums in f32."""
    gate_up, down = w.gate_up.float(), w.down.float()
    inter = down.shape[2]
    x = hidden.bfloat16().float()
    out = torch.zeros(hidden.shape)
    for t in range(hidden.shape[0]):
        for e, wt in zip(ids[t].tolist(), weights[t].tolist()):
            h = gate_up[e] @ x[t]
            act = (torch.nn.functional.silu(h[:inter]) * h[inter:]).bfloat16().float()
            out[t] += wt * (down[e] @ act)
    return out


# Tokens 1, 5 and 7: the token tiles (4) and what is left of them; sizes whose K is whole 32-blocks
# and sizes with a tail past the last (h 112, intermediate 200: 16 and 8 left over).
@pytest.mark.parametrize("tokens", [1, 5, 7])
@pytest.mark.parametrize("h,i", [(H, I), (112, 200)])
def test_bf16_weights_run_unconverted(kernel_module, tokens, h, i):
    # f32 arithmetic on the bf16 rows on every instruction set but avx512bf16, which multiplies
    # them with bf16-rounded activations by vdpbf16ps: that one is held to the rounded reference.
    g = torch.Generator().manual_seed(3)
    w = ExpertWeights((torch.randn(E, 2 * i, h, generator=g) / h**0.5).bfloat16(),
                      (torch.randn(E, h, i, generator=g) / i**0.5).bfloat16())
    ex = CpuExpertExecutor({3: w}, kernel="native", threads=2)
    assert ex.layers[3].gate_up.dtype == torch.bfloat16  # streamed as 2 bytes per weight
    g = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, h, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    weights = torch.rand(tokens, K, generator=g)
    exact = TorchExpertExecutor({3: ExpertWeights(w.gate_up.float(), w.down.float())}).forward(3, hidden, ids, weights)
    rounded = bf16_rounded_reference(w, hidden, ids, weights)
    before = kernel_module.isa()
    try:
        for isa in kernel_module.supported_isas():
            kernel_module.set_isa(isa)
            got = ex.forward(3, hidden, ids, weights)
            want = rounded if isa == "avx512bf16" else exact
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item(), msg=isa)
    finally:
        kernel_module.set_isa(before)


def test_bf16_dense_rows_on_vdpbf16ps(kernel_module):
    # The dense kernel (attention projections and LM head of a bf16 model) rounds its activations
    # the same way on avx512bf16, through every row path: 4-row quarters and the rows past them.
    if "avx512bf16" not in kernel_module.supported_isas():
        pytest.skip("no AVX512_BF16 on this CPU")
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(67, 112, generator=g) / 112**0.5).bfloat16()
    before = kernel_module.isa()
    try:
        for tokens in (1, 3, 6):
            x = torch.randn(tokens, 112, generator=g)
            for isa, xs in (("avx512", x), ("avx512bf16", x.bfloat16().float())):
                kernel_module.set_isa(isa)
                out = torch.empty(tokens, 67)
                kernel_module.linear_forward(x, native.KIND_BF16, w, torch.Tensor(), out)
                want = xs @ w.float().T
                torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4 * want.abs().max().item(), msg=isa)
    finally:
        kernel_module.set_isa(before)


def test_float_experts_stay_on_the_kernel_for_prefill_where_torchs_gemm_is_the_slower(kernel_module, monkeypatch):
    from tandem.experts import cpu_executor

    g = torch.Generator().manual_seed(6)
    bf16 = {3: ExpertWeights((torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16(),
                             (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16())}
    f32 = {3: ExpertWeights(bf16[3].gate_up.float(), bf16[3].down.float())}
    kernel_limit, default = cpu_executor.FLOAT_KERNEL_PREFILL_TOKENS, PREFILL_TOKENS["none"]
    ex, ex32 = CpuExpertExecutor(bf16, kernel="native"), CpuExpertExecutor(f32, kernel="native")
    int8 = CpuExpertExecutor(f32, kernel="native", quant="int8")

    def on(isa: str, amx: bool, amd: bool) -> tuple[int, int, int]:
        # what the executor asks, on any CPU
        monkeypatch.setattr(ex.native, "isa", lambda: isa)
        monkeypatch.setattr(cpu_executor, "_has_amx", lambda: amx)
        monkeypatch.setattr(cpu_executor, "_mkl_on_amd", lambda: amd)
        return ex.prefill_tokens, ex32.prefill_tokens, int8.prefill_tokens

    assert on("avx512bf16", amx=False, amd=True) == (kernel_limit, kernel_limit, PREFILL_TOKENS["int8"])  # Zen 4
    assert on("avx512bf16", amx=True, amd=False) == (default, default, PREFILL_TOKENS["int8"])  # Sapphire Rapids
    assert on("avx512bf16", amx=False, amd=False) == (kernel_limit, default, PREFILL_TOKENS["int8"])
    assert on("avx512", amx=False, amd=True) == (default, kernel_limit, PREFILL_TOKENS["int8"])
    assert on("avx2", amx=False, amd=True) == (default, default, PREFILL_TOKENS["int8"])  # Zen 1 to 3: unmeasured
    assert CpuExpertExecutor(bf16, kernel="native", prefill_tokens=16).prefill_tokens == 16  # as given


def test_mkl_on_amd_reads_the_cpu_vendor():
    from tandem.experts import cpu_executor

    with open("/proc/cpuinfo") as f:
        amd = "AuthenticAMD" in f.read()
    assert cpu_executor._mkl_on_amd() == (amd and torch.backends.mkl.is_available())


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_torch_kernels_match_reference(layers, quant):
    # torch's int8/int4 GEMV ops take bf16 activations (8-bit mantissa, 0.4% rounding per
    # element), so this path is checked to 2%, the native kernel to float32 rounding.
    ex = CpuExpertExecutor(layers, quant=quant, kernel="torch", threads=2)
    hidden, ids, weights = batch(5)
    got = ex.forward(3, hidden, ids, weights)
    want = dequantized_reference(ex, 3).forward(3, hidden, ids, weights)
    assert rel_err(got, want) < (1e-6 if quant == "none" else 2e-2)


# Bounds against the unquantized model, for Gaussian weights (the worst case for a range
# quantizer: heavy-ish tails stretch the range). int8 per channel: step = max|w|/127, and
# max|w| over 256 Gaussians is ~3.3 sigma, so the rounding noise is 3.3/127/sqrt(12) = 0.75%
# of sigma per weight, ~1.3% after two products; bound 3%. int4 groups of 32: the range of
# 32 Gaussians is ~4 sigma, step 4/15 sigma, noise 7.7% per weight, ~14% after two
# products; bound 20%. Bigger groups have wider ranges, so more error.
@pytest.mark.parametrize("quant,bound", [("int8", 0.03), ("int4", 0.20)])
def test_quantization_error_is_bounded(layers, quant, bound):
    exact = TorchExpertExecutor(layers)
    ex = make_expert_executor(layers, quant=quant, threads=2)
    hidden, ids, weights = batch(16, seed=3)
    err = rel_err(ex.forward(3, hidden, ids, weights), exact.forward(3, hidden, ids, weights))
    assert 0 < err < bound


def test_int4_error_grows_with_group_size(layers):
    exact = TorchExpertExecutor(layers)
    hidden, ids, weights = batch(16, seed=4)
    want = exact.forward(5, hidden, ids, weights)
    errs = [rel_err(make_expert_executor(layers, quant="int4", group_size=g).forward(5, hidden, ids, weights), want)
            for g in (32, 64)]
    assert errs[0] < errs[1]


def test_bf16_hidden_gives_bf16_output(layers):
    ex = make_expert_executor(layers, threads=2)
    hidden, ids, weights = batch(2)
    got = ex.forward(3, hidden.bfloat16(), ids, weights)
    want = TorchExpertExecutor(layers).forward(3, hidden.bfloat16().float(), ids, weights)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_empty_batch(layers, kernel):
    ex = make_expert_executor(layers, kernel=kernel, threads=2)
    hidden, ids, weights = batch(0)
    assert ex.forward(3, hidden, ids, weights).shape == (0, H)


def test_threads_follow_the_argument(layers):
    before = torch.get_num_threads()
    try:
        ex = make_expert_executor(layers, threads=1)
        assert ex.threads == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_expert_nbytes_counts_what_decode_reads(layers):
    f32 = make_expert_executor(layers, quant="none").layers[3].expert_nbytes
    int8 = make_expert_executor(layers, quant="int8").layers[3].expert_nbytes
    int4_layer = make_expert_executor(layers, quant="int4").layers[3]
    assert f32 == 3 * H * I * 4
    assert int8 == 3 * H * I + (2 * I + H) * 4  # a byte per weight plus an f32 scale per row
    # half a byte plus a 2-byte scale and min per 32, and with integer scales an f32 factor per row
    row_factors = (2 * I + H) * 4 if int4_layer.gate_up.integer_scales else 0
    assert int4_layer.expert_nbytes == 3 * H * I // 2 + 2 * 2 * (3 * H * I // 32) + row_factors


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"quant": "int3"}, "unknown expert quantization"),
        ({"kernel": "gpu"}, "unknown expert kernel"),
        ({"threads": 0}, "threads must be a positive integer"),
        ({"quant": "int4", "group_size": 48}, "group size must be one of"),
        ({"quant": "int4", "group_size": 128}, "multiple of the group size"),  # I = 192
    ],
)
def test_bad_settings_are_refused(layers, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_expert_executor(layers, **kwargs)


def test_mismatched_weights_are_refused():
    bad = {0: ExpertWeights(torch.randn(4, 2 * I, H), torch.randn(4, H, I + 1))}
    with pytest.raises(ValueError, match="does not match gate_up"):
        make_expert_executor(bad)


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_bad_batches_are_refused(layers, kernel):
    ex = make_expert_executor(layers, kernel=kernel, threads=2)
    hidden, ids, weights = batch(2)
    with pytest.raises(ValueError, match="no routed experts for layer 4"):
        ex.forward(4, hidden, ids, weights)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 8\)"):
        ex.forward(3, hidden, ids + E, weights)
    with pytest.raises(ValueError, match="hidden must be"):
        ex.forward(3, hidden[:, :10], ids, weights)
    with pytest.raises(ValueError, match="must match topk_ids"):
        ex.forward(3, hidden, ids, weights[:, :1])


def test_without_the_native_kernel_auto_falls_back_and_native_refuses(layers, monkeypatch):
    monkeypatch.setattr(native, "load_kernel", lambda: None)
    monkeypatch.setattr(native, "unavailable_reason", lambda: "no compiler")
    assert make_expert_executor(layers, kernel="auto", threads=2).kernel == "torch"
    with pytest.raises(RuntimeError, match="native expert kernel unavailable: no compiler"):
        make_expert_executor(layers, kernel="native", threads=2)


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_sizes_off_the_vector_width_use_the_tails(kernel_module, quant):
    # H = 72 and I = 41 are not multiples of 16 (or 8): every kernel runs its scalar tail.
    g = torch.Generator().manual_seed(5)
    odd = {0: ExpertWeights(torch.randn(4, 82, 72, generator=g) / 8, torch.randn(4, 72, 41, generator=g) / 6)}
    ex = CpuExpertExecutor(odd, quant=quant, kernel="native", threads=2)
    hidden = torch.randn(5, 72, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]])
    weights = torch.rand(5, 2, generator=g)
    want = dequantized_reference(ex, 0).forward(0, hidden, ids, weights)
    before = kernel_module.isa()
    try:
        for isa in kernel_module.supported_isas():
            kernel_module.set_isa(isa)
            torch.testing.assert_close(ex.forward(0, hidden, ids, weights), want, rtol=1e-5, atol=1e-5, msg=isa)
    finally:
        kernel_module.set_isa(before)


FOUR_STREAM_CASES = [(h, i, dtype, quant) for h, i in [(78, 41), (72, 43), (256, 190)]
                     for dtype, quant in [(torch.float32, "none"), (torch.bfloat16, "none"), (torch.float32, "int8")]]
# int4 needs whole groups: K = 96 is three 32-blocks (a superblock tail on every ISA), 224 seven.
FOUR_STREAM_CASES += [(96, 224, torch.float32, "int4"), (224, 96, torch.float32, "int4"), (256, 192, torch.float32, "int4")]
# Several activation scales a row on AVX2 (256 values each, the last run shorter: 1120 = 4 x 256 + 96).
FOUR_STREAM_CASES += [(1120, 352, torch.float32, "int8"), (1120, 352, torch.float32, "int4")]


@pytest.mark.parametrize("h,i,dtype,quant", FOUR_STREAM_CASES)
def test_four_stream_walk_covers_every_remainder(kernel_module, h, i, dtype, quant):
    # The kernels walk a thread's rows as four parts in lockstep (gate_up: two halves of gate and
    # up rows; down: four quarters of the output columns), then finish the rows left over. These
    # sizes leave 0 to 3 rows over per thread and odd halves, for token counts that fill the
    # four-row tiles and leave 1 to 3 tokens over.
    g = torch.Generator().manual_seed(7)
    w = {0: ExpertWeights((torch.randn(4, 2 * i, h, generator=g) / h**0.5).to(dtype),
                          (torch.randn(4, h, i, generator=g) / i**0.5).to(dtype))}
    ex = CpuExpertExecutor(w, quant=quant, kernel="native", threads=2)
    ref = dequantized_reference(ex, 0)
    before = kernel_module.isa()
    try:
        for tokens in (1, 2, 3, 6, 9):
            hidden = torch.randn(tokens, h, generator=g)
            ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(tokens)])
            weights = torch.rand(tokens, 2, generator=g)
            want = ref.forward(0, hidden, ids, weights)
            # bf16 rows on vdpbf16ps take bf16-rounded activations (test_bf16_weights_run_unconverted)
            rounded = bf16_rounded_reference(w[0], hidden, ids, weights) if dtype == torch.bfloat16 else None
            for isa in kernel_module.supported_isas():
                kernel_module.set_isa(isa)
                assert_kernel_close(ex.forward(0, hidden, ids, weights),
                                    rounded if rounded is not None and isa == "avx512bf16" else want, quant, isa=isa)
    finally:
        kernel_module.set_isa(before)


@pytest.mark.parametrize("tokens", [1, 5])
def test_silu_of_large_gate_values_on_every_instruction_set(kernel_module, tokens):
    # The SIMD kernels compute silu(gate) * up with their own exp, 16 or 8 activations at a time
    # (a scalar std::exp for the rest). Gate values out to +-200 reach its clamps: e^x overflows
    # float32 past 88.7, and silu must still be ~x for large x and ~0 for very negative x.
    # I = 67 leaves odd halves and runs of the 16-row batches that end early.
    g = torch.Generator().manual_seed(11)
    h, i = 64, 67
    gate_up = torch.randn(4, 2 * i, h, generator=g) / h**0.5
    gate_up[:, :i] *= 40  # gate rows: pre-activations of tens to hundreds
    w = {0: ExpertWeights(gate_up, torch.randn(4, h, i, generator=g) / i**0.5)}
    ex = CpuExpertExecutor(w, quant="none", kernel="native", threads=2)
    hidden = torch.randn(tokens, h, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    gate = torch.einsum("th,eih->tei", hidden, gate_up[:, :i])
    assert gate.abs().max() > 100 and (gate < -90).any() and (gate > 90).any()
    want = dequantized_reference(ex, 0).forward(0, hidden, ids, weights)
    before = kernel_module.isa()
    try:
        for isa in kernel_module.supported_isas():
            kernel_module.set_isa(isa)
            got = ex.forward(0, hidden, ids, weights)
            assert torch.isfinite(got).all(), isa
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=isa)
    finally:
        kernel_module.set_isa(before)
