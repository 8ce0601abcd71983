"""KVBlockManager step by step: allocate, grow, free, prefix hits, LRU eviction, swapping, exhaustion,
freeing the blocks before a sliding window."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.kv.block_manager import CPU, DEVICE, FREED_BLOCK_ID, KVBlockManager

BS = 4


@dataclass
class Seq:
    """The three attributes the block manager reads from a sequence."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def state(bm: KVBlockManager) -> tuple:
    """Everything observable, to compare before and after a refused call (None: a block freed
    before a sliding window, its place kept)."""
    return (bm.num_free_blocks(DEVICE), bm.num_free_blocks(CPU),
            bm._pools[DEVICE].free_block_ids(), bm._pools[CPU].free_block_ids(),
            {rid: [None if b is None else b.block_id for b in t] for rid, t in bm._tables.items()},
            [b.ref_count for b in bm._pools[DEVICE].blocks], bm.prefix_cache_hit_tokens)


def prefill(bm: KVBlockManager, seq: Seq) -> int:
    """Admit a sequence as the scheduler does, compute its whole prompt, register its full blocks."""
    blocks, cached = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, len(seq.all_token_ids) - cached, blocks)
    seq.num_computed_tokens = len(seq.all_token_ids)
    bm.cache_full_blocks(seq)
    return cached


def test_allocate_and_grow_across_a_block_boundary():
    bm = KVBlockManager(8, 0, BS)
    seq = Seq("a", tokens(6))
    assert bm.allocate_slots(seq, 6)
    assert bm.block_table(seq) == [0, 1]
    assert (bm.num_used_blocks(DEVICE), bm.num_free_blocks(DEVICE)) == (2, 6)
    seq.num_computed_tokens = 6
    seq.all_token_ids += [100, 101]
    assert bm.allocate_slots(seq, 2)  # slots 6, 7 fit in block 1
    assert bm.block_table(seq) == [0, 1]
    seq.num_computed_tokens = 8
    seq.all_token_ids.append(102)
    assert bm.allocate_slots(seq, 1)  # slot 8 opens block 2
    assert bm.block_table(seq) == [0, 1, 2]
    assert bm.num_used_blocks(DEVICE) == 3


def test_free_restores_counts_and_drops_the_table():
    bm = KVBlockManager(8, 0, BS)
    seq = Seq("a", tokens(9))
    assert bm.allocate_slots(seq, 9)
    bm.free(seq)
    assert bm.block_table(seq) == []
    assert bm.num_free_blocks(DEVICE) == bm.num_total_blocks(DEVICE) == 8
    assert all(b.ref_count == 0 for b in bm._pools[DEVICE].blocks)
    bm.free(seq)  # a second free is harmless
    assert bm.num_free_blocks(DEVICE) == 8


def test_prefix_hit_reuses_block_ids_and_counts_hit_tokens():
    bm = KVBlockManager(16, 0, BS)
    first = Seq("a", tokens(10))
    assert prefill(bm, first) == 0
    assert bm.prefix_cache_hit_tokens == 0
    second = Seq("b", tokens(8) + [900, 901, 902])  # shares two full blocks
    blocks, cached = bm.get_computed_blocks(second)
    assert cached == 8
    assert [b.block_id for b in blocks] == bm.block_table(first)[:2]
    assert bm.allocate_slots(second, 3, blocks)
    assert bm.block_table(second)[:2] == bm.block_table(first)[:2]
    assert bm.block_table(second)[2] not in bm.block_table(first)
    assert bm.prefix_cache_hit_tokens == 8
    assert bm.prefix_cache_queries == 10 + 11
    shared = bm._pools[DEVICE].blocks[bm.block_table(first)[0]]
    assert shared.ref_count == 2


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = KVBlockManager(16, 0, BS)
    prefill(bm, Seq("a", tokens(8)))
    again = Seq("b", tokens(8))
    blocks, cached = bm.get_computed_blocks(again)
    assert cached == 4 and len(blocks) == 1  # block 2 would leave nothing to compute
    assert bm.allocate_slots(again, 4, blocks)
    assert len(bm.block_table(again)) == 2


