"""Attention read through block tables, in both KV tiers, against plain SDPA over each sequence's own K/V."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tandem.kv.attention import AttentionMetadata, paged_attention
from tandem.kv.block_manager import KVBlockManager
from tandem.kv.cache import CPU, DEVICE, KVCache, KVLayout
from tandem.kv.tiered import CpuBatch, LayerKV, LocalCpuAttention, StepAttention, attend_cpu_tier
from test_native_attention import scattered

HEADS, KV_HEADS, DIM = 4, 2, 8
SCALE = DIM**-0.5


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None) -> torch.Tensor:
    """q [n, H, D] at positions start.., over one sequence's k, v [L, Hkv, D] -> [n, H, Dv], in float64."""
    n, length = q.shape[0], k.shape[0]
    pos, key = torch.arange(start, start + n)[:, None], torch.arange(length)[None, :]
    mask = key <= pos
    if window is not None:
        mask &= key > pos - window
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))  # [H, L, D]
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1), k, v, attn_mask=mask, scale=SCALE)
    return out.transpose(0, 1)  # [n, H, Dv]


# (starts, query lens): prefill chunks (one from 0, one mid-sequence) and decode steps, with contexts
# that end inside a block, exactly at a block's end, and one token into a new block.
STEPS = [([0, 7], [5, 3]), ([10, 0], [6, 9]), ([4, 9, 14], [1, 1, 1]), ([0], [1])]


