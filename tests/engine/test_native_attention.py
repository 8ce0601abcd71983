"""The native paged decode-attention kernel against the torch path (gather + SDPA) it replaces."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.experts import native
from tandem.experts.native import load_kernel, unavailable_reason
from tandem.kv.attention import AttentionMetadata, native_decode_attention, paged_attention, sdpa_paged_attention

BS = 16


@pytest.fixture(scope="module")
def kernel():
    # make install builds it; a machine without a compiler falls back to torch, but this one has one.
    assert load_kernel() is not None, unavailable_reason()
    op = native_decode_attention()
    assert op is not None
    return op


def scattered(lens: list[int], extra_blocks: int = 3, seed: int = 0,
              block_size: int = BS) -> tuple[list[list[int]], int]:
    """(block tables over a shuffled pool, as a long-running cache leaves them; the pool's size)."""
    num_blocks = sum(-(-n // block_size) for n in lens) + extra_blocks
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for n in lens:
        need = -(-n // block_size)
        tables.append(perm[used:used + need])
        used += need
    return tables, num_blocks


def decode_with_threads(kernel, threads: int, q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return kernel(q, k, v, meta.block_tables, meta.seq_lens, scale, meta.sliding_window or 0)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads, head_dim, v_dim", [(8, 8, 64, 64), (12, 4, 32, 32), (16, 1, 72, 64)])
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_matches_the_torch_path(kernel, dtype, tol, heads, kv_heads, head_dim, v_dim, window, threads):
    # Sequences of 1 token, part of a block, many blocks and one ending on a block boundary; four
    # sequences fill two threads, so each is one chunk (the next test splits one into chunks).
    lens = [1, 7, 3000, 64]
    tables, num_blocks = scattered(lens)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(num_blocks, BS, kv_heads, head_dim, generator=g).to(dtype)
    if v_dim < head_dim:  # MLA's latent: the value is the key's first v_dim numbers (a view)
        v = k[..., :v_dim]
    else:
        v = torch.randn(num_blocks, BS, kv_heads, v_dim, generator=g).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata.build([n - 1 for n in lens], [1] * len(lens), tables, BS, torch.device("cpu"), window)
    out = decode_with_threads(kernel, threads, q, k, v, meta, 0.125)
    ref = sdpa_paged_attention(q.float(), k.float(), v.float(), meta, 0.125)
    assert out.dtype == dtype and out.shape == (len(lens), heads, v_dim)
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("heads, kv_heads, head_dim, v_dim", [
    (4, 2, 8, 8),  # narrower than one vector: all scalar tails
    (6, 3, 88, 88),  # full tiles of values, then single vectors, then a scalar tail (by build)
    (32, 1, 576, 512),  # MLA's latent cache: a wide group on one KV head, values a view of the keys
])
@pytest.mark.parametrize("lens, threads", [([3000], 2), ([5, 1100], 1)])  # [3000]: split into chunks, merged
@pytest.mark.parametrize("window", [None, 690])
def test_decode_matches_the_torch_path_over_head_shapes_and_chunks(kernel, heads, kv_heads, head_dim, v_dim, lens,
                                                                   threads, window):
    tables, num_blocks = scattered(lens, seed=2)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(num_blocks, BS, kv_heads, head_dim, generator=g)
    v = k[..., :v_dim] if v_dim < head_dim else torch.randn(num_blocks, BS, kv_heads, v_dim, generator=g)
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    meta = AttentionMetadata.build([n - 1 for n in lens], [1] * len(lens), tables, BS, torch.device("cpu"), window)
    out = decode_with_threads(kernel, threads, q, k, v, meta, head_dim ** -0.5)
    ref = sdpa_paged_attention(q, k, v, meta, head_dim ** -0.5)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)


def test_float32_decode_steps_take_the_kernel_and_the_rest_the_torch_path(kernel, monkeypatch):
    tables, num_blocks = scattered([20, 9])
    k, v = torch.randn(num_blocks, BS, 2, 16), torch.randn(num_blocks, BS, 2, 16)
    decode = AttentionMetadata.build([19, 8], [1, 1], tables, BS, torch.device("cpu"))
    calls = []
    monkeypatch.setattr("tandem.kv.attention._native_decode", lambda *a: calls.append(a[0].dtype) or kernel(*a))
    paged_attention(torch.randn(2, 4, 16), k, v, decode, 0.25)
    paged_attention(torch.randn(2, 4, 16, dtype=torch.bfloat16), k.bfloat16(), v.bfloat16(), decode, 0.25)
    assert calls == [torch.float32]
    paged_attention(torch.randn(2, 4, 16, dtype=torch.bfloat16), k.bfloat16(), v.bfloat16(), decode, 0.25,
                    native_any_dtype=True)  # the CPU tier's attention: no transformers run to track
    assert calls == [torch.float32, torch.bfloat16]
    # 34 query heads on 2 KV heads, a group as large as MLA's 128 on 1 makes relative to the tiles: native too.
    paged_attention(torch.randn(2, 34, 16), k, v, decode, 0.25)
    assert calls == [torch.float32, torch.bfloat16, torch.float32]


def test_prefill_chunks_take_the_torch_path(kernel, monkeypatch):
    tables, num_blocks = scattered([20, 9])
    k, v = torch.randn(num_blocks, BS, 2, 16), torch.randn(num_blocks, BS, 2, 16)
    q = torch.randn(7, 4, 16)
    meta = AttentionMetadata.build([15, 6], [5, 2], tables, BS, torch.device("cpu"))
    monkeypatch.setattr("tandem.kv.attention._native_decode", lambda *a: pytest.fail("native kernel on a prefill"))
    torch.testing.assert_close(paged_attention(q, k, v, meta, 0.25), sdpa_paged_attention(q, k, v, meta, 0.25))


def test_bad_shapes_are_refused_with_a_message(kernel):
    tables, num_blocks = scattered([5])
    k = torch.randn(num_blocks, BS, 3, 16)
    meta = AttentionMetadata.build([4], [1], tables, BS, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="query heads must be a multiple of KV heads"):
        kernel(torch.randn(1, 4, 16), k, k, meta.block_tables, meta.seq_lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="must share a dtype"):
        kernel(torch.randn(1, 3, 16, dtype=torch.bfloat16), k, k, meta.block_tables, meta.seq_lens, 1.0, 0)


# fp8 caches (--kv-cache-dtype fp8): e4m3 blocks converted to float as bf16 ones are, K / k_scale and
# V / v_scale stored, the scales folded into the query and the output.

@pytest.mark.parametrize("n", [256, 7, 8 * 33 + 5])  # every byte once; shorter than a vector; a tail
def test_fp8_blocks_convert_to_the_floats_torch_gives(kernel, n):
    data = torch.arange(256, dtype=torch.uint8).repeat(4)[:n]
    got = torch.ops.tandem.fp8_e4m3_to_float(data.view(torch.float8_e4m3fn))
    want = data.view(torch.float8_e4m3fn).to(torch.float32)
    nan = want.isnan()  # 0x7f and 0xff
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))  # bit for bit, -0.0 included


def fp8_case(heads, kv_heads, head_dim, v_dim, lens, seed=0):
    tables, num_blocks = scattered(lens, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    # numbers across e4m3's range: subnormals (below 2^-6), normals, up to the saturated 448
    k = (torch.randn(num_blocks, BS, kv_heads, head_dim, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    v = (k[..., :v_dim] if v_dim < head_dim else
         torch.randn(num_blocks, BS, kv_heads, v_dim, generator=g).mul(0.02).to(torch.float8_e4m3fn))
    q = torch.randn(len(lens), heads, head_dim, generator=g) * 0.01
    return q, k, v, tables


@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.003, 25.0)])
@pytest.mark.parametrize("heads, kv_heads, head_dim, v_dim", [(8, 2, 64, 64), (6, 3, 88, 88), (32, 1, 576, 512)])
@pytest.mark.parametrize("lens, threads, window", [([1, 7, 300, 64], 1, None), ([3000], 2, 690)])
@pytest.mark.parametrize("q_dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_decode_over_fp8_blocks_equals_attention_over_their_values(kernel, k_scale, v_scale, heads, kv_heads,
                                                                   head_dim, v_dim, lens, threads, window, q_dtype,
                                                                   tol):
    q, k, v, tables = fp8_case(heads, kv_heads, head_dim, v_dim, lens)
    q = q.to(q_dtype)
    meta = AttentionMetadata.build([n - 1 for n in lens], [1] * len(lens), tables, BS, torch.device("cpu"), window)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel(q, k, v, meta.block_tables, meta.seq_lens, 0.125, window or 0, k_scale, v_scale)
    finally:
        torch.set_num_threads(before)
    # the reference dequantizes: the blocks' values times their scales, in float32
    ref = sdpa_paged_attention(q.float(), k.float() * k_scale, v.float() * v_scale, meta, 0.125)
    assert out.dtype == q_dtype and out.shape == (len(lens), heads, v_dim)
    scale = ref.abs().max()
    torch.testing.assert_close(out.float() / scale, ref / scale, rtol=tol, atol=tol)
    # the torch path over the same fp8 blocks (what prefill chunks and GEMM-shaped groups take)
    torch.testing.assert_close(sdpa_paged_attention(q.float(), k, v, meta, 0.125, k_scale, v_scale) / scale,
                               ref / scale, rtol=2e-6, atol=2e-6)


def test_fp8_decode_steps_take_the_kernel_whatever_the_query_dtype(kernel, monkeypatch):
    q, k, v, tables = fp8_case(4, 2, 16, 16, [20, 9])
    decode = AttentionMetadata.build([19, 8], [1, 1], tables, BS, torch.device("cpu"))
    calls = []
    monkeypatch.setattr("tandem.kv.attention._native_decode", lambda *a: calls.append(a[0].dtype) or kernel(*a))
    for dtype in (torch.float32, torch.bfloat16):
        out = paged_attention(q.to(dtype), k, v, decode, 0.25, k_scale=0.5, v_scale=2.0)
        ref = sdpa_paged_attention(q.float(), k.float() * 0.5, v.float() * 2.0, decode, 0.25)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    assert calls == [torch.float32, torch.bfloat16]


def test_fp8_caches_come_in_pairs_and_scales_are_positive(kernel):
    q, k, v, tables = fp8_case(4, 2, 16, 16, [5])
    meta = AttentionMetadata.build([4], [1], tables, BS, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="or both caches be float8_e4m3fn"):
        kernel(q, k, v.float(), meta.block_tables, meta.seq_lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="k_scale and v_scale must be finite and > 0"):
        kernel(q, k, v, meta.block_tables, meta.seq_lens, 1.0, 0, 0.0, 1.0)


# Every cache dtype is read in place and widened in the kernels' registers (fp8 beyond 8 query heads a KV
# head: through a buffer), a tile of query heads by tokens or value vectors at a time (AVX2: 4 heads x 2
# tokens, 2 heads x 4, 1 x 4), then single tokens, single vectors and scalars at the edges.

CACHE_DTYPES = {"float32": (torch.float32, torch.float32), "bfloat16": (torch.bfloat16, torch.bfloat16),
                "float16": (torch.float16, torch.float16), "fp8": (torch.float8_e4m3fn, torch.float32)}


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
@pytest.mark.parametrize("group", [1, 3, 4, 7, 9])  # tiles of 4, 2 and 1 heads; fp8 widened beyond 8
# 36: vectors, then a scalar tail at every vector width; 112: a value's vectors past the whole tiles in
# one tile each of half, a quarter and an eighth of a tile's (7 of 16 lanes: 4 + 2 + 1; 14 of 8: 8 + 4 + 2)
@pytest.mark.parametrize("head_dim", [36, 112, 128])
@pytest.mark.parametrize("block_size, threads", [(16, 1), (5, 2)])
def test_every_cache_dtype_matches_the_torch_path_at_the_tiles_edges(kernel, cache, group, head_dim, block_size,
                                                                    threads):
    dtype, q_dtype = CACHE_DTYPES[cache]
    lens = [1, 2, 3, 5, 17, 61]  # 1 token, a tile's part, blocks' parts
    tables, num_blocks = scattered(lens, seed=4, block_size=block_size)
    g = torch.Generator().manual_seed(5)
    kv_heads = 2
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g).to(q_dtype)
    meta = AttentionMetadata.build([n - 1 for n in lens], [1] * len(lens), tables, block_size, torch.device("cpu"))
    out = decode_with_threads(kernel, threads, q, k, v, meta, head_dim ** -0.5)
    ref = sdpa_paged_attention(q.float(), k.float(), v.float(), meta, head_dim ** -0.5)
    tol = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}[q_dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("cache", ["bfloat16", "float16", "fp8"])
@pytest.mark.parametrize("group", [1, 9])  # fp8 at 9 query heads a KV head: widened through the buffer
def test_one_token_attention_returns_every_bit_pattern_as_torch_converts_it(kernel, cache, group):
    # Over one token the softmax weight is exactly 1, so the output is V's row as floats: every bit pattern
    # of the cache's dtype, in rows of 131 (16 vectors of 8 or 8 of 16, then scalars), NaN and inf included.
    dtype, q_dtype = CACHE_DTYPES[cache]
    bits = torch.arange(2 ** (8 * dtype.itemsize), dtype=torch.int32)
    patterns = (bits.to(torch.uint8) if dtype.itemsize == 1 else bits.to(torch.int16)).view(dtype)
    width = 131
    rows = -(-patterns.numel() // width)
    v = torch.cat([patterns, patterns[:rows * width - patterns.numel()]]).view(rows, 1, 1, width)
    k = torch.zeros(rows, 1, 1, width).to(dtype)
    q = torch.randn(rows, group, width).to(q_dtype)
    meta = AttentionMetadata.build([0] * rows, [1] * rows, [[b] for b in range(rows)], 1, torch.device("cpu"))
    out = kernel(q, k, v, meta.block_tables, meta.seq_lens, 1.0, 0)
    want = v.view(rows, 1, width).to(q_dtype).expand(rows, group, width)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)  # 0.0 and -0.0 alike: acc starts at 0


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
@pytest.mark.parametrize("heads, head_dim, v_dim", [(128, 576, 512), (16, 72, 64)])  # MLA; a narrow latent
def test_latent_caches_of_every_dtype_match_the_torch_path(kernel, cache, heads, head_dim, v_dim):
    dtype, q_dtype = CACHE_DTYPES[cache]
    lens = [1, 37, 700]
    tables, num_blocks = scattered(lens, seed=6)
    g = torch.Generator().manual_seed(7)
    k = torch.randn(num_blocks, BS, 1, head_dim, generator=g).to(dtype)
    v = k[..., :v_dim]
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(q_dtype)
    meta = AttentionMetadata.build([n - 1 for n in lens], [1] * len(lens), tables, BS, torch.device("cpu"))
    out = decode_with_threads(kernel, 2, q, k, v, meta, head_dim ** -0.5)
    ref = sdpa_paged_attention(q.float(), k.float(), v.float(), meta, head_dim ** -0.5)
    tol = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}[q_dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


# The baseline x86-64 build (no AVX2: the kernels on 4-float vectors, integer conversions) never runs on a
# machine that has AVX2. A small program calls its templates directly, beside the build this CPU picks.
BASELINE_CHECK = r"""
#include "attention_blocks.h"

#include <cstdio>
#include <vector>

using namespace tandem::attention;

static uint32_t state = 1;
static uint32_t random_bits() { return (state = state * 1664525u + 1013904223u) >> 8; }
static float random_float() { return (random_bits() % 2001) / 1000.f - 1.f; }
template <class E> E random_element();
template <> float random_element() { return random_float(); }
template <> bf16 random_element() { return bf16{uint16_t(bit_cast<uint32_t>(random_float()) >> 16)}; }
template <> fp16 random_element() {  // subnormals up to 4, no inf or NaN
  return fp16{uint16_t((random_bits() & 1) << 15 | (random_bits() % 18) << 10 | (random_bits() & 0x3ff))};
}
template <> fp8_e4m3 random_element() {  // no NaN
  uint8_t b;
  do b = random_bits() & 0xff; while ((b & 0x7f) == 0x7f);
  return fp8_e4m3{b};
}

static float worst = 0;
static void compare(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]) / (1 + std::abs(b[i])));
}

// One block of n tokens through the baseline build's scores, softmax and values, and through the build
// this CPU picks (multiversioning), for Hkv KV heads of g query heads each.
template <class E>
static void one_block(int64_t Hkv, int64_t g, int64_t D, int64_t Dv, int64_t n) {
  const int64_t H = Hkv * g;
  std::vector<E> k(n * Hkv * D), v(n * Hkv * Dv);
  for (auto& x : k) x = random_element<E>();
  for (auto& x : v) x = random_element<E>();
  std::vector<float> q(H * D), buf(n * std::max(D, Dv)), s0(H * n), s1(H * n);
  for (auto& x : q) x = random_float();
  block_scores_v<v4f>(q.data(), Hkv, g, D, k.data(), Hkv * D, D, n, nullptr, buf.data(), s0.data(), n);
  block_scores(q.data(), Hkv, g, D, k.data(), Hkv * D, D, n, nullptr, buf.data(), s1.data(), n);
  compare(s0, s1);
  std::vector<float> m0(H), l0(H), m1(H), l1(H), acc0(H * Dv), acc1(H * Dv);
  softmax_rows_v<v4f>(s0.data(), H, n, n, m0.data(), l0.data());
  softmax_rows(s1.data(), H, n, n, m1.data(), l1.data());
  compare(s0, s1), compare(l0, l1);
  block_values_v<v4f>(acc0.data(), Hkv, g, Dv, v.data(), Hkv * Dv, Dv, n, nullptr, buf.data(), s1.data(), n);
  block_values(acc1.data(), Hkv, g, Dv, v.data(), Hkv * Dv, Dv, n, nullptr, buf.data(), s1.data(), n);
  compare(acc0, acc1);
}

// Every bit pattern of E through the baseline build's vector loader and the scalar one (the tails'), as
// floats times kUnit, written to `out`.
template <class E, class Bits>
static void every_pattern(FILE* out) {
  const size_t count = size_t{1} << (8 * sizeof(Bits));
  std::vector<float> vector(count), scalar(count);
  for (size_t i = 0; i < count; i += 4) {
    Bits bits[4] = {Bits(i), Bits(i + 1), Bits(i + 2), Bits(i + 3)};
    const v4f x = load_row(reinterpret_cast<const E*>(bits), As<v4f>{}) * kUnit<E>;
    for (int j = 0; j < 4; ++j) vector[i + j] = x[j];
    for (int j = 0; j < 4; ++j) scalar[i + j] = element(reinterpret_cast<const E*>(bits) + j) * kUnit<E>;
  }
  fwrite(vector.data(), sizeof(float), count, out);
  fwrite(scalar.data(), sizeof(float), count, out);
}

int main(int, char** argv) {
  const int64_t shapes[][5] = {{2, 1, 36, 36, 13}, {2, 3, 36, 36, 16}, {1, 8, 100, 100, 7}, {3, 5, 8, 8, 16},
                               {2, 4, 128, 128, 16}, {1, 32, 72, 64, 16}, {1, 2, 4, 4, 1}};
  for (const auto& s : shapes) {
    one_block<float>(s[0], s[1], s[2], s[3], s[4]);
    one_block<bf16>(s[0], s[1], s[2], s[3], s[4]);
    one_block<fp16>(s[0], s[1], s[2], s[3], s[4]);
    one_block<fp8_e4m3>(s[0], s[1], s[2], s[3], s[4]);
  }
  FILE* out = fopen(argv[1], "wb");
  every_pattern<fp8_e4m3, uint8_t>(out);
  every_pattern<bf16, uint16_t>(out);
  every_pattern<fp16, uint16_t>(out);
  fclose(out);
  printf("%g\n", worst);
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_the_baseline_build_converts_and_computes_as_the_build_in_use(tmp_path):
    (tmp_path / "check.cpp").write_text(BASELINE_CHECK)
    csrc = Path(native.__file__).parent / "csrc"
    subprocess.run(["g++", "-O2", "-std=c++17", "-fopenmp-simd", f"-I{csrc}", "check.cpp", "-o", "check"],
                   cwd=tmp_path, check=True, capture_output=True)
    run = subprocess.run([str(tmp_path / "check"), str(tmp_path / "patterns")], check=True, capture_output=True,
                         text=True)
    assert float(run.stdout) < 1e-5  # relative, over scores, softmax numerators and sums, and values
    floats = torch.from_numpy(np.fromfile(tmp_path / "patterns", dtype=np.float32))
    for dtype, count in [(torch.float8_e4m3fn, 256), (torch.bfloat16, 65536), (torch.float16, 65536)]:
        bits = torch.arange(count, dtype=torch.int32)
        want = (bits.to(torch.uint8) if count == 256 else bits.to(torch.int16)).view(dtype).float()
        for got in floats[:count], floats[count:2 * count]:  # the vector loader, the scalar one
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got[~want.isnan()].view(torch.int32), want[~want.isnan()].view(torch.int32))
        floats = floats[2 * count:]


@pytest.mark.parametrize("group", [4, 9])  # rows checked for NaN, then widened without the check; widened first
# Rows of 44: the NaN check reads 32 bytes, then 12 one by one; AVX2's loaders 5 vectors of 8, then 4 scalars.
@pytest.mark.parametrize("dim", [1, 35, 42])
def test_a_nan_in_fp8_blocks_reaches_the_output_as_in_torch(kernel, group, dim):
    q, k, v, tables = fp8_case(2 * group, 2, 44, 44, [40, 23], seed=8)
    k[tables[1][1], 3, 0, dim] = float("nan")  # sequence 1, token 19, KV head 0: its group's scores
    v[tables[0][0], 5, 1, dim] = float("nan")  # sequence 0, token 5, KV head 1: its group's number `dim`
    meta = AttentionMetadata.build([39, 22], [1, 1], tables, BS, torch.device("cpu"))
    out = kernel(q, k, v, meta.block_tables, meta.seq_lens, 0.125, 0)
    ref = sdpa_paged_attention(q, k.float(), v.float(), meta, 0.125)
    assert ref.isnan().any()
    assert torch.equal(out.isnan(), ref.isnan())
    torch.testing.assert_close(out.nan_to_num(), ref.nan_to_num(), rtol=2e-6, atol=2e-6)