def test_partial_blocks_are_never_cached():
    bm = KVBlockManager(16, 0, BS)
    prefill(bm, Seq("a", tokens(7)))
    assert bm.get_computed_blocks(Seq("b", tokens(7) + [5]))[1] == 4


def test_hashes_chain_so_an_equal_block_after_a_different_prefix_misses():
    bm = KVBlockManager(16, 0, BS)
    prefill(bm, Seq("a", [1, 1, 1, 1, 2, 2, 2, 2, 0]))
    assert bm.get_computed_blocks(Seq("b", [3, 3, 3, 3, 2, 2, 2, 2, 0]))[1] == 0


@dataclass
class SaltedSeq(Seq):
    cache_salt: str | None = None


def test_a_salt_shares_blocks_only_among_sequences_with_the_same_salt():
    bm = KVBlockManager(32, 0, BS)
    prompt = tokens(9)  # two full blocks
    assert prefill(bm, SaltedSeq("a", prompt, cache_salt="tenant-a")) == 0
    assert bm.get_computed_blocks(SaltedSeq("a2", prompt, cache_salt="tenant-a"))[1] == 8
    assert bm.get_computed_blocks(SaltedSeq("b", prompt, cache_salt="tenant-b"))[1] == 0
    assert bm.get_computed_blocks(Seq("none", prompt))[1] == 0
    # Nor the other way: an unsalted prefix is no salted sequence's.
    assert prefill(bm, Seq("plain", prompt)) == 0
    assert bm.get_computed_blocks(Seq("plain2", prompt))[1] == 8
    assert bm.get_computed_blocks(SaltedSeq("c", prompt, cache_salt="tenant-c"))[1] == 0


def test_freed_blocks_stay_cached_until_reused_in_lru_order():
    bm = KVBlockManager(4, 0, BS)
    old, new = Seq("old", tokens(5)), Seq("new", tokens(5, start=50))
    prefill(bm, old)  # blocks 0 (full, cached), 1 (partial)
    prefill(bm, new)  # blocks 2 (full, cached), 3 (partial)
    bm.free(old)
    bm.free(new)
    # unhashed partial blocks first, then cached blocks from least recently freed
    assert bm._pools[DEVICE].free_block_ids() == [3, 1, 0, 2]
    assert bm.get_computed_blocks(Seq("x", tokens(5)))[1] == 4  # still cached after free
    taker = Seq("taker", tokens(9, start=500))
    assert bm.allocate_slots(taker, 9)  # takes 3, 1, 0: evicts old's block 0 only
    assert bm.block_table(taker) == [3, 1, 0]
    assert bm.get_computed_blocks(Seq("x", tokens(5)))[1] == 0
    assert bm.get_computed_blocks(Seq("y", tokens(5, start=50)))[1] == 4


def test_a_prefix_hit_on_an_idle_block_takes_it_out_of_the_free_queue():
    bm = KVBlockManager(3, 0, BS)
    prefill(bm, Seq("a", tokens(5)))
    bm.free(Seq("a", []))
    assert bm.num_free_blocks(DEVICE) == 3
    seq = Seq("b", tokens(5))
    blocks, cached = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, 1, blocks)
    assert bm.block_table(seq)[0] == blocks[0].block_id
    assert blocks[0].block_id not in bm._pools[DEVICE].free_block_ids()
    assert bm.num_free_blocks(DEVICE) == 1