@pytest.mark.parametrize("starts, query_lens", STEPS)
@pytest.mark.parametrize("block_size", [4, 5])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_past_a_sequence_end_never_reach_its_output(starts, query_lens, block_size, window, dtype):
    """Every slot a sequence has not written (the rest of its last block, blocks other sequences
    own, block 0 where shorter tables are padded) holds NaN: the output must not see them."""
    lens = [s + n for s, n in zip(starts, query_lens)]
    tables, num_blocks = scattered(lens, extra_blocks=2, seed=block_size, block_size=block_size)
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.full((num_blocks, block_size, KV_HEADS, DIM), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    keys, values = [], []
    for table, n in zip(tables, lens):
        k, v = (torch.randn(n, KV_HEADS, DIM, generator=gen).to(dtype) for _ in range(2))
        for p in range(n):  # only the sequence's own slots
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        keys.append(k)
        values.append(v)
    q = torch.randn(sum(query_lens), HEADS, DIM, generator=gen).to(dtype)
    meta = AttentionMetadata.build(starts, query_lens, tables, block_size, torch.device("cpu"), window)
    # the engine's own choice of kernel (torch for chunks, native for float32 decode) and the CPU tier's
    for out in (paged_attention(q, k_cache, v_cache, meta, SCALE),
                attend_cpu_tier({"k": k_cache, "v": v_cache}, q, meta, SCALE)):
        assert not out.isnan().any()
        rows = 0
        for start, n, k, v in zip(starts, query_lens, keys, values):
            want = reference(q[rows:rows + n], k, v, start, window)
            torch.testing.assert_close(out[rows:rows + n].double(), want, rtol=0, atol=2e-2 if dtype != torch.float32
                                       else 1e-5)
            rows += n


def test_a_latent_cache_ignores_slots_past_a_sequence_end():
    """MLA's layout on the CPU tier (one latent shared by every head, its first numbers the value)."""
    block_size, width, value_dim = 4, 12, 8
    starts, query_lens = [3, 0], [4, 2]
    lens = [s + n for s, n in zip(starts, query_lens)]
    tables, num_blocks = scattered(lens, extra_blocks=3, seed=1, block_size=block_size)  # 2 + 1 blocks used
    latent = torch.full((num_blocks, block_size, width), float("nan"))
    gen = torch.Generator().manual_seed(1)
    own = []
    for table, n in zip(tables, lens):
        c = torch.randn(n, width, generator=gen)
        for p in range(n):
            latent[table[p // block_size], p % block_size] = c[p]
        own.append(c)
    q = torch.randn(sum(query_lens), HEADS, width, generator=gen)
    meta = AttentionMetadata.build(starts, query_lens, tables, block_size, torch.device("cpu"))
    out = attend_cpu_tier({"latent": latent}, q, meta, SCALE, value_dim=value_dim)
    rows = 0
    for start, n, c in zip(starts, query_lens, own):
        want = reference(q[rows:rows + n], c[:, None], c[:, None, :value_dim], start, None)
        torch.testing.assert_close(out[rows:rows + n].double(), want, rtol=0, atol=1e-5)
        rows += n


@pytest.mark.parametrize("block_size", [4, 3])
def test_a_context_moved_to_the_cpu_tier_attends_as_it_did_on_the_device(block_size):
    """One sequence prefilled in chunks on the device tier, moved whole to the CPU tier as the
    scheduler offloads it (block manager ids, then the cache's copy), decoding on there beside a
    sequence still on the device tier: each step's output equals SDPA over that sequence's K/V."""
    layout = KVLayout((("k", (KV_HEADS, DIM)), ("v", (KV_HEADS, DIM))), num_layers=2, dtype=torch.float32)
    cache = KVCache(layout, block_size, num_device_blocks=12, num_cpu_blocks=10, device="cpu")
    for tensors in cache.tiers.values():
        for t in tensors.values():
            t.fill_(float("nan"))  # nothing unwritten may be read, on either side of the move
    bm = KVBlockManager(12, 10, block_size)
    gen = torch.Generator().manual_seed(2)
    layer = 1
    kv = LayerKV.of(cache, layer)
    cpu_attention = LocalCpuAttention(cache)

    class Seq:
        def __init__(self, rid, n):
            self.request_id, self.all_token_ids, self.num_computed_tokens = rid, list(range(n)), 0
            self.k, self.v = torch.empty(0, KV_HEADS, DIM), torch.empty(0, KV_HEADS, DIM)

    def step(work: list[tuple[Seq, int]]):
        """Writes and attends num_new tokens of each sequence; checks every output."""
        for seq, n in work:
            assert bm.allocate_slots(seq, n)
        on_device = [(s, n) for s, n in work if bm.tier_of(s) == DEVICE]
        on_cpu = [(s, n) for s, n in work if bm.tier_of(s) == CPU]
        args = [([s.num_computed_tokens for s, _ in part], [n for _, n in part], [bm.block_table(s) for s, _ in part])
                for part in (on_device, on_cpu)]
        device_meta = AttentionMetadata.build(*args[0], block_size, torch.device("cpu")) if on_device else None
        cpu_batch = CpuBatch.build(*args[1], block_size) if on_cpu else None
        ordered = on_device + on_cpu
        new_k = [torch.randn(n, KV_HEADS, DIM, generator=gen) for _, n in ordered]
        new_v = [torch.randn(n, KV_HEADS, DIM, generator=gen) for _, n in ordered]
        q = torch.randn(sum(n for _, n in ordered), HEADS, DIM, generator=gen)
        attn = StepAttention(device_meta, cpu_batch, sum(n for _, n in on_device), cpu_attention)
        attn.write(kv, {"k": torch.cat(new_k), "v": torch.cat(new_v)})
        out = attn.attend(lambda rows: paged_attention(q[rows], kv.device["k"], kv.device["v"], device_meta, SCALE),
                          lambda rows: attn.attend_cpu(kv, q[rows], SCALE))
        rows = 0
        for (seq, n), k, v in zip(ordered, new_k, new_v):
            seq.k, seq.v = torch.cat([seq.k, k]), torch.cat([seq.v, v])
            want = reference(q[rows:rows + n], seq.k, seq.v, seq.num_computed_tokens, None)
            torch.testing.assert_close(out[rows:rows + n].double(), want, rtol=0, atol=1e-5)
            seq.num_computed_tokens += n
            rows += n

    moved, stays = Seq("moved", 40), Seq("stays", 40)
    step([(moved, 5), (stays, 2)])
    step([(moved, 2 * block_size), (stays, 1)])  # a chunk that ends on a block boundary
    pairs = bm.swap_out(moved)
    cache.swap(pairs, DEVICE, CPU)
    assert bm.tier_of(moved) == CPU and len(pairs) == math.ceil(moved.num_computed_tokens / block_size)
    for _ in range(2 * block_size + 1):  # decode on the CPU tier across block boundaries
        step([(moved, 1), (stays, 1)])
    step([(moved, 3)])  # a chunk on the CPU tier (offloaded mid-prefill)
