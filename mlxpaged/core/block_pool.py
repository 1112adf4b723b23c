"""The pool of KV-cache blocks: reference counts, an LRU free queue, and the prefix-cache index.

A block is `block_size` token slots at the same index of every layer's K and V pool.

Invariants (checked by `BlockPool.check()` and the property tests):
- every block is in exactly one of two states: free (`ref_cnt == 0`, in `free_queue`) or
  in use (`ref_cnt > 0`, not in `free_queue`);
- a block with a `block_hash` is full and holds exactly `token_ids`; it may be free and still
  cached ("evictable"): the free queue is then also the LRU order of eviction;
- `cached[h]` is the one block registered under hash `h`, and that block's `block_hash == h`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    """One block of the pool. `block_hash`/`token_ids` are set only while it is in the prefix cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    """Fixed-size blocks, reference counted, with an O(1) free queue that is also the LRU.

    `allocate()` takes the least recently freed block (evicting it from the prefix cache if it
    was cached) and returns `None` when no block is free: "no room" is for the caller to handle.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_cnt 0, oldest first: never-used blocks first, then in order of release.
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (never used, released, or cached but unused)."""
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def allocate(self) -> Block | None:
        """A fresh block with `ref_cnt == 1`, or `None` when the pool is exhausted."""
        if not self.free_queue:
            return None
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:
            self._uncache(block)
        block.ref_cnt = 1
        return block

    def acquire(self, block: Block) -> None:
        """Add a reference to a block (sharing by fork, or a prefix-cache hit on a free block)."""
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    def release(self, block: Block) -> None:
        """Drop a reference; at zero the block joins the tail of the free queue, still cached."""
        if block.ref_cnt <= 0:
            raise RuntimeError(f"block {block.block_id} released with ref_cnt {block.ref_cnt}")
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue[block.block_id] = block

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> Block | None:
        """The cached block for `block_hash` if it holds exactly `token_ids` (a collision is a miss)."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def cache(self, block: Block, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Register a full, in-use block under its hash; the first block with a hash keeps it."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached[block_hash] = block

    def _uncache(self, block: Block) -> None:
        del self.cached[block.block_hash]
        block.block_hash = block.token_ids = None

    def check(self) -> None:
        """Assert the invariants in the module docstring."""
        for b in self.blocks:
            assert (b.ref_cnt == 0) == (b.block_id in self.free_queue), f"block {b.block_id} state"
            assert b.ref_cnt >= 0
            if b.block_hash is not None:
                assert self.cached.get(b.block_hash) is b
        for h, b in self.cached.items():
            assert b.block_hash == h