def test_allocation_never_evicts_the_cached_blocks_it_is_taking():
    bm = KVBlockManager(4, 0, BS)
    a, c = Seq("a", tokens(5)), Seq("c", tokens(5, start=50))
    prefill(bm, a)  # 0 cached, 1 partial
    prefill(bm, c)  # 2 cached, 3 partial
    bm.free(a)
    bm.free(c)
    assert bm.allocate_slots(Seq("z", tokens(5, start=500)), 5)  # takes 3 and 1
    assert bm._pools[DEVICE].free_block_ids() == [0, 2]  # a's cached block is next to go
    seq = Seq("b", tokens(4) + [7])
    blocks, cached = bm.get_computed_blocks(seq)
    assert [b.block_id for b in blocks] == [0]
    assert bm.allocate_slots(seq, 1, blocks)
    assert bm.block_table(seq) == [0, 2]


def test_free_releases_the_tail_first():
    bm = KVBlockManager(4, 0, BS)
    prefill(bm, Seq("a", tokens(12)))  # three full cached blocks
    bm.free(Seq("a", []))
    assert bm._pools[DEVICE].free_block_ids() == [3, 2, 1, 0]


def test_shared_prefix_refcounts_drop_one_per_free():
    bm = KVBlockManager(16, 0, BS)
    seqs = [Seq(f"s{i}", tokens(8) + [100 + i]) for i in range(3)]
    for seq in seqs:
        prefill(bm, seq)
    pool = bm._pools[DEVICE]
    shared = [pool.blocks[i] for i in bm.block_table(seqs[0])[:2]]
    assert [b.ref_count for b in shared] == [3, 3]
    bm.free(seqs[0])
    assert [b.ref_count for b in shared] == [2, 2]
    bm.free(seqs[1])
    bm.free(seqs[2])
    assert [b.ref_count for b in shared] == [0, 0]
    assert bm.num_free_blocks(DEVICE) == 16


def test_exhaustion_returns_false_and_changes_nothing():
    bm = KVBlockManager(4, 2, BS)
    holder = Seq("h", tokens(8))
    prefill(bm, holder)
    cached_seq = Seq("c", tokens(8) + tokens(9, start=100))
    blocks, _ = bm.get_computed_blocks(cached_seq)
    before = state(bm)
    assert not bm.allocate_slots(cached_seq, 9, blocks)  # needs 3 new blocks, 2 are free
    assert state(bm) == before
    assert bm.block_table(cached_seq) == []


def test_idle_cached_blocks_count_as_free():
    bm = KVBlockManager(4, 0, BS)
    prefill(bm, Seq("a", tokens(16)))
    bm.free(Seq("a", []))
    seq = Seq("b", tokens(16, start=100))
    assert bm.allocate_slots(seq, 16)  # evicts all four cached blocks
    assert bm.num_free_blocks(DEVICE) == 0


def test_swap_out_and_in_maps_ids_and_restores_counts():
    bm = KVBlockManager(6, 4, BS)
    seq = Seq("a", tokens(10))
    prefill(bm, seq)
    device_table = bm.block_table(seq)
    assert bm.can_swap_out(seq)
    out = bm.swap_out(seq)
    assert [d for d, _ in out] == device_table
    assert bm.tier_of(seq) == CPU
    assert bm.block_table(seq) == [c for _, c in out]
    assert (bm.num_used_blocks(DEVICE), bm.num_used_blocks(CPU)) == (0, 3)
    assert not bm.can_swap_out(seq)
    # A sequence on the CPU tier grows there (an offloaded sequence decoding on the CPU).
    assert bm.allocate_slots(seq, 3)  # 13 slots: a fourth block
    assert (bm.num_used_blocks(DEVICE), bm.num_used_blocks(CPU)) == (0, 4)
    assert not bm.allocate_slots(seq, 7)  # 17 slots need a fifth block: the CPU tier has 4
    assert bm.can_swap_in(seq)
    cpu_table = bm.block_table(seq)
    back = bm.swap_in(seq)
    assert [c for c, _ in back] == cpu_table and len(cpu_table) == 4
    assert bm.block_table(seq) == [d for _, d in back]
    assert (bm.num_used_blocks(DEVICE), bm.num_used_blocks(CPU)) == (4, 0)
    bm.free(seq)
    assert (bm.num_free_blocks(DEVICE), bm.num_free_blocks(CPU)) == (6, 4)


