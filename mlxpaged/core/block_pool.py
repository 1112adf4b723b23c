"""The pool of KV-cache blocks: reference counts, an LRU free queue, and the prefix-cache index.

A block is `block_size` token slots at the same index of every layer's K and V pool.

Invariants (checked by `BlockPool.check()` and the property tests):
- every block is in exactly one of two states: free (`ref_cnt == 0`, in `free_queue`) or
  in use (`ref_cnt > 0`, not in `free_queue`);
- a block with a `block_hash` is full and holds exactly `token_ids`; it may be free and still
  cached ("evictable"): the free queue is then also the LRU order of eviction;
- `cached[h]` is the one block registered under hash `h`, and that block's `block_hash == h`;
- `num_refs` is the sum of every block's `ref_cnt` (each table entry holds one reference, so it
  is the number of blocks the tables would hold without sharing).

A growable pool (`enable_growth`) changes only its own bookkeeping when it grows or trims: it
calls nothing above it. The device pools follow through `take_resize`, which the scheduler
reports in each step's output and the engine applies before that step touches a block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# (new number of blocks, (src, dst) block copies to apply first): what the KV pools must do to match.
Resize = tuple[int, list[tuple[int, int]]]


@dataclass(eq=False, slots=True)
class Block:
    """One block of the pool. `block_hash`/`token_ids` are set only while it is in the prefix cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    """Fixed-size blocks, reference counted, with an O(1) free queue that is also the LRU.

    `allocate()` takes the least recently freed block (evicting it from the prefix cache if it
    was cached), or the free uncached block right after the one a table ends with (`after`), and
    returns `None` when no block is free: "no room" is for the caller to handle.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_cnt 0, oldest first: never-used blocks first, then in order of release.
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}
        # Growth (enable_growth): blocks num_blocks..max_blocks-1 exist once allocate() needs them.
        self.max_blocks = num_blocks
        self.min_blocks = num_blocks
        self.chunk_blocks = 0
        self._device_blocks = num_blocks  # the size the device pools were last told (take_resize)
        self._copies: list[tuple[int, int]] = []  # block copies (trim) the device pools have not made yet
        self.num_refs = 0  # every block's ref_cnt, summed (the module's invariants)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (never used, released, cached but unused, or not
        yet grown into, up to the cap)."""
        return len(self.free_queue) + self.max_blocks - self.num_blocks

    # -- growth -------------------------------------------------------------------------------
    def enable_growth(self, max_blocks: int, chunk_blocks: int) -> None:
        """Let the pool grow `chunk_blocks` (or an eighth of itself, if more) at a time up to
        `max_blocks` when `allocate()` finds no free block, and `trim()` back to its present size
        (the device pools follow: `take_resize`)."""
        if max_blocks < self.num_blocks or chunk_blocks < 1:
            raise ValueError(f"cannot grow {self.num_blocks} blocks to {max_blocks} by {chunk_blocks}")
        self.max_blocks, self.min_blocks, self.chunk_blocks = max_blocks, self.num_blocks, chunk_blocks

    def take_resize(self) -> Resize | None:
        """What the device pools must do to match this pool since the last call (copy the blocks a
        trim moved down, then take the new size), or None when nothing changed."""
        if self.num_blocks == self._device_blocks and not self._copies:
            return None
        out = (self.num_blocks, self._copies)
        self._device_blocks, self._copies = self.num_blocks, []
        return out

    def _grow(self) -> bool:
        # A growth copies every device pool (PagedKVCache.resize), so a large pool grows by an
        # eighth of itself: the copying stays a bounded multiple of the final size.
        new = min(self.max_blocks, self.num_blocks + max(self.chunk_blocks, self.num_blocks // 8))
        if new <= self.num_blocks or not self.chunk_blocks:
            return False
        fresh = [Block(i) for i in range(self.num_blocks, new)]
        self.blocks += fresh
        self.free_queue.update((b.block_id, b) for b in fresh)
        self.num_blocks = new
        return True

    def trim(self) -> int:
        """Give back what an idle pool does not need: shrink to the fewest whole chunks (at least
        the starting size) that hold the cached blocks, keeping the most recently used cached
        blocks that fit in the starting size and evicting the rest. Kept blocks above the new size
        are copied down (their ids change, which is safe: no sequence holds any block). Returns
        the blocks given back; 0 when some block is in use or there is nothing to give back."""
        if not self.chunk_blocks or self.num_used or self.num_blocks <= self.min_blocks:
            return 0
        cached = [b for b in self.free_queue.values() if b.block_hash is not None]  # LRU order
        for b in cached[: max(0, len(cached) - self.min_blocks)]:
            self._uncache(b)
        kept = cached[max(0, len(cached) - self.min_blocks) :]
        new = self.min_blocks
        movers = [b for b in kept if b.block_id >= new]
        spare = (b for b in self.blocks[:new] if b.block_hash is None)
        copies = []
        for src in movers:
            dst = next(spare)
            copies.append((src.block_id, dst.block_id))
            dst.block_hash, dst.token_ids = src.block_hash, src.token_ids
            self.cached[dst.block_hash] = dst
            src.block_hash = src.token_ids = None
        moved = {s: d for s, d in copies}
        order = [self.blocks[moved.get(b.block_id, b.block_id)] for b in kept]  # kept is in LRU order
        uncached = [b for b in self.blocks[:new] if b.block_hash is None]
        self._copies += copies  # the device pools copy them before they shrink (take_resize)
        given = self.num_blocks - new
        self.blocks = self.blocks[:new]
        # Never-cached blocks first (lowest id first), then the kept cached ones in LRU order.
        self.free_queue = OrderedDict((b.block_id, b) for b in uncached + order)
        self.num_blocks = new
        return given

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def allocate(self, after: int | None = None) -> Block | None:
        """A fresh block with `ref_cnt == 1`, or `None` when the pool is exhausted.

        `after`: the id of the block this one follows in a sequence's table. Block `after + 1` is
        taken when it is free and holds no cached prefix, so the table stays one run of
        consecutive ids, which attention reads in place (attention/reference.py); otherwise the
        least recently freed block, as without it."""
        nxt = self.free_queue.get(after + 1) if after is not None else None
        if nxt is not None and nxt.block_hash is None:
            del self.free_queue[nxt.block_id]
            nxt.ref_cnt = 1
            self.num_refs += 1
            return nxt
        if not self.free_queue and not self._grow():
            return None
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:
            self._uncache(block)
        block.ref_cnt = 1
        self.num_refs += 1
        return block

    def acquire(self, block: Block) -> None:
        """Add a reference to a block (sharing by fork, or a prefix-cache hit on a free block)."""
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1
        self.num_refs += 1

    def release(self, block: Block) -> None:
        """Drop a reference; at zero the block joins the tail of the free queue, still cached."""
        if block.ref_cnt <= 0:
            raise RuntimeError(f"block {block.block_id} released with ref_cnt {block.ref_cnt}")
        block.ref_cnt -= 1
        self.num_refs -= 1
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
        assert len(self.blocks) == self.num_blocks <= self.max_blocks
        assert all(b.block_id == i for i, b in enumerate(self.blocks))
        for b in self.blocks:
            assert (b.ref_cnt == 0) == (b.block_id in self.free_queue), f"block {b.block_id} state"
            assert b.ref_cnt >= 0
            if b.block_hash is not None:
                assert self.cached.get(b.block_hash) is b
        assert self.num_refs == sum(b.ref_cnt for b in self.blocks), "num_refs differs from the blocks' ref_cnt"
        for h, b in self.cached.items():
            assert b.block_hash == h
