"""Per-sequence block tables over two tiers of KV blocks, with prefix caching on the device tier.

Plain Python, after vLLM v1's `kv_cache_manager`: it hands out block ids and never touches a
tensor (`tandem.kv.cache` moves the data given the id pairs that swapping returns). Running out
of blocks is a normal answer (False / None), never an exception, and freeing a sequence
restores every count exactly.

With a sliding window, a sequence's leading blocks that no later query reads can be freed before
it finishes (`free_blocks_before`): its table keeps their places as placeholders, so that block i
still holds tokens [i * block_size, (i + 1) * block_size) and the counts that compare a table's
length with the blocks a length needs stay right.

A sequence is anything with `request_id` (hashable), `all_token_ids` and `num_computed_tokens`
(`tandem.engine.sequence.Sequence`), and optionally `cache_salt`: sequences share cached blocks only
with sequences of the same salt (vLLM's cache_salt).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq
from typing import Protocol

from tandem.kv.block_pool import Block, BlockPool, hash_block, hash_salt

DEVICE, CPU = "device", "cpu"
TIERS = (DEVICE, CPU)
# What block_table names a freed block by: a valid id, which the kernels may index but never read from
# (its slots are before every query's window; the torch path zeroes what it gathers there) and through
# which the sequence never writes. Another sequence may hold that block.
FREED_BLOCK_ID = 0


class SequenceLike(Protocol):
    request_id: str
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> list[int]: ...


def _check_count(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


class KVBlockManager:
    """Allocates, frees, hashes and swaps the blocks of every sequence's block table."""

    def __init__(self, num_device_blocks: int, num_cpu_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True):
        _check_count("num_device_blocks", num_device_blocks, 1)
        _check_count("num_cpu_blocks", num_cpu_blocks, 0)
        _check_count("block_size", block_size, 1)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._pools = {DEVICE: BlockPool(num_device_blocks, enable_prefix_caching),
                       CPU: BlockPool(num_cpu_blocks, enable_caching=False)}
        self._tables: dict[str, list[Block | None]] = {}  # None: a leading block freed (free_blocks_before)
        self._tier: dict[str, str] = {}
        self._hashes: dict[str, list[int]] = {}  # chained hashes of the sequence's full blocks
        self._num_registered: dict[str, int] = {}  # leading table blocks offered to the cache
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache
        self.prefix_cache_hit_tokens = 0  # of those, tokens whose KV the cache supplied

    # counts

    def num_free_blocks(self, tier: str) -> int:
        return self._pool(tier).num_free

    def num_used_blocks(self, tier: str) -> int:
        pool = self._pool(tier)
        return pool.num_blocks - pool.num_free

    def num_total_blocks(self, tier: str) -> int:
        return self._pool(tier).num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens slots."""
        return -(-num_tokens // self.block_size)

    # per sequence

    def block_table(self, seq: SequenceLike) -> list[int]:
        """Block ids of the sequence, in the tier it is in (empty if it holds none); FREED_BLOCK_ID for
        the blocks freed by free_blocks_before."""
        return [FREED_BLOCK_ID if b is None else b.block_id for b in self._tables.get(seq.request_id, ())]

    def tier_of(self, seq: SequenceLike) -> str | None:
        return self._tier.get(seq.request_id)

    def get_computed_blocks(self, seq: SequenceLike) -> tuple[list[Block], int]:
        """The longest cached prefix of the sequence in full blocks, and the tokens it covers.

        At least one token is left to compute, since sampling needs the last position's logits.
        Pass the blocks to `allocate_slots` right away: allocation may evict them.
        """
        if not self.enable_prefix_caching or seq.request_id in self._tables:
            return [], 0
        tokens = seq.all_token_ids
        pool = self._pools[DEVICE]
        hits: list[Block] = []
        for block_hash in self._chain(tokens, (len(tokens) - 1) // self.block_size, salt=_salt(seq)):
            block = pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, seq: SequenceLike, num_new_tokens: int,
                       computed_blocks: Seq[Block] = ()) -> bool:
        """Grow the table to seq.num_computed_tokens + cached + num_new_tokens slots, in the tier
        the sequence is in (the device tier for a new one; the CPU tier once it is moved there).

        `computed_blocks` (from `get_computed_blocks`) only start an empty table. Returns False
        and changes nothing when the tier is short of blocks.
        """
        rid = seq.request_id
        tier = self._tier.get(rid, DEVICE)
        table = self._tables.get(rid, [])
        if computed_blocks and table:
            raise RuntimeError(f"sequence {rid!r} already has blocks; cached blocks only start a table")
        pool = self._pools[tier]
        num_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_new_blocks = max(0, self.blocks_needed(num_tokens) - len(table) - len(computed_blocks))
        if num_new_blocks > pool.num_free - pool.num_evictable(computed_blocks):
            return False
        if not table and tier == DEVICE and self.enable_prefix_caching:
            self.prefix_cache_queries += len(seq.all_token_ids)
            self.prefix_cache_hit_tokens += len(computed_blocks) * self.block_size
        pool.touch(computed_blocks)  # before allocating, so allocation cannot evict them
        new_blocks = pool.allocate(num_new_blocks)
        assert new_blocks is not None  # checked above; a failure here is a bug, not user input
        self._tables[rid] = table + list(computed_blocks) + new_blocks
        self._tier[rid] = tier
        return True

    def cache_full_blocks(self, seq: SequenceLike) -> None:
        """Offer the blocks whose every slot now holds computed KV to the prefix cache."""
        rid = seq.request_id
        if not self.enable_prefix_caching or self._tier.get(rid) != DEVICE:
            return
        table = self._tables[rid]
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        start = self._num_registered.get(rid, 0)
        if num_full <= start:
            return
        hashes = list(self._chain(seq.all_token_ids, num_full, known=self._hashes.get(rid, []), salt=_salt(seq)))
        self._hashes[rid] = hashes
        pool = self._pools[DEVICE]
        for i in range(start, num_full):
            if table[i] is not None:
                pool.cache(table[i], hashes[i])
        self._num_registered[rid] = num_full

    def free(self, seq: SequenceLike) -> None:
        """Release every block of the sequence, tail first so the tail is evicted first."""
        rid = seq.request_id
        table = self._tables.pop(rid, None)
        if table is None:
            return
        self._pools[self._tier.pop(rid)].free(_held(reversed(table)))
        self._hashes.pop(rid, None)
        self._num_registered.pop(rid, None)

    def free_blocks_before(self, seq: SequenceLike, position: int) -> None:
        """Release the sequence's leading blocks whose every slot is before `position`: KV that no
        later query reads (those before a sliding window). Their table entries stay, as placeholders;
        on the device tier they stay in the prefix cache until reused, as `free` leaves them."""
        table = self._tables.get(seq.request_id)
        if table is None:
            return
        end = min(max(position, 0) // self.block_size, len(table))
        start = end
        while start > 0 and table[start - 1] is not None:  # back to those freed before: a leading run
            start -= 1
        if start < end:
            self._pools[self._tier[seq.request_id]].free(reversed(table[start:end]))
            table[start:end] = [None] * (end - start)

    # swapping

    def can_swap_out(self, seq: SequenceLike, num_new_tokens: int = 0) -> bool:
        """Whether the table fits on the CPU tier, plus room to grow by num_new_tokens there."""
        table = self._tables.get(seq.request_id)
        if table is None or self._tier[seq.request_id] != DEVICE:
            return False
        return self._blocks_to_move(table, seq.num_computed_tokens + num_new_tokens) <= self._pools[CPU].num_free

    def swap_out(self, seq: SequenceLike, num_new_tokens: int = 0) -> list[tuple[int, int]] | None:
        """Move the table's blocks to the CPU tier: (device_block_id, cpu_block_id) pairs, or None
        when they do not fit with room for num_new_tokens more."""
        if not self.can_swap_out(seq, num_new_tokens):
            return None
        return self._move(seq, DEVICE, CPU)

    def can_swap_in(self, seq: SequenceLike, num_new_tokens: int = 0) -> bool:
        """Whether the table fits on the device, plus room to grow by num_new_tokens."""
        table = self._tables.get(seq.request_id)
        if table is None or self._tier[seq.request_id] != CPU:
            return False
        return self._blocks_to_move(table, seq.num_computed_tokens + num_new_tokens) <= self._pools[DEVICE].num_free

    def swap_in(self, seq: SequenceLike) -> list[tuple[int, int]] | None:
        """Move the table's blocks back to the device tier: (cpu_block_id, device_block_id) pairs, or None."""
        if not self.can_swap_in(seq):
            return None
        return self._move(seq, CPU, DEVICE)

    # helpers

    def _pool(self, tier: str) -> BlockPool:
        if tier not in self._pools:
            raise ValueError(f"unknown KV tier {tier!r}; expected one of {TIERS}")
        return self._pools[tier]

    def _chain(self, tokens: Seq[int], num_blocks: int, known: Seq[int] = (), salt: str | None = None) -> Iterator[int]:
        """Chained hashes of the first num_blocks full blocks of tokens (lazily), reusing `known`. A salt is
        the first block's parent: every block of a salted prefix hashes apart from the same tokens' unsalted
        or otherwise salted ones."""
        bs = self.block_size
        parent = None if salt is None else hash_salt(salt)
        for i in range(num_blocks):
            parent = known[i] if i < len(known) else hash_block(parent, tokens[i * bs:(i + 1) * bs])
            yield parent

    def _blocks_to_move(self, table: list[Block | None], num_tokens: int) -> int:
        """Blocks another tier needs for the table's held blocks and its growth to num_tokens slots."""
        return len(_held(table)) + max(0, self.blocks_needed(num_tokens) - len(table))

    def _move(self, seq: SequenceLike, src: str, dst: str) -> list[tuple[int, int]]:
        """Move the held blocks to fresh ones in dst; placeholders keep their places."""
        rid = seq.request_id
        table = self._tables[rid]
        old = _held(table)
        new = self._pools[dst].allocate(len(old))
        assert new is not None  # the caller checked room
        self._pools[src].free(reversed(old))
        moved = iter(new)
        self._tables[rid] = [None if b is None else next(moved) for b in table]
        self._tier[rid] = dst
        # Fresh device blocks are offered to the cache again once their data is back.
        self._num_registered[rid] = 0
        return [(o.block_id, n.block_id) for o, n in zip(old, new)]


def _held(table: Iterable[Block | None]) -> list[Block]:
    """The blocks a table holds, without the placeholders of freed ones."""
    return [b for b in table if b is not None]


def _salt(seq: SequenceLike) -> str | None:
    return getattr(seq, "cache_salt", None)