def test_swapping_is_refused_without_room():
    bm = KVBlockManager(4, 1, BS)
    seq = Seq("a", tokens(8))
    prefill(bm, seq)
    before = state(bm)
    assert not bm.can_swap_out(seq)
    assert bm.swap_out(seq) is None
    assert state(bm) == before
    small = KVBlockManager(2, 4, BS)
    seq = Seq("b", tokens(8))
    prefill(small, seq)
    small.swap_out(seq)
    other = Seq("c", tokens(1))
    assert small.allocate_slots(other, 1)
    assert not small.can_swap_in(seq)
    assert small.swap_in(seq) is None
    assert small.tier_of(seq) == CPU


def test_can_swap_in_counts_room_to_grow():
    bm = KVBlockManager(3, 4, BS)
    seq = Seq("a", tokens(8))
    prefill(bm, seq)
    bm.swap_out(seq)
    assert bm.can_swap_in(seq, num_new_tokens=4)  # 12 slots: 3 blocks
    assert not bm.can_swap_in(seq, num_new_tokens=5)


def test_shared_blocks_survive_the_swap_of_one_owner():
    bm = KVBlockManager(8, 8, BS)
    a, b = Seq("a", tokens(9)), Seq("b", tokens(9))
    prefill(bm, a)
    prefill(bm, b)
    shared = bm.block_table(a)[:2]
    bm.swap_out(a)
    assert bm.block_table(b)[:2] == shared
    assert [bm._pools[DEVICE].blocks[i].ref_count for i in shared] == [1, 1]


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="block_size"):
        KVBlockManager(4, 0, 0)
    with pytest.raises(ValueError, match="num_device_blocks"):
        KVBlockManager(0, 0, 4)
    with pytest.raises(ValueError, match="tier"):
        KVBlockManager(4, 0, 4).num_free_blocks("gpu")


def test_without_prefix_caching_nothing_is_shared():
    bm = KVBlockManager(8, 0, BS, enable_prefix_caching=False)
    prefill(bm, Seq("a", tokens(9)))
    assert bm.get_computed_blocks(Seq("b", tokens(9))) == ([], 0)
    assert bm.prefix_cache_queries == 0


# blocks before a sliding window


def held(bm: KVBlockManager, seq: Seq) -> list[int]:
    """The ids of the blocks the sequence holds, without the placeholders of those freed."""
    return [b.block_id for b in bm._tables[seq.request_id] if b is not None]


def test_a_block_is_freed_once_every_slot_of_it_is_before_the_position():
    bm = KVBlockManager(8, 0, BS)
    seq = Seq("a", tokens(10))
    prefill(bm, seq)  # blocks 0, 1, 2 (slots 0-3, 4-7, 8-9)
    bm.free_blocks_before(seq, 3)  # slot 3 is still read
    assert bm.block_table(seq) == [0, 1, 2] and bm.num_used_blocks(DEVICE) == 3
    bm.free_blocks_before(seq, 4)
    assert bm.block_table(seq) == [FREED_BLOCK_ID, 1, 2] and held(bm, seq) == [1, 2]
    assert bm.num_used_blocks(DEVICE) == 2
    bm.free_blocks_before(seq, 7)
    assert held(bm, seq) == [1, 2]
    bm.free_blocks_before(seq, 8)
    bm.free_blocks_before(seq, 8)  # again: nothing more to free
    assert held(bm, seq) == [2] and bm.num_used_blocks(DEVICE) == 1
    # The table keeps its length: block i still holds tokens 4i..4i+3, and growth is counted from it.
    assert len(bm.block_table(seq)) == 3
    seq.all_token_ids += [100, 101]
    assert bm.allocate_slots(seq, 2)  # slots 10, 11 fit in block 2
    assert held(bm, seq) == [2]
    seq.num_computed_tokens = 12
    seq.all_token_ids.append(102)
    assert bm.allocate_slots(seq, 1)  # slot 12 opens block 3
    assert len(bm.block_table(seq)) == 4 and len(held(bm, seq)) == 2


