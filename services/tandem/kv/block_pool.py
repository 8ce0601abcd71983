"""One tier's pool of KV blocks: reference counts, an LRU free queue and the prefix-cache map.

Plain Python, after vLLM v1's `block_pool`. A block whose reference count drops to zero keeps
its hash and waits in the free queue; it leaves the prefix cache only when allocation reuses
it, so a later request with the same prefix can take it back for free.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    """A fixed-size slot range in one tier. `block_hash` is set only while the prefix cache maps it."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of one full block: the same prefix gives the same hash in every process."""
    return _digest((parent_hash, tuple(token_ids)))


def hash_salt(salt: str) -> int:
    """The root a salted chain of block hashes starts from (tandem.kv.block_manager): apart from every
    block's hash."""
    return _digest(("salt", salt))


def _digest(value: tuple) -> int:
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:8], "little")


class BlockPool:
    """Blocks 0..num_blocks-1 of one tier; with caching, also the map from block hash to block."""

    def __init__(self, num_blocks: int, enable_caching: bool):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Head = least recently freed = evicted first. Insertion order is the LRU order.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, Block] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds, cached ones included (they are evicted on demand)."""
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be allocated) first."""
        return list(self._free)

    def lookup(self, block_hash: int) -> Block | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def num_evictable(self, blocks: Iterable[Block]) -> int:
        """How many of `blocks` sit in the free queue (taking them shrinks it)."""
        return sum(1 for b in blocks if b.ref_count == 0)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cached blocks, pulling idle ones out of the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def allocate(self, n: int) -> list[Block] | None:
        """n fresh blocks from the head of the free queue, or None (nothing changes) if too few."""
        if n > len(self._free):
            return None
        taken = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in the order given; idle blocks rejoin the queue."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    # Nothing reusable in it: let allocation take it before any cached block.
                    self._free.move_to_end(block.block_id, last=False)

    def cache(self, block: Block, block_hash: int) -> None:
        """Register a just-filled block under its hash. A second copy of a cached prefix stays unmapped."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
