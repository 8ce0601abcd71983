"""The Triton decode-attention and KV-write kernels against the torch path (gather + SDPA).

On the CPU the kernels run in Triton's interpreter, so shapes stay tiny; the CUDA tests run the
same checks compiled, and inside a CUDA graph, where a GPU is present.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

pytest.importorskip("triton")

from tandem.kv import fp8, triton_attention  # noqa: E402
from tandem.kv.attention import AttentionMetadata, sdpa_paged_attention  # noqa: E402
from tandem.kv.triton_attention import paged_decode_attention, write_kv  # noqa: E402

BS = 4
CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def decode_case(lens: list[int], kv_heads: int, group: int, head_dim: int, v_dim: int, window: int | None,
                dtype: torch.dtype = torch.float32, seed: int = 0, latent: bool = False) -> dict:
    """A decode batch over a shuffled block pool. Rows with length 0 are padding. The kernel's caches
    hold NaN everywhere a sequence may not read (spare blocks, the tails of last blocks, keys
    before a window), and padding rows' and stale table entries point at NaN blocks; the torch
    reference sees clean caches and only the real rows. With `latent`, V is a view of K's first
    `v_dim` numbers (MLA's cache: one latent per token is both)."""
    g = torch.Generator().manual_seed(seed)
    real = [i for i, n in enumerate(lens) if n > 0]
    need = [-(-n // BS) for n in lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    spare = perm[sum(need):]
    tables, used = [], 0
    for n in need:
        tables.append(perm[used:used + n])
        used += n
    k = torch.randn(num_blocks, BS, kv_heads, head_dim, generator=g).to(dtype)
    # V stored heads-major: a non-contiguous [blocks, BS, Hkv, Dv] view, as strided caches arrive
    v = torch.randn(num_blocks, kv_heads, BS, v_dim, generator=g).to(dtype).transpose(1, 2)
    if latent:
        v = k[..., :v_dim]
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g).to(dtype)

    ref = None
    if real:
        meta = AttentionMetadata.build([lens[i] - 1 for i in real], [1] * len(real), [tables[i] for i in real], BS,
                                       CPU, window)
        ref = sdpa_paged_attention(q[real].float(), k.float(), v.float(), meta, head_dim ** -0.5)  # [R, H, Dv]

    readable = torch.zeros(num_blocks * BS, dtype=torch.bool)
    for n, table in zip(lens, tables):
        for pos in range(max(0, n - window) if window else 0, n):
            readable[table[pos // BS] * BS + pos % BS] = True
    unreadable = ~readable.view(num_blocks, BS)
    k_poisoned, v_poisoned = k.clone(), v.clone()
    k_poisoned[unreadable] = float("nan")
    v_poisoned[unreadable] = float("nan")
    if latent:
        v_poisoned = k_poisoned[..., :v_dim]
    max_blocks = max(need) + 1
    block_tables = torch.tensor([t + [spare[0]] * (max_blocks - len(t)) for t in tables])  # [B, max_blocks] int64
    return dict(q=q, k=k_poisoned, v=v_poisoned, block_tables=block_tables, seq_lens=torch.tensor(lens), ref=ref,
                real=real, scale=head_dim ** -0.5, window=window or 0)


def run_case(case: dict, device: torch.device, out: torch.Tensor | None = None,
             partitions: int | None = None) -> torch.Tensor:
    args = [case[name].to(device) for name in ("q", "k", "v", "block_tables", "seq_lens")]
    return paged_decode_attention(*args, case["scale"], case["window"], out=out, partitions=partitions)


def check(case: dict, out: torch.Tensor, tol: float) -> None:
    lens = case["seq_lens"].tolist()
    assert out.dtype == case["q"].dtype and out.shape == (len(lens), case["q"].shape[1], case["v"].shape[-1])
    out = out.cpu().float()
    torch.testing.assert_close(out[case["real"]], case["ref"], rtol=tol, atol=tol)
    padding = [i for i, n in enumerate(lens) if n == 0]
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))


# Lengths: one token, exactly one block, many blocks ending mid-block (three loop steps of 64 keys);
# 0 is a padding row. Windows: across a block boundary, and across steps.
LENS = [1, 4, 0, 150]
SHAPES = [(2, 1, 16, 16), (1, 4, 64, 64), (2, 8, 24, 20)]  # KV heads, group, head dim, value dim


@pytest.mark.parametrize("kv_heads, group, head_dim, v_dim", SHAPES)
# 3 partitions: empty ranges for the short sequences, a partial last one for the long
@pytest.mark.parametrize("window, partitions", [(None, 1), (5, 1), (70, 1), (None, 3), (70, 3)])
def test_decode_matches_sdpa(kv_heads, group, head_dim, v_dim, window, partitions):
    case = decode_case(LENS, kv_heads, group, head_dim, v_dim, window)
    check(case, run_case(case, CPU, partitions=partitions), tol=1e-5)


# MLA's decode: every query head on one latent KV head, the value a view of the key. Groups of
# DOT_TILE heads or more are scored in tiles by matrix products: 16 is one tile, 20 a full and a
# partial one.
LATENT_SHAPES = [(1, 16, 40, 32), (1, 20, 24, 16), (2, 16, 24, 16)]  # KV heads, group, head dim, value dim


@pytest.mark.parametrize("kv_heads, group, head_dim, v_dim", LATENT_SHAPES)
@pytest.mark.parametrize("partitions", [1, 3])
# bf16 operands into float32 products, the probabilities rounded to bf16 (as flash attention does)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_latent_decode_in_head_tiles_matches_sdpa(kv_heads, group, head_dim, v_dim, partitions, dtype, tol):
    case = decode_case(LENS, kv_heads, group, head_dim, v_dim, None, dtype, latent=True)
    assert case["v"].data_ptr() == case["k"].data_ptr()
    check(case, run_case(case, CPU, partitions=partitions), tol)


# Grouped-query attention with 16 query heads a KV head (Qwen3-235B: 64 on 4) takes the tiles too,
# with a key of a power-of-two width: no rest after the main part.
@pytest.mark.parametrize("kv_heads, group, head_dim, v_dim, latent", [(2, 16, 32, 32, False), (1, 32, 64, 32, True)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_large_groups_with_power_of_two_keys_match_sdpa(kv_heads, group, head_dim, v_dim, latent, dtype, tol):
    case = decode_case(LENS, kv_heads, group, head_dim, v_dim, None, dtype, latent=latent)
    check(case, run_case(case, CPU, partitions=2), tol)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("partitions", [1, 2])
def test_half_precision_accumulates_in_float32(dtype, tol, partitions):
    case = decode_case(LENS, kv_heads=2, group=4, head_dim=24, v_dim=24, window=None, dtype=dtype)
    check(case, run_case(case, CPU, partitions=partitions), tol)


@pytest.mark.parametrize("partitions", [1, 2])
def test_writes_into_a_given_strided_out(partitions):
    case = decode_case(LENS, kv_heads=2, group=2, head_dim=16, v_dim=16, window=None)
    out = torch.full((len(LENS), 16, 4), float("nan")).transpose(1, 2)  # [B, H, Dv], not contiguous
    assert run_case(case, CPU, out=out, partitions=partitions) is out
    check(case, out, tol=1e-5)


@pytest.mark.parametrize("partitions", [1, 2])
def test_a_batch_of_only_padding_reads_nothing_and_gives_zeros(partitions):
    case = decode_case([0, 0], kv_heads=1, group=2, head_dim=16, v_dim=16, window=None)
    assert case["k"].isnan().all() and case["v"].isnan().all()
    out = run_case(case, CPU, partitions=partitions)
    assert torch.equal(out, torch.zeros_like(out))


def test_block_size_must_be_a_power_of_two():
    k = torch.randn(4, 6, 1, 16)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(torch.randn(1, 2, 16), k, k, torch.zeros(1, 1, dtype=torch.long),
                               torch.tensor([3]), 0.25)


@pytest.mark.parametrize("entry", [(2, 3), (3, 400)])  # 1,200 numbers a token: two programs each
def test_write_kv_writes_valid_slots_exactly_and_skips_negative_ones(entry):
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(5, BS, *entry, generator=g).to(torch.bfloat16)
    before = cache.clone()
    values = torch.randn(5, *entry, generator=g)  # float32 into a bf16 cache: converted as torch does
    slots = torch.tensor([6, -1, 0, -1, 19])
    write_kv(cache, slots, values)
    rows, expected = cache.view(-1, *entry), before.view(-1, *entry).clone()
    expected[slots[slots >= 0]] = values[slots >= 0].to(torch.bfloat16)
    assert torch.equal(rows, expected)


def test_without_triton_the_module_imports_and_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("triton_attention_without_triton", triton_attention.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not module.available("cuda")
    assert triton_attention.available("cuda") and not triton_attention.available("cpu")


@needs_cuda
@pytest.mark.parametrize("kv_heads, group, head_dim, v_dim", SHAPES + [(8, 4, 128, 128), (4, 8, 128, 128),
                                                                    (4, 16, 128, 128)])
@pytest.mark.parametrize("dtype, tol, window, partitions", [
    (torch.float32, 1e-5, None, None),  # None: chosen for the GPU (many, for this small batch)
    (torch.bfloat16, 2e-2, 70, 3),
    (torch.float16, 2e-3, 5, 1),
])
def test_decode_matches_sdpa_on_cuda(kv_heads, group, head_dim, v_dim, dtype, tol, window, partitions):
    case = decode_case(LENS, kv_heads, group, head_dim, v_dim, window, dtype)
    check(case, run_case(case, torch.device("cuda"), partitions=partitions), tol)


@needs_cuda
# DeepSeek-V3's shapes: 128 heads on a latent of 512 + 64 rope numbers, the value its first 512
@pytest.mark.parametrize("kv_heads, group, head_dim, v_dim", LATENT_SHAPES + [(1, 128, 576, 512)])
@pytest.mark.parametrize("dtype, tol, partitions", [(torch.float32, 1e-5, None), (torch.bfloat16, 2e-2, 3)])
def test_latent_decode_matches_sdpa_on_cuda(kv_heads, group, head_dim, v_dim, dtype, tol, partitions):
    case = decode_case(LENS, kv_heads, group, head_dim, v_dim, None, dtype, latent=True)
    check(case, run_case(case, torch.device("cuda"), partitions=partitions), tol)


@needs_cuda
def test_a_cuda_graph_replays_with_new_lengths_and_tables():
    cuda = torch.device("cuda")
    first = decode_case([5, 0, 9], kv_heads=2, group=4, head_dim=64, v_dim=64, window=None, seed=1)
    second = decode_case([12, 3, 0], kv_heads=2, group=4, head_dim=64, v_dim=64, window=None, seed=2)
    num_blocks = max(c["k"].shape[0] for c in (first, second))
    max_blocks = max(c["block_tables"].shape[1] for c in (first, second))
    q = torch.empty(3, 8, 64, device=cuda)
    k = torch.empty(num_blocks, BS, 2, 64, device=cuda)
    v = torch.empty(num_blocks, BS, 2, 64, device=cuda)
    tables = torch.zeros(3, max_blocks, dtype=torch.long, device=cuda)
    seq_lens = torch.zeros(3, dtype=torch.long, device=cuda)

    def load(case):  # in place: the graph reads these addresses
        blocks, width = case["k"].shape[0], case["block_tables"].shape[1]
        q.copy_(case["q"])
        k[:blocks].copy_(case["k"])
        v[:blocks].copy_(case["v"])
        tables[:, :width].copy_(case["block_tables"])
        seq_lens.copy_(case["seq_lens"])

    load(first)
    paged_decode_attention(q, k, v, tables, seq_lens, 0.125)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, k, v, tables, seq_lens, 0.125)
    for case in (first, second):
        load(case)
        graph.replay()
        check(case, out.clone(), tol=1e-5)


# fp8 caches (--kv-cache-dtype fp8): the kernel reads their bytes and converts them with integer
# operations (any GPU, and the interpreter here), the scales folded into the softmax scale and the output.

def fp8_decode_case(lens: list[int], kv_heads: int, group: int, head_dim: int, v_dim: int, window: int | None,
                    k_scale: float, v_scale: float, latent: bool = False, q_dtype: torch.dtype = torch.float32,
                    seed: int = 0, ref_dtype: torch.dtype = torch.float32) -> dict:
    """decode_case with e4m3 caches holding K / k_scale and V / v_scale (NaN bytes where nothing may be
    read), its reference the attention (in `ref_dtype`) of the query the kernel gets, rounded to
    `q_dtype`, over the values they hold."""
    case = decode_case(lens, kv_heads, group, head_dim, v_dim, window, seed=seed, latent=latent)
    k = fp8.quantize(case["k"] * 30, k_scale)  # numbers across e4m3's range, subnormals to saturation
    v = k[..., :v_dim] if latent else fp8.quantize(case["v"], v_scale)
    if latent:
        v_scale = k_scale  # one latent, one scale
    real = case["real"]
    meta = AttentionMetadata.build([lens[i] - 1 for i in real], [1] * len(real),
                                   [case["block_tables"][i, :-(-lens[i] // BS)].tolist() for i in real], BS, CPU,
                                   window)
    values = [t.to(ref_dtype).nan_to_num() * s for t, s in ((k, k_scale), (v, v_scale))]  # the poison is never read
    q = case["q"].to(q_dtype)
    ref = sdpa_paged_attention(q[real].to(ref_dtype), *values, meta, case["scale"]).float()
    return dict(case, q=q, k=k, v=v, ref=ref, k_scale=k_scale, v_scale=v_scale)


def run_fp8_case(case: dict, device: torch.device, partitions: int | None = None) -> torch.Tensor:
    args = [case[name].to(device) for name in ("q", "k", "v", "block_tables", "seq_lens")]
    return paged_decode_attention(*args, case["scale"], case["window"], k_scale=case["k_scale"],
                                  v_scale=case["v_scale"], partitions=partitions)


@pytest.mark.parametrize("kv_heads, group, head_dim, v_dim, latent", [
    (2, 4, 24, 20, False), (1, 16, 40, 32, False), (1, 20, 24, 16, True)])  # broadcast tiles, then tl.dot ones
@pytest.mark.parametrize("window, partitions", [(None, 1), (70, 3)])
@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.05, 7.0)])
def test_decode_over_fp8_blocks_matches_attention_over_their_values(kv_heads, group, head_dim, v_dim, latent, window,
                                                                    partitions, k_scale, v_scale):
    case = fp8_decode_case(LENS, kv_heads, group, head_dim, v_dim, window, k_scale, v_scale, latent)
    assert case["k"].dtype == torch.float8_e4m3fn and case["k"].view(torch.uint8).eq(0x7F).any()  # NaN poison
    check(case, run_fp8_case(case, CPU, partitions), tol=1e-5 * case["ref"].abs().max().item())


@pytest.mark.parametrize("capability, hip, native", [((8, 6), None, False), ((8, 9), None, True), ((9, 0), None, True),
                                                     ((9, 4), "6.2", False)])
def test_the_gpus_own_e4m3_conversion_is_taken_from_ada_on_and_never_on_rocm(capability, hip, native, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    triton_attention.native_fp8.cache_clear()
    try:
        assert triton_attention.native_fp8(torch.device("cuda")) is native
    finally:
        triton_attention.native_fp8.cache_clear()


def test_write_kv_copies_fp8_bytes():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(5, BS, 2, 3, generator=g).to(torch.float8_e4m3fn)
    before = cache.clone()
    values = fp8.quantize(torch.randn(3, 2, 3, generator=g) * 100, 0.5)
    slots = torch.tensor([6, -1, 19])
    write_kv(cache, slots, values)
    rows, expected = cache.view(torch.uint8).view(-1, 2, 3), before.view(torch.uint8).view(-1, 2, 3).clone()
    expected[slots[slots >= 0]] = values.view(torch.uint8)[slots >= 0]
    assert torch.equal(rows, expected)


@needs_cuda
@pytest.mark.parametrize("kv_heads, group, head_dim, v_dim, latent", [
    (8, 4, 128, 128, False), (4, 16, 128, 128, False), (1, 128, 576, 512, True)])
@pytest.mark.parametrize("q_dtype, tol, partitions", [(torch.float32, 1e-5, None), (torch.bfloat16, 2e-2, 3)])
@pytest.mark.parametrize("conversion", ["native", "integer"])  # the GPU's own e4m3 conversion (sm_89+), or not
def test_decode_over_fp8_blocks_on_cuda(kv_heads, group, head_dim, v_dim, latent, q_dtype, tol, partitions,
                                        conversion, monkeypatch):
    """Against float64. The saturated keys make MLA's 576-wide scores large (about 500 before the
    scale) and the softmax sharp, so float32 products summed in any order are off by more than 1e-5
    of the output there: the kernel in float32 must be within ten times torch's own float32 error
    (on an H100: 6.8 times for MLA's shape, 2 times for 16 heads on 128-wide keys)."""
    if conversion == "native" and not triton_attention.native_fp8(torch.device("cuda")):
        pytest.skip("the GPU's own e4m3 conversion needs compute capability 8.9")
    if conversion == "integer":
        monkeypatch.setattr(triton_attention, "native_fp8", lambda device: False)
    args = (LENS, kv_heads, group, head_dim, v_dim, None, 0.05, 7.0, latent, q_dtype)
    case = fp8_decode_case(*args, ref_dtype=torch.float64)
    f32_error = (fp8_decode_case(*args)["ref"] - case["ref"]).abs().max().item()
    tol = max(tol * case["ref"].abs().max().item(), 10 * f32_error if q_dtype == torch.float32 else 0.0)
    check(case, run_fp8_case(case, torch.device("cuda"), partitions), tol)


@needs_cuda
def test_fp8_kv_writes_and_decode_replay_in_a_cuda_graph():
    from tandem.kv.attention import write_kv as write_scaled

    cuda = torch.device("cuda")
    case = fp8_decode_case([5, 0, 9], 2, 4, 64, 64, None, 0.05, 7.0)
    q, k, v = case["q"].to(cuda), case["k"].to(cuda), case["v"].to(cuda)
    tables, seq_lens = case["block_tables"].to(cuda), case["seq_lens"].to(cuda)
    new_k = torch.randn(3, 2, 64, device=cuda)
    slots = torch.tensor([-1, -1, -1], device=cuda)  # nothing written: the reference stays the case's
    graph = torch.cuda.CUDAGraph()
    write_scaled(k, slots, new_k, 0.05)  # compiles outside the capture
    paged_decode_attention(q, k, v, tables, seq_lens, case["scale"], k_scale=0.05, v_scale=7.0)
    with torch.cuda.graph(graph):
        write_scaled(k, slots, new_k, 0.05)
        out = paged_decode_attention(q, k, v, tables, seq_lens, case["scale"], k_scale=0.05, v_scale=7.0)
    graph.replay()
    check(case, out.clone(), tol=1e-5 * case["ref"].abs().max().item())
    slots.copy_(torch.tensor([3, -1, 7], device=cuda))
    graph.replay()  # now writes two rows, e4m3 of new_k / 0.05
    rows = k.view(torch.uint8).view(-1, 2, 64)
    assert torch.equal(rows[[3, 7]], fp8.quantize(new_k[[0, 2]], 0.05).view(torch.uint8))