def test_freeing_a_windowed_sequence_restores_every_count():
    bm = KVBlockManager(8, 4, BS)
    seq = Seq("a", tokens(18))
    prefill(bm, seq)
    bm.free_blocks_before(seq, 13)
    assert bm.num_used_blocks(DEVICE) == 2
    bm.free(seq)
    assert bm.block_table(seq) == []
    assert (bm.num_free_blocks(DEVICE), bm.num_free_blocks(CPU)) == (8, 4)
    assert all(b.ref_count == 0 for pool in bm._pools.values() for b in pool.blocks)


def test_blocks_freed_before_the_window_stay_cached_until_reused():
    bm = KVBlockManager(6, 0, BS)
    seq = Seq("a", tokens(13))
    prefill(bm, seq)  # 3 full blocks cached, block 3 partial
    bm.free_blocks_before(seq, 8)
    assert held(bm, seq) == [2, 3]
    # A later request with the same prefix walks the cache from block 0: the freed blocks are there.
    blocks, cached = bm.get_computed_blocks(Seq("b", tokens(13)))
    assert [b.block_id for b in blocks] == [0, 1, 2] and cached == 12
    # Evicted and reused by another sequence: the prefix is gone, and `a` frees only what it holds.
    taker = Seq("taker", tokens(16, start=500))
    assert bm.allocate_slots(taker, 16)
    assert sorted(held(bm, taker)) == [0, 1, 4, 5]
    assert bm.get_computed_blocks(Seq("c", tokens(13)))[1] == 0
    bm.free(seq)
    assert [b.ref_count for b in bm._pools[DEVICE].blocks] == [1, 1, 0, 0, 1, 1]
    bm.free(taker)
    assert bm.num_free_blocks(DEVICE) == 6


def test_swapping_a_windowed_table_moves_only_the_blocks_it_holds():
    bm = KVBlockManager(6, 2, BS)  # the CPU tier has room for the two held blocks, not the table's four
    seq = Seq("a", tokens(14))
    prefill(bm, seq)
    bm.free_blocks_before(seq, 8)
    assert bm.block_table(seq) == [FREED_BLOCK_ID, FREED_BLOCK_ID, 2, 3]
    assert bm.can_swap_out(seq, num_new_tokens=2) and not bm.can_swap_out(seq, num_new_tokens=3)
    out = bm.swap_out(seq)
    assert [d for d, _ in out] == [2, 3]
    assert bm.block_table(seq) == [FREED_BLOCK_ID, FREED_BLOCK_ID] + [c for _, c in out]
    assert (bm.num_used_blocks(DEVICE), bm.num_used_blocks(CPU)) == (0, 2)
    bm.free_blocks_before(seq, 12)  # on the CPU tier too
    assert bm.num_used_blocks(CPU) == 1
    assert bm.allocate_slots(seq, 2)  # 16 slots: no new block
    seq.num_computed_tokens = 16
    other = Seq("b", tokens(16, start=100))
    assert bm.allocate_slots(other, 16)  # the device tier has 2 blocks left: the held one and one to grow
    assert bm.can_swap_in(seq, num_new_tokens=4) and not bm.can_swap_in(seq, num_new_tokens=5)
    back = bm.swap_in(seq)
    assert [c for c, _ in back] == [out[1][1]] and len(back) == 1
    assert bm.block_table(seq) == [FREED_BLOCK_ID] * 3 + [back[0][1]]
    assert (bm.num_used_blocks(DEVICE), bm.num_used_blocks(CPU)) == (5, 0)
    bm.free(seq)
    bm.free(other)
    assert (bm.num_free_blocks(DEVICE), bm.num_free_blocks(CPU)) == (6, 2)


