"""Block tables over a `BlockPool`: slot allocation with copy-on-write, fork, free, and prefix caching.

Only the scheduler calls this module: it is the one owner of every sequence's block table.

A full block is named by `hash_fn(parent_hash, token_ids, extra_key)`: the chain of hashes
makes the name depend on every token before the block, and `extra_key` (the model's identity)
keeps two models from sharing one cache. Hashes are computed once, when a block fills.

A `SecondTier` (the disk store, worker/prefix_store.py) may sit under the pool: on a memory miss
`match_second_tier` asks it for the next blocks of a prompt and takes fresh blocks for those it
has (the engine copies their bytes in before the step's forward pass), and `cache_full_blocks`
lists the newly named blocks it wants (`to_store`) for the engine to hand over.

A model whose layers keep different kinds of cache has one group per kind (kv_groups.py, after
vLLM's `KVCacheCoordinator`): each sequence holds one table per group, every table one entry per
logical block, and every operation here is a loop over the groups; a block full in group 0 is
named in each group under the same hash. What differs between kinds (which blocks go back while a
sequence runs, where a prefix hit may resume) is the group's own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Protocol

import numpy as np

from ..utils import cdiv
from .kv_groups import GroupSpec, KVCacheGroup, make_group
from .sequence import BlockIds, Sequence

HashFn = Callable[[bytes | None, tuple[int, ...], bytes], bytes]


class SecondTier(Protocol):
    """A store of full blocks by hash, below the pool (core moves no bytes: the engine does)."""

    def lookup(self, block_hashes: list[bytes], token_ids: list[tuple[int, ...]]) -> int:
        """How many leading blocks of `block_hashes` it can supply (made ready for loading)."""

    def wants(self, block_hash: bytes) -> bool:
        """Whether a newly full block with this hash should be handed to it."""


def sha256_block_hash(parent: bytes | None, token_ids: tuple[int, ...], extra_key: bytes) -> bytes:
    """SHA-256 of (parent hash, the block's token ids as int64, extra key)."""
    h = hashlib.sha256()
    h.update(parent or b"\0" * 32)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(extra_key)
    return h.digest()


class PerGroup(list):
    """One list per group, in group order (a step's block copies `(src, dst)`, its loads
    `(block_hash, block_id)`); the block manager returns an empty one (no group at all, so
    falsy) when it has nothing for any group."""

    def __init__(self, num_groups: int = 0):
        super().__init__([] for _ in range(num_groups))


NO_COPIES = PerGroup()  # what the usual decode gets back: read, never changed


class _Chain:
    """The chained hashes `(hash, token ids)` of a sequence's full blocks from `start` on, each
    computed when first read (a prefix hit usually stops long before the prompt's end)."""

    __slots__ = ("bm", "seq", "start", "items")

    def __init__(self, bm: BlockManager, seq: Sequence, start: int = 0):
        self.bm, self.seq, self.start, self.items = bm, seq, start, []

    def __getitem__(self, i: int) -> tuple[bytes, tuple[int, ...]]:
        items = self.items
        while len(items) <= i:
            j = self.start + len(items)
            parent = items[-1][0] if items else (self.seq.block_hashes[j - 1] if j else None)
            t = self.bm._tokens(self.seq, j)
            items.append((self.bm._hash(parent, t, self.seq, j), t))
        return items[i]


def blocks_for_request(num_prompt_tokens: int, n: int, max_tokens: int, block_size: int) -> int:
    """Blocks one request holds at most: its n samples at full length, sharing the prompt's full blocks."""
    shared = num_prompt_tokens // block_size if n > 1 else 0
    per_sample = cdiv(num_prompt_tokens + max_tokens - 1, block_size) - shared
    return shared + n * per_sample


class BlockManager:
    """Keeps each sequence's block tables (one per group) in step with its stored tokens.

    All methods that can run out of blocks are atomic: they return `None` (or `False`) and change
    nothing when a pool cannot satisfy them. Writing into a block with `ref_cnt > 1` never
    happens: `allocate_slots` copies such a block first and reports the copy for the KV pools to apply.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = sha256_block_hash,
        extra_key: bytes = b"",
        groups: Seq[GroupSpec | KVCacheGroup] = (),
    ):
        """`groups`: the model's cache groups (kv_groups.py), each a spec or a group built by the
        caller (one that holds no blocks), the first full attention; default one full-attention
        group. A group's pool is `num_blocks` long unless its spec says."""
        if block_size < 1 or block_size > 256 or block_size & (block_size - 1):
            raise ValueError(f"block size must be a power of two from 1 to 256, got {block_size}")
        specs = list(groups) or [GroupSpec("full")]
        if specs[0].kind != "full":
            raise ValueError(f"group 0 must be full attention, got {specs[0].kind!r}")
        built = [g if isinstance(g, KVCacheGroup) else make_group(g, block_size, num_blocks) for g in specs]
        # the groups that hold blocks (a sequence has one table in each), in order; then those that
        # rule on prefix hits only
        self.groups: list[KVCacheGroup] = [g for g in built if g.holds_blocks]
        self.state_groups: list[KVCacheGroup] = [g for g in built if not g.holds_blocks]
        self._every = self.groups + self.state_groups
        self.pool = self.groups[0].pool  # group 0's: every block of every sequence
        self._num_groups = len(self.groups)
        self._releasing = [(g, grp) for g, grp in enumerate(self.groups) if grp.releases]
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.extra_key = extra_key
        self.num_cow_copies = 0
        self.second_tier: SecondTier | None = None
        self.to_store: list[tuple[bytes, int, tuple[int, ...]]] = []  # (block_hash, block_id, token_ids)

    # -- sizing ---------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, group: int = 0) -> int:
        """Fresh blocks `allocate_slots(seq, num_new_tokens)` would take (copy-on-write included)
        from the pool of `group`."""
        table = seq.tables[group] if group < len(seq.tables) else []
        return self._needed(table, seq.num_computed_tokens, num_new_tokens)

    def _needed(self, table: list, computed: int, num_new_tokens: int) -> int:
        need = max(0, self.blocks_for(computed + num_new_tokens) - len(table))
        if num_new_tokens and computed % self.block_size and table[-1].ref_cnt > 1:
            need += 1
        return need

    def fits(self, num_tokens: int, headroom: int = 0) -> bool:
        """Whether an empty sequence's first `num_tokens` tokens fit in the free blocks, with
        `headroom` group-0 blocks to spare (another group needs at most its `peak_blocks`)."""
        need = self.blocks_for(num_tokens)
        if need + headroom > self.pool.num_free:
            return False
        return all(g.peak_blocks(need) <= g.pool.num_free for g in self.groups[1:])

    def _own_tables(self, seq: Sequence) -> None:
        """Give `seq` one (empty) table per group, if it has not got them yet."""
        while len(seq.tables) < self._num_groups:
            seq.tables.append([])
            seq.ids.append(BlockIds())

    def trim_groups(self) -> None:
        """Drop what the groups keep beyond the tables (an idle engine trimming its pools)."""
        for g in self.groups:
            g.trim()

    def take_resize(self) -> list | None:
        """Each group's pool's `take_resize()`, or None when no pool changed (every step asks)."""
        if self._num_groups == 1:  # (without the loop)
            r = self.pool.take_resize()
            return None if r is None else [r]
        out = None
        for i, g in enumerate(self.groups):
            r = g.pool.take_resize()
            if r is not None:
                if out is None:
                    out = [None] * self._num_groups
                out[i] = r
        return out

    # -- the allocator ----------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> PerGroup | None:
        """Make room to store `num_new_tokens` more tokens of `seq`.

        Returns each group's (src, dst) block copies to apply before writing (copy-on-write of a
        shared, partly filled last block), or `None` with nothing changed if a pool is short (but
        the blocks no token still to compute reads are released first, whatever happens).
        """
        if num_new_tokens < 0:
            raise ValueError("num_new_tokens must be >= 0")
        tables = seq.tables
        if len(tables) != self._num_groups:
            self._own_tables(seq)
        if self._releasing:
            for g, grp in self._releasing:
                grp.release_unread(seq, g)
        bs = self.block_size
        table, computed = tables[0], seq.num_computed_tokens
        if computed + num_new_tokens <= len(table) * bs and (
            not computed % bs
            or (table[-1].ref_cnt == 1 and (self._num_groups == 1 or all(t[-1].ref_cnt == 1 for t in tables)))
        ):
            return NO_COPIES  # the usual decode: room in its own last block (what the general path finds, cheaper)
        for g, grp in enumerate(self.groups):
            if self._needed(tables[g], computed, num_new_tokens) > grp.pool.num_free:
                return None
        copies = PerGroup(self._num_groups)
        if num_new_tokens and computed % bs:
            for g, grp in enumerate(self.groups):
                last = tables[g][-1]
                if last.ref_cnt > 1:
                    fresh = grp.pool.allocate()
                    copies[g].append((last.block_id, fresh.block_id))
                    grp.pool.release(last)
                    tables[g][-1] = fresh
                    seq.ids[g][-1] = fresh.block_id
                    if g == 0:
                        self.num_cow_copies += 1
                        # The copy is the target pool's: a draft model's rows of that block start over.
                        seq.draft_computed = min(seq.draft_computed, (len(table) - 1) * bs)
        want = self.blocks_for(computed + num_new_tokens)
        while len(table) < want:
            for g, grp in enumerate(self.groups):
                prev = tables[g][-1] if tables[g] else None  # None: a window group's released block
                block = grp.pool.allocate(None if prev is None else prev.block_id)  # extend its run
                tables[g].append(block)
                seq.ids[g].append(block.block_id)
        return copies if any(copies) else NO_COPIES

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's blocks and stored-token count, sharing every block."""
        for grp, table in zip(self.groups, parent.tables):
            for block in table:
                if block is not None:
                    grp.pool.acquire(block)
        child.tables = [list(t) for t in parent.tables]
        child.ids = [ids.copy() for ids in parent.ids]
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.draft_computed = parent.draft_computed
        child.cache_salt = parent.cache_salt
        child.adapter = parent.adapter
        child.images = parent.images  # its blocks' names, a beam's decode positions
        child.state = parent.state

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, tail first, so the LRU evicts its tail before its head."""
        for g, grp in enumerate(self.groups[: len(seq.tables)]):
            grp.free(seq, g)
        seq.tables = [[] for _ in seq.tables]
        for ids in seq.ids:
            ids.truncate(0)
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        seq.draft_computed = 0
        seq.state = None

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the first `num_tokens` stored tokens of `seq` (speculative decoding drops
        the slots of rejected proposals): blocks past them return to the pool, tail first.

        Never touches a named block: only full blocks within the kept tokens have hashes, so a
        block holding a rejected token is never in the prefix cache.
        """
        if not 0 <= num_tokens <= seq.num_computed_tokens:
            raise ValueError(f"cannot truncate to {num_tokens} tokens: {seq.num_computed_tokens} are stored")
        if len(seq.block_hashes) * self.block_size > num_tokens:
            raise ValueError(f"cannot truncate to {num_tokens} tokens: {len(seq.block_hashes)} blocks are named")
        for g, grp in self._releasing:
            if None in seq.tables[g][grp.first_needed(num_tokens) :]:
                raise ValueError(f"cannot truncate to {num_tokens} tokens: group {g}'s blocks there were released")
        keep = self.blocks_for(num_tokens)
        for grp, table, ids in zip(self.groups, seq.tables, seq.ids):
            for block in reversed(table[keep:]):
                grp.pool.release(block)
            del table[keep:]
            ids.truncate(keep)
        seq.num_computed_tokens = num_tokens
        seq.draft_computed = min(seq.draft_computed, num_tokens)

    # -- prefix caching ----------------------------------------------------------------------
    def _hash(self, parent: bytes | None, tokens: tuple[int, ...], seq: Sequence, i: int) -> bytes:
        # a salted request's chain starts from its salt (vLLM's cache_salt), and an adapter's from
        # its key (KV computed with another adapter differs): other salts and adapters never match it
        extra = (
            self.extra_key + seq.cache_salt + (seq.adapter.key if seq.adapter else b"") if i == 0 else self.extra_key
        )
        if seq.images is not None:  # the images with tokens in this block (vLLM's mm_hash): same ids, other pixels
            extra += seq.images.block_key(i, self.block_size)
        return self.hash_fn(parent, tokens, extra)

    def _tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def _resume_point(self, hashes, k: int) -> tuple[int, int]:
        """(the most of the first `k` named blocks `hashes` a hit may take in every group, and in
        group 0 alone): each group's resume point, until none cuts it shorter."""
        run = None
        while True:
            before = k
            for grp in self._every:
                k = grp.resume_point(hashes, k)
                if run is None:
                    run = k
            if k == before:
                return k, run

    def match_prefix(self, seq: Sequence, num_tokens: int | None = None) -> int:
        """Take cached blocks for an empty sequence's leading full blocks; return tokens reused.

        Considers the first `num_tokens` tokens (all by default), stops at the first miss and
        never covers the last of them, which must be computed (its logits, or a fork point).
        The hit ends where every group can resume (`KVCacheGroup.resume_point`). Cannot fail:
        hits take no fresh block.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        self._own_tables(seq)
        bs = self.block_size
        limit = seq.num_tokens if num_tokens is None else num_tokens
        hashes = _Chain(self, seq)
        k, run = self._resume_point(hashes, max(0, (limit - 1) // bs))
        for grp in self.groups:
            grp.matched(seq, run, k, hashes)
        tier = self.second_tier
        for g, grp in enumerate(self.groups):
            first = grp.first_needed(k * bs)
            table, ids = seq.tables[g], seq.ids[g]
            table += [None] * first
            ids.extend([0] * first)
            for i in range(first, k):
                block = grp.pool.lookup(*hashes[i])
                grp.pool.acquire(block)
                table.append(block)
                ids.append(block.block_id)
        for i in range(k):
            h, t = hashes[i]
            seq.block_hashes.append(h)
            # A hit is a prompt block of this request, but memory may hold it alone: a block that an
            # earlier answer filled (an agent's history comes back in its next prompt) was never a
            # prompt block before. The disk tier takes it now, or the chain on disk breaks there.
            if tier is not None and tier.wants(h):
                self.to_store.append((h, seq.block_table[i].block_id, t))
        seq.num_computed_tokens = k * bs
        return seq.num_computed_tokens

    def match_second_tier(self, seq: Sequence, num_tokens: int | None = None) -> PerGroup:
        """After `match_prefix`, take fresh blocks for the leading blocks the second tier has.

        Same limit as `match_prefix` (never the last token). The blocks join the tables and the
        prefix cache at once; returns per group the (block_hash, block_id) of its fresh blocks
        for the engine to fill before the next forward pass (a group that releases blocks takes
        only those the hit's end reads). Takes only free blocks, so it cannot fail.
        """
        if self.second_tier is None or not self.enable_prefix_caching:
            return PerGroup()
        self._own_tables(seq)
        bs = self.block_size
        limit = seq.num_tokens if num_tokens is None else num_tokens
        first, last = len(seq.block_table), (limit - 1) // bs
        if first >= last or len(seq.block_hashes) != first:
            return PerGroup()
        chain = _Chain(self, seq, first)
        chain[last - first - 1]  # every candidate block's hash: the tier is asked for them all
        hashes = [h for h, _ in chain.items]
        n = self.second_tier.lookup(hashes, [t for _, t in chain.items])
        while True:  # as in match_prefix: until no group cuts it shorter
            before = n
            for grp in self._every:
                n = grp.loadable(chain.items, first, n)
            if n == before:
                break
        if not n:
            return PerGroup()
        loads = PerGroup(self._num_groups)
        for g, grp in enumerate(self.groups):
            table, ids = seq.tables[g], seq.ids[g]
            start = grp.first_needed((first + n) * bs)
            for i in range(min(start, first)):  # memory hits the loaded blocks moved the group past
                if table[i] is not None:
                    grp.release(seq, g, i)
            pad = max(0, start - first)
            table += [None] * pad
            ids.extend([0] * pad)
            for h, t in chain.items[pad:n]:
                block = grp.pool.allocate()
                grp.pool.cache(block, h, t)
                table.append(block)
                ids.append(block.block_id)
                loads[g].append((h, block.block_id))
        seq.block_hashes += hashes[:n]
        seq.num_computed_tokens = len(seq.block_table) * bs
        return loads

    def take_to_store(self) -> list[tuple[bytes, int, tuple[int, ...]]]:
        """The newly full (or newly hit) blocks the second tier wants, since the last call; only
        those that still hold their hash: a hit block freed by a preemption in the same schedule
        may have been evicted and taken for other tokens since."""
        out, self.to_store = self.to_store, []
        cached = self.pool.cached
        return [x for x in out if (b := cached.get(x[0])) is not None and b.block_id == x[1]]

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Name (and cache, in every group that holds it) the blocks that became full since the last call."""
        if not self.enable_prefix_caching:
            return
        while len(seq.block_hashes) < seq.num_computed_tokens // self.block_size:
            i = len(seq.block_hashes)
            tokens = self._tokens(seq, i)
            h = self._hash(seq.block_hashes[i - 1] if i else None, tokens, seq, i)
            seq.block_hashes.append(h)
            for grp, table in zip(self.groups, seq.tables):
                if table[i] is not None:
                    grp.pool.cache(table[i], h, tokens)
            # the disk tier keeps prompt blocks only: a generated block is rarely asked for again
            prompt_block = (i + 1) * self.block_size <= seq.num_prompt_tokens
            if self.second_tier is not None and prompt_block and self.second_tier.wants(h):
                self.to_store.append((h, seq.block_table[i].block_id, tokens))

    # -- accounting ----------------------------------------------------------------------------
    def check(self, seqs: list[Sequence]) -> None:
        """Assert each pool's invariants, and that reference counts equal table occurrences."""
        for g, grp in enumerate(self.groups):
            grp.pool.check()
            counts = [0] * grp.pool.num_blocks
            for s in seqs:
                if not s.block_table:
                    assert all(not t for t in s.tables), "a table of a sequence with no blocks"
                    continue
                table, ids = s.tables[g], s.ids[g]
                want = [0 if b is None else b.block_id for b in table]
                assert ids.list == want == ids.buf[: len(want)].tolist(), f"group {g}'s ids differ from its table"
                if g == 0:
                    assert len(table) >= self.blocks_for(s.num_computed_tokens)
                    assert None not in table, "group 0 released a block"
                else:
                    assert len(table) == len(s.block_table), "the groups' tables differ in length"
                    # what a token still to compute reads is held; only a leading run before it is released
                    released = table.count(None)
                    assert released <= grp.first_needed(s.num_computed_tokens), f"group {g} released a block in use"
                    assert None not in table[released:], "released blocks are not a leading run"
                for b in table:
                    if b is not None:
                        counts[b.block_id] += 1
            grp.check_extra(counts)
            for b in grp.pool.blocks:
                assert b.ref_cnt == counts[b.block_id], (
                    f"group {g} block {b.block_id}: ref_cnt {b.ref_cnt} != {counts[b.block_id]} tables"
                )
