"""Block tables over a `BlockPool`: slot allocation with copy-on-write, fork, free, and prefix caching.

Only the scheduler calls this module: it is the one owner of every sequence's block table.

A full block is named by `hash_fn(parent_hash, token_ids, extra_key)`: the chain of hashes
makes the name depend on every token before the block, and `extra_key` (the model's identity)
keeps two models from sharing one cache. Hashes are computed once, when a block fills.

A `SecondTier` (the disk store, worker/prefix_store.py) may sit under the pool: on a memory miss
`match_second_tier` asks it for the next blocks of a prompt and takes fresh blocks for those it
has (the engine copies their bytes in before the step's forward pass), and `cache_full_blocks`
lists the newly named blocks it wants (`to_store`) for the engine to hand over.

A model with sliding-window layers gets a second group (vLLM's `SlidingWindowManager`): the
windowed layers' K/V live in pools of their own, indexed by `window_pool`'s block ids through
each sequence's `window_table`, and a block that has fallen wholly out of the window of every
token still to compute goes back to that pool while the sequence runs. The full-attention layers
keep `block_table` as before. Both tables have one entry per logical block; a hit, a fork, a
copy-on-write, a truncation and a free act on both, and a block full in one is named in both
under the same hash (so a prefix hit needs the full group's blocks and only the window's tail of
the windowed group's).

The windowed group keeps a few windows pinned (`window_pins`): when a prompt's hit in the full
group is cut short because the windowed group lost the window at its end (a shared system prompt,
computed by an earlier request whose window has moved on), the sequence that recomputes it keeps
that window's blocks referenced when they leave its own window, so the next request sharing the
prefix takes the whole hit. At most `MAX_WINDOW_PINS` windows, least recently used dropped first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import numpy as np

from ..utils import cdiv
from .block_pool import BlockPool
from .sequence import Sequence

MAX_WINDOW_PINS = 4  # shared prefixes whose last window the windowed group keeps (see the module docstring)

HashFn = Callable[[bytes | None, tuple[int, ...], bytes], bytes]


class SecondTier(Protocol):
    """A store of full blocks by hash, below the pool (core moves no bytes: the engine does)."""

    def lookup(self, block_hashes: list[bytes], token_ids: list[tuple[int, ...]]) -> int:
        """How many leading blocks of `block_hashes` it can supply (made ready for loading)."""

    def wants(self, block_hash: bytes) -> bool:
        """Whether a newly full block with this hash should be handed to it."""


class StateCheckpoints(Protocol):
    """A hybrid model's recurrent-state checkpoints by block hash (worker/state_cache.py): a
    prefix hit may end only at a block whose checkpoint exists, where the recurrent layers resume."""

    def has(self, block_hash: bytes) -> bool:
        """Whether the state after the block with this hash (and every block before it) is kept."""


def sha256_block_hash(parent: bytes | None, token_ids: tuple[int, ...], extra_key: bytes) -> bytes:
    """SHA-256 of (parent hash, the block's token ids as int64, extra key)."""
    h = hashlib.sha256()
    h.update(parent or b"\0" * 32)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(extra_key)
    return h.digest()


class Copies(list):
    """Copy-on-write copies `(src, dst)` of the full-attention group, and in `window` those of the
    windowed group (`BlockManager.window_pool`'s block ids)."""

    def __init__(self, copies=(), window=()):
        super().__init__(copies)
        self.window = list(window)


class Loads(list):
    """Blocks taken from the second tier, `(block_hash, block_id)`, and in `window` the
    `(block_hash, window block id)` of those the windowed group needs (the hit's last window)."""

    def __init__(self, loads=(), window=()):
        super().__init__(loads)
        self.window = list(window)


NO_COPIES = Copies()  # what the usual decode gets back: read, never changed


def blocks_for_request(num_prompt_tokens: int, n: int, max_tokens: int, block_size: int) -> int:
    """Blocks one request holds at most: its n samples at full length, sharing the prompt's full blocks."""
    shared = num_prompt_tokens // block_size if n > 1 else 0
    per_sample = cdiv(num_prompt_tokens + max_tokens - 1, block_size) - shared
    return shared + n * per_sample


class BlockManager:
    """Keeps each sequence's block table in step with its stored tokens.

    All methods that can run out of blocks are atomic: they return `None` (or `False`) and change
    nothing when the pool cannot satisfy them. Writing into a block with `ref_cnt > 1` never
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
        window: int | None = None,
        window_blocks: int | None = None,
    ):
        """`window`: the windowed layers' sliding window (the largest, if they differ), which gives
        them a group of their own with `window_blocks` blocks (default `num_blocks`); None: one group."""
        if block_size < 1 or block_size > 256 or block_size & (block_size - 1):
            raise ValueError(f"block size must be a power of two from 1 to 256, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.extra_key = extra_key
        self.num_cow_copies = 0
        self.second_tier: SecondTier | None = None
        self.checkpoints: StateCheckpoints | None = None  # set for a hybrid model: hits end at a checkpoint
        self.to_store: list[tuple[bytes, int, tuple[int, ...]]] = []  # (block_hash, block_id, token_ids)
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.window_pool = BlockPool(window_blocks or num_blocks) if window is not None else None
        # pinned windows: the hash of a shared prefix's last block -> the windowed group's blocks
        # its window sees (one reference each), least recently used first
        self.window_pins: OrderedDict[bytes, list] = OrderedDict()
        self._pin_at: dict[Sequence, tuple[int, bytes]] = {}  # a sequence filling a pin: (blocks, hash)

    # -- sizing ---------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, table: list | None = None) -> int:
        """Fresh blocks `allocate_slots(seq, num_new_tokens)` would take (copy-on-write included)
        from the pool of `table` (default: the full-attention group's `block_table`)."""
        bs = self.block_size
        table = seq.block_table if table is None else table
        end = seq.num_computed_tokens + num_new_tokens
        need = max(0, self.blocks_for(end) - len(table))
        if num_new_tokens and seq.num_computed_tokens % bs and table[-1].ref_cnt > 1:
            need += 1
        return need

    def first_in_window(self, num_tokens: int) -> int:
        """The first block a token at position `num_tokens` (or later) can see through the window:
        blocks before it hold only positions below `num_tokens - window + 1`."""
        return max(0, (num_tokens - self.window + 1) // self.block_size) if self.window is not None else 0

    def fits(self, num_tokens: int, headroom: int = 0) -> bool:
        """Whether an empty sequence's first `num_tokens` tokens fit in the free blocks, with
        `headroom` full-group blocks to spare (the windowed group needs at most a window's worth)."""
        need = self.blocks_for(num_tokens)
        if need + headroom > self.pool.num_free:
            return False
        return self.window_pool is None or min(need, self.blocks_for(self.window) + 1) <= self.window_pool.num_free

    def _drop_out_of_window(self, seq: Sequence) -> None:
        """Release the windowed group's blocks that no token still to compute can see. The released
        entries are always a leading run, so the scan walks back from the window to the run."""
        table = seq.window_table
        i = min(self.first_in_window(seq.num_computed_tokens), len(table)) - 1
        while i >= 0 and table[i] is not None:
            self._release_window_block(seq, i)
            i -= 1

    def _release_window_block(self, seq: Sequence, i: int) -> None:
        """Drop `seq`'s reference to its windowed block `i`; a block of the window the sequence is
        filling a pin for (and that is its hash's cached block) moves its reference to the pin."""
        block, seq.window_table[i] = seq.window_table[i], None
        seq.window_ids[i] = 0
        pin = self._pin_at.get(seq)
        if (
            pin is not None
            and self.first_in_window(pin[0] * self.block_size) <= i < pin[0]
            and block.block_hash is not None
            and self.window_pool.cached.get(block.block_hash) is block
        ):
            self.window_pins.setdefault(pin[1], []).append(block)
            self.window_pins.move_to_end(pin[1])
            while len(self.window_pins) > MAX_WINDOW_PINS:
                for b in self.window_pins.popitem(last=False)[1]:
                    self.window_pool.release(b)
        else:
            self.window_pool.release(block)

    def release_window_pins(self) -> None:
        """Drop every pinned window (an idle engine trimming its pools): the blocks stay cached."""
        for blocks in self.window_pins.values():
            for b in blocks:
                self.window_pool.release(b)
        self.window_pins.clear()

    # -- the allocator ----------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> Copies | None:
        """Make room to store `num_new_tokens` more tokens of `seq`.

        Returns the (src, dst) block copies to apply before writing (copy-on-write of a shared,
        partly filled last block; the windowed group's in `.window`), or `None` with nothing
        changed if a pool is short (but the windowed group's blocks out of the window are
        released first: no token can see them whatever happens).
        """
        if num_new_tokens < 0:
            raise ValueError("num_new_tokens must be >= 0")
        wpool = self.window_pool
        if wpool is not None:
            self._drop_out_of_window(seq)
        table, computed = seq.block_table, seq.num_computed_tokens
        if computed + num_new_tokens <= len(table) * self.block_size and (
            not computed % self.block_size
            or (table[-1].ref_cnt == 1 and (wpool is None or seq.window_table[-1].ref_cnt == 1))
        ):
            return NO_COPIES  # the usual decode: room in its own last block (what the general path finds, cheaper)
        if self.blocks_needed(seq, num_new_tokens) > self.pool.num_free:
            return None
        if wpool is not None and self.blocks_needed(seq, num_new_tokens, seq.window_table) > wpool.num_free:
            return None
        copies = Copies()
        if num_new_tokens and seq.num_computed_tokens % self.block_size:
            last = seq.block_table[-1]
            if last.ref_cnt > 1:
                fresh = self.pool.allocate()
                copies.append((last.block_id, fresh.block_id))
                self.pool.release(last)
                seq.block_table[-1] = fresh
                seq.table_ids[-1] = fresh.block_id
                self.num_cow_copies += 1
                # The copy is the target pool's: a draft model's rows of that block start over.
                start = (len(seq.block_table) - 1) * self.block_size
                seq.draft_computed = min(seq.draft_computed, start)
            if wpool is not None and seq.window_table[-1].ref_cnt > 1:
                last, fresh = seq.window_table[-1], wpool.allocate()
                copies.window.append((last.block_id, fresh.block_id))
                wpool.release(last)
                seq.window_table[-1] = fresh
                seq.window_ids[-1] = fresh.block_id
        end = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) < self.blocks_for(end):
            block = self.pool.allocate()
            seq.block_table.append(block)
            seq.table_ids.append(block.block_id)
            if wpool is not None:
                block = wpool.allocate()
                seq.window_table.append(block)
                seq.window_ids.append(block.block_id)
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's blocks and stored-token count, sharing every block."""
        for block in parent.block_table:
            self.pool.acquire(block)
        child.block_table = list(parent.block_table)
        child.table_ids = parent.table_ids.copy()
        if self.window_pool is not None:
            for block in parent.window_table:
                if block is not None:
                    self.window_pool.acquire(block)
            child.window_table = list(parent.window_table)
            child.window_ids = parent.window_ids.copy()
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.draft_computed = parent.draft_computed
        child.cache_salt = parent.cache_salt
        child.state = parent.state

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, tail first, so the LRU evicts its tail before its head."""
        for block in reversed(seq.block_table):
            self.pool.release(block)
        for i in reversed(range(len(seq.window_table))):
            if seq.window_table[i] is not None:
                self._release_window_block(seq, i)
        self._pin_at.pop(seq, None)
        seq.block_table = []
        seq.window_table = []
        seq.table_ids.truncate(0)
        seq.window_ids.truncate(0)
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
        if self.window_pool is not None and seq.window_table[self.first_in_window(num_tokens) :].count(None):
            raise ValueError(f"cannot truncate to {num_tokens} tokens: the window's blocks there were released")
        keep = self.blocks_for(num_tokens)
        for block in reversed(seq.block_table[keep:]):
            self.pool.release(block)
        del seq.block_table[keep:]
        seq.table_ids.truncate(keep)
        for block in reversed(seq.window_table[keep:]):
            self.window_pool.release(block)
        del seq.window_table[keep:]
        seq.window_ids.truncate(keep)
        seq.num_computed_tokens = num_tokens
        seq.draft_computed = min(seq.draft_computed, num_tokens)

    # -- prefix caching ----------------------------------------------------------------------
    def _block_hash(self, seq: Sequence, i: int) -> bytes:
        parent = seq.block_hashes[i - 1] if i else None
        tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
        # a salted request's chain starts from its salt (vLLM's cache_salt): other salts never match it
        return self.hash_fn(parent, tokens, self.extra_key + seq.cache_salt if i == 0 else self.extra_key)

    def match_prefix(self, seq: Sequence, num_tokens: int | None = None) -> int:
        """Take cached blocks for an empty sequence's leading full blocks; return tokens reused.

        Considers the first `num_tokens` tokens (all by default), stops at the first miss and
        never covers the last of them, which must be computed (its logits, or a fork point).
        The hit ends where every group can resume: the windowed group needs only the blocks the
        window sees from there, a hybrid model's recurrent layers a kept checkpoint. Cannot fail:
        hits take no fresh block.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        limit = seq.num_tokens if num_tokens is None else num_tokens
        hits: list[tuple[bytes, tuple[int, ...], object]] = []  # (hash, tokens, full-group block)
        for i in range((limit - 1) // bs):
            t = self._tokens(seq, i)
            parent = hits[-1][0] if hits else None
            h = self.hash_fn(parent, t, self.extra_key + seq.cache_salt if i == 0 else self.extra_key)
            block = self.pool.lookup(h, t)
            if block is None:
                break
            hits.append((h, t, block))
        k = self._resume_point(hits, len(hits))
        if self.window_pool is not None and hits:
            key = hits[-1][0]
            if k < len(hits) and key not in self.window_pins:  # this sequence recomputes the window there
                self._pin_at[seq] = (len(hits), key)
            elif k == len(hits) and key in self.window_pins:
                self.window_pins.move_to_end(key)
        tier = self.second_tier
        for h, t, block in hits[:k]:
            self.pool.acquire(block)
            seq.block_table.append(block)
            seq.table_ids.append(block.block_id)
            seq.block_hashes.append(h)
            # A hit is a prompt block of this request, but memory may hold it alone: a block that an
            # earlier answer filled (an agent's history comes back in its next prompt) was never a
            # prompt block before. The disk tier takes it now, or the chain on disk breaks there.
            if tier is not None and tier.wants(h):
                self.to_store.append((h, block.block_id, t))
        if self.window_pool is not None:
            first = self.first_in_window(k * bs)
            seq.window_table = [None] * first
            seq.window_ids.truncate(0)
            seq.window_ids.extend([0] * first)
            for h, t, _ in hits[first:k]:
                block = self.window_pool.lookup(h, t)
                self.window_pool.acquire(block)
                seq.window_table.append(block)
                seq.window_ids.append(block.block_id)
        seq.num_computed_tokens = k * bs
        return seq.num_computed_tokens

    def _tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def _resume_point(self, hits: list, k: int) -> int:
        """The most of the first `k` named blocks `hits` (hash, tokens, ...) a hit may take: the
        windowed group holds the blocks its window sees from there, and a hybrid model keeps the
        recurrent state there."""
        while k:
            miss = None
            if self.window_pool is not None:
                for i in range(k - 1, self.first_in_window(k * self.block_size) - 1, -1):
                    if self.window_pool.lookup(hits[i][0], hits[i][1]) is None:
                        miss = i
                        break
            if miss is not None:
                k = miss  # every hit past a missing window block needs it
            elif self.checkpoints is not None and not self.checkpoints.has(hits[k - 1][0]):
                k -= 1
            else:
                return k
        return 0

    def match_second_tier(self, seq: Sequence, num_tokens: int | None = None) -> Loads:
        """After `match_prefix`, take fresh blocks for the leading blocks the second tier has.

        Same limit as `match_prefix` (never the last token). The blocks join the table and the
        prefix cache at once; returns their (block_hash, block_id) for the engine to fill before
        the next forward pass (and in `.window` the windowed group's fresh blocks, the window's
        tail of the hit only). Takes only free blocks, so it cannot fail.
        """
        if self.second_tier is None or not self.enable_prefix_caching:
            return Loads()
        bs = self.block_size
        limit = seq.num_tokens if num_tokens is None else num_tokens
        first, last = len(seq.block_table), (limit - 1) // bs
        if first >= last or len(seq.block_hashes) != first:
            return Loads()
        hashes, tokens = [], []
        parent = seq.block_hashes[-1] if first else None
        for i in range(first, last):
            t = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = self.hash_fn(parent, t, self.extra_key + seq.cache_salt if i == 0 else self.extra_key)
            hashes.append(parent)
            tokens.append(t)
        n = min(self.second_tier.lookup(hashes, tokens), self.pool.num_free)
        wpool = self.window_pool
        while n and wpool is not None and n - max(0, self.first_in_window((first + n) * bs) - first) > wpool.num_free:
            n -= 1  # the windowed group takes a fresh block for each loaded block its window sees
        if self.checkpoints is not None:  # as in match_prefix: the hit ends where a state is kept
            while n and not self.checkpoints.has(hashes[n - 1]):
                n -= 1
        loads = Loads()
        for h, t in zip(hashes[:n], tokens[:n]):
            block = self.pool.allocate()
            self.pool.cache(block, h, t)
            seq.block_table.append(block)
            seq.table_ids.append(block.block_id)
            seq.block_hashes.append(h)
            loads.append((h, block.block_id))
        if wpool is not None and n:
            start = self.first_in_window((first + n) * bs)
            for i in range(min(start, first)):  # memory hits the loaded blocks moved the window past
                if seq.window_table[i] is not None:
                    wpool.release(seq.window_table[i])
                    seq.window_table[i] = None
                    seq.window_ids[i] = 0
            seq.window_table += [None] * max(0, start - first)
            seq.window_ids.extend([0] * max(0, start - first))
            for h, t in zip(hashes[max(0, start - first) : n], tokens[max(0, start - first) : n]):
                block = wpool.allocate()
                wpool.cache(block, h, t)
                seq.window_table.append(block)
                seq.window_ids.append(block.block_id)
                loads.window.append((h, block.block_id))
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
        """Name (and cache) the blocks that became full since the last call."""
        if not self.enable_prefix_caching:
            return
        while len(seq.block_hashes) < seq.num_computed_tokens // self.block_size:
            i = len(seq.block_hashes)
            h = self._block_hash(seq, i)
            seq.block_hashes.append(h)
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            self.pool.cache(seq.block_table[i], h, tokens)
            if self.window_pool is not None and seq.window_table[i] is not None:
                self.window_pool.cache(seq.window_table[i], h, tokens)
            # the disk tier keeps prompt blocks only: a generated block is rarely asked for again
            prompt_block = (i + 1) * self.block_size <= seq.num_prompt_tokens
            if self.second_tier is not None and prompt_block and self.second_tier.wants(h):
                self.to_store.append((h, seq.block_table[i].block_id, tokens))

    # -- accounting ----------------------------------------------------------------------------
    def check(self, seqs: list[Sequence]) -> None:
        """Assert the pool's invariants and that reference counts equal table occurrences."""
        self.pool.check()
        counts = [0] * self.pool.num_blocks
        for s in seqs:
            assert len(s.block_table) >= self.blocks_for(s.num_computed_tokens)
            assert s.table_ids.list == [b.block_id for b in s.block_table], "table_ids differ from the table"
            assert s.table_ids.buf[: len(s.table_ids)].tolist() == s.table_ids.list
            if self.window_pool is not None:
                want = [0 if b is None else b.block_id for b in s.window_table]
                assert s.window_ids.list == want == s.window_ids.buf[: len(want)].tolist(), (
                    "window_ids differ from the table"
                )
            for b in s.block_table:
                counts[b.block_id] += 1
        for b in self.pool.blocks:
            assert b.ref_cnt == counts[b.block_id], (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} != {counts[b.block_id]} tables"
            )
        if self.window_pool is None:
            return
        wpool = self.window_pool
        wpool.check()
        counts = [0] * wpool.num_blocks
        for s in seqs:
            table = s.window_table
            assert len(table) == len(s.block_table), "the groups' tables differ in length"
            # what a token still to compute can see is held; only a leading run before it is released
            released = table.count(None)
            assert released <= self.first_in_window(s.num_computed_tokens), "a block in the window was released"
            assert None not in table[released:], "released blocks are not a leading run"
            for b in table:
                if b is not None:
                    counts[b.block_id] += 1
        assert len(self.window_pins) <= MAX_WINDOW_PINS
        for blocks in self.window_pins.values():
            for b in blocks:
                counts[b.block_id] += 1
        for b in wpool.blocks:
            assert b.ref_cnt == counts[b.block_id], (
                f"window block {b.block_id}: ref_cnt {b.ref_cnt} != {counts[b.block_id]}"
            )