def test_placeholders_are_never_offered_to_the_prefix_cache():
    bm = KVBlockManager(8, 8, BS)
    seq = Seq("a", tokens(14))
    prefill(bm, seq)
    bm.free_blocks_before(seq, 8)
    bm.swap_out(seq)
    bm.swap_in(seq)  # fresh device blocks, offered to the cache again from block 0 on
    pool = bm._pools[DEVICE]
    offered, cache = [], pool.cache
    pool.cache = lambda block, block_hash: (offered.append(block), cache(block, block_hash))
    seq.all_token_ids += tokens(2, start=900)
    assert bm.allocate_slots(seq, 2)
    seq.num_computed_tokens = 16
    bm.cache_full_blocks(seq)
    assert offered == [pool.blocks[i] for i in held(bm, seq)]  # blocks 2 and 3, not the placeholders
    bm.free(seq)
    assert bm.num_free_blocks(DEVICE) == 8


def test_block_manager_imports_no_torch():
    import subprocess

    code = "import sys, tandem.kv.block_manager; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# randomized invariants

ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "swap_out", "swap_in", "slide"]),
                         st.integers(0, 5), st.integers(1, 9)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_invariants_hold_under_random_operations(operations):
    bm = KVBlockManager(10, 6, BS)
    seqs: dict[str, Seq] = {}
    for op, k, n in operations:
        rid = f"s{k}"
        seq = seqs.get(rid)
        if op == "add" and seq is None:
            seq = Seq(rid, [k % 2] * n)  # two prompt families, so prefixes are shared
            blocks, cached = bm.get_computed_blocks(seq)
            if bm.allocate_slots(seq, n - cached, blocks):
                seq.num_computed_tokens = n
                bm.cache_full_blocks(seq)
                seqs[rid] = seq
        elif op == "grow" and seq is not None and bm.tier_of(seq) == DEVICE:
            before = state(bm)
            if bm.allocate_slots(seq, n):
                seq.all_token_ids += [k] * n
                seq.num_computed_tokens += n
                bm.cache_full_blocks(seq)
            else:
                assert state(bm) == before
        elif op == "free" and seq is not None:
            bm.free(seqs.pop(rid))
        elif op == "swap_out" and seq is not None:
            bm.swap_out(seq)
        elif op == "swap_in" and seq is not None:
            bm.swap_in(seq)
        elif op == "slide" and seq is not None:
            bm.free_blocks_before(seq, seq.num_computed_tokens - n)
        check_invariants(bm, seqs)
    for seq in seqs.values():
        bm.free(seq)
    assert bm.num_free_blocks(DEVICE) == 10 and bm.num_free_blocks(CPU) == 6


def check_invariants(bm: KVBlockManager, seqs: dict[str, Seq]) -> None:
    for tier in (DEVICE, CPU):
        pool = bm._pools[tier]
        tables = [held(bm, s) for s in seqs.values() if bm.tier_of(s) == tier]
        assert sum(b.ref_count for b in pool.blocks) == sum(len(t) for t in tables)
        assert bm.num_free_blocks(tier) + bm.num_used_blocks(tier) == bm.num_total_blocks(tier)
        assert sorted(pool.free_block_ids()) == [b.block_id for b in pool.blocks if b.ref_count == 0]
    for seq in seqs.values():
        assert len(bm.block_table(seq)) * BS >= seq.num_computed_tokens
        assert len(set(held(bm, seq))) == len(held(bm, seq))
        table = bm._tables[seq.request_id]
        freed = len(table) - len(held(bm, seq))
        assert all(b is None for b in table[:freed])  # the freed blocks are a leading run
    for block_hash, block in bm._pools[DEVICE]._cached.items():
        assert block.block_hash == block_hash
