"""The native paged decode-attention kernel against the torch path (gather + SDPA) it replaces."""

from __future__ import annotations

import pytest
import torch

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
    # 34 query heads on 2 KV heads: GEMM-shaped, as MLA's 128 on 1; the torch path takes it.
    paged_attention(torch.randn(2, 34, 16), k, v, decode, 0.25)
    assert len(calls) == 2


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
