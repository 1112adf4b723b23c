"""KV cache groups: one class per kind of attention cache, after vLLM v1's `SingleTypeKVCacheManager`.

A model's layers fall into groups by what their cache must keep (models/cache_spec.py declares
each layer's). Each group has its own `BlockPool`, and each sequence holds one table per group
(`Sequence.tables[g]`), every table with one entry per logical block of the sequence: the same
token slots, named by the same hash, in each group. A group decides only what differs between
kinds:

- which blocks a token still to compute can read (`first_needed`): the others go back to the
  pool while the sequence runs (an entry then reads None);
- how many blocks an empty sequence's first tokens need at most (`peak_blocks`);
- where a prefix hit of the first `k` named blocks may resume (`resume_point`), and which of
  those blocks it takes (`first_needed` again).

`BlockManager` (block_manager.py) is a loop over the groups and names no kind. Group 0 is always
a `FullAttentionGroup`: it holds every block of every sequence, so its table is the one the draft
model, the disk tier and the cache's readers use (`Sequence.block_table`).

A group that holds no blocks (`holds_blocks` False: a hybrid model's recurrent state, whose
states the runner keeps per sequence) takes part in prefix hits only (`resume_point`, `loadable`).

A new kind of cache is one subclass here and one line in `GROUP_KINDS`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from ..utils import cdiv
from .block_pool import BlockPool

if TYPE_CHECKING:
    from .block_pool import Block
    from .sequence import Sequence

MAX_PINS = 4  # shared prefixes whose last blocks a local group keeps (`LocalAttentionGroup`)


@dataclass(frozen=True)
class GroupSpec:
    """One group of a model's cache: its kind (a key of `GROUP_KINDS`), its span in tokens (a
    sliding window, an attention chunk; None for full attention) and its pool's starting length
    (None: the block manager's `num_blocks`)."""

    kind: str
    span: int | None = None
    num_blocks: int | None = None


class KVCacheGroup:
    """The blocks of one kind of cache. Invariant: every sequence's table in this group has the
    length of its table in group 0; an entry is None only where `releases` and it lies wholly
    before `first_needed(num_computed_tokens)`; each held entry holds one reference of `pool`."""

    kind: ClassVar[str]
    releases: ClassVar[bool] = False  # whether blocks go back while the sequence runs
    holds_blocks: ClassVar[bool] = True  # False: no pool, no tables; it only rules on prefix hits

    def __init__(self, block_size: int, num_blocks: int, span: int | None = None):
        self.block_size = block_size
        self.span = span
        self.pool = BlockPool(num_blocks)

    def first_needed(self, num_tokens: int) -> int:
        """The first block a token at position `num_tokens` (or later) reads."""
        return 0

    def peak_blocks(self, need: int) -> int:
        """Blocks this group holds at most for a sequence that holds `need` blocks in group 0."""
        return need

    def resume_point(self, hashes, k: int) -> int:
        """The most of the first `k` named blocks of a prompt (`hashes[i]`: (hash, token ids)) a
        prefix hit may take in this group."""
        pool = self.pool
        for i in range(k):
            h, t = hashes[i]
            if pool.lookup(h, t) is None:
                return i
        return k

    def loadable(self, hashes, first: int, n: int) -> int:
        """The most of `n` blocks from block `first` on (`hashes[i]`: block `first + i`'s (hash,
        token ids)), taken from the second tier, this group can take: it has fresh blocks for them."""
        return min(n, self.pool.num_free)

    def matched(self, seq: Sequence, run: int, k: int, hashes) -> None:
        """A prefix hit of `k` blocks was taken where group 0 alone held `run` (a hook: a group may
        keep what the next request sharing the prefix needs)."""

    def release(self, seq: Sequence, g: int, i: int) -> None:
        """Drop `seq`'s reference to its block `i` of this group (group index `g`)."""
        block, seq.tables[g][i] = seq.tables[g][i], None
        seq.ids[g][i] = 0
        self.pool.release(block)

    def release_unread(self, seq: Sequence, g: int) -> None:
        """Release the blocks no token still to compute reads (a no-op for a kind that keeps all)."""

    def free(self, seq: Sequence, g: int) -> None:
        """Drop every reference `seq`'s table in this group (group index `g`) holds, tail first
        (so the LRU evicts a sequence's tail before its head); the table itself is left as it is."""
        for block in reversed(seq.tables[g]):
            if block is not None:
                self.pool.release(block)

    def trim(self) -> None:
        """Drop what the group keeps beyond the sequences' tables (an idle engine trims its pools)."""

    def check_extra(self, counts: list[int]) -> None:
        """Add the references the group holds beyond the tables to `counts` (by block id)."""


class FullAttentionGroup(KVCacheGroup):
    """Full attention: every token reads every earlier one, so a sequence holds all its blocks."""

    kind = "full"


class LocalAttentionGroup(KVCacheGroup):
    """Attention over a span that moves with the token (a sliding window, an attention chunk): a
    block wholly before what the next token reads goes back to the pool while the sequence runs,
    and a prefix hit needs only the blocks the hit's end reads (vLLM's `SlidingWindowManager`).

    It keeps a few shared prefixes' last blocks pinned (`pins`): when a prompt's hit in group 0 is
    cut short because this group lost the blocks at its end (a shared system prompt computed by an
    earlier request that has moved on), the sequence that recomputes it keeps those blocks
    referenced when it moves past them, so the next request sharing the prefix takes the whole
    hit. At most `MAX_PINS` prefixes, least recently used dropped first.
    """

    releases = True

    def __init__(self, block_size: int, num_blocks: int, span: int | None = None):
        if span is None or span < 1:
            raise ValueError(f"a {self.kind} group needs a span >= 1 tokens, got {span}")
        super().__init__(block_size, num_blocks, span)
        # a shared prefix's last block hash -> this group's blocks the prefix's end reads (one
        # reference each), least recently used first
        self.pins: OrderedDict[bytes, list[Block]] = OrderedDict()
        self._pin_at: dict[Sequence, tuple[int, bytes]] = {}  # a sequence filling a pin: (blocks, hash)

    def peak_blocks(self, need: int) -> int:
        return min(need, cdiv(self.span, self.block_size) + 1)

    def resume_point(self, hashes, k: int) -> int:
        pool = self.pool
        while k:
            for i in range(k - 1, self.first_needed(k * self.block_size) - 1, -1):
                if pool.lookup(*hashes[i]) is None:
                    k = i  # every hit past a missing block needs it
                    break
            else:
                return k
        return 0

    def loadable(self, hashes, first: int, n: int) -> int:
        while n and n - max(0, self.first_needed((first + n) * self.block_size) - first) > self.pool.num_free:
            n -= 1  # a fresh block for each loaded block the hit's end reads
        return n

    def matched(self, seq: Sequence, run: int, k: int, hashes) -> None:
        if not run:
            return
        key = hashes[run - 1][0]
        if k < run and key not in self.pins:  # this sequence recomputes the blocks there
            self._pin_at[seq] = (run, key)
        elif k == run and key in self.pins:
            self.pins.move_to_end(key)

    def release_unread(self, seq: Sequence, g: int) -> None:
        # the released entries are always a leading run, so the scan walks back from the first needed
        table = seq.tables[g]
        i = min(self.first_needed(seq.num_computed_tokens), len(table)) - 1
        while i >= 0 and table[i] is not None:
            self.let_go(seq, g, i)
            i -= 1

    def let_go(self, seq: Sequence, g: int, i: int) -> None:
        """`release`, where a pin may keep the block instead: a block of the prefix end the
        sequence is filling a pin for (and that is its hash's cached block) moves its reference
        to the pin."""
        block = seq.tables[g][i]
        pin = self._pin_at.get(seq)
        if (
            pin is not None
            and self.first_needed(pin[0] * self.block_size) <= i < pin[0]
            and block.block_hash is not None
            and self.pool.cached.get(block.block_hash) is block
        ):
            seq.tables[g][i] = None
            seq.ids[g][i] = 0
            self.pins.setdefault(pin[1], []).append(block)
            self.pins.move_to_end(pin[1])
            while len(self.pins) > MAX_PINS:
                for b in self.pins.popitem(last=False)[1]:
                    self.pool.release(b)
        else:
            self.release(seq, g, i)

    def free(self, seq: Sequence, g: int) -> None:
        table = seq.tables[g]
        for i in reversed(range(len(table))):
            if table[i] is not None:
                self.let_go(seq, g, i)  # a pin may keep it
        self._pin_at.pop(seq, None)

    def trim(self) -> None:
        """Drop every pin: the blocks stay cached."""
        for blocks in self.pins.values():
            for b in blocks:
                self.pool.release(b)
        self.pins.clear()

    def check_extra(self, counts: list[int]) -> None:
        assert len(self.pins) <= MAX_PINS
        for blocks in self.pins.values():
            for b in blocks:
                counts[b.block_id] += 1


class SlidingWindowGroup(LocalAttentionGroup):
    """A sliding window of `span` tokens: a token at position p reads positions p - span + 1 .. p."""

    kind = "sliding_window"

    def first_needed(self, num_tokens: int) -> int:
        return max(0, (num_tokens - self.span + 1) // self.block_size)


class ChunkedLocalGroup(LocalAttentionGroup):
    """Chunked local attention (Llama 4): a token at position p reads its own chunk of `span`
    positions up to p, so a chunk's blocks go back once the next chunk starts."""

    kind = "chunked_local"

    def first_needed(self, num_tokens: int) -> int:
        return num_tokens // self.span * self.span // self.block_size


class StateCheckpoints(Protocol):
    """A hybrid model's recurrent-state checkpoints by block hash (worker/state_cache.py)."""

    def has(self, block_hash: bytes) -> bool:
        """Whether the state after the block with this hash (and every block before it) is kept."""


class RecurrentStateGroup(KVCacheGroup):
    """A hybrid model's recurrent layers (vLLM's `MambaManager`): each sequence's state is its own,
    one slot a sequence that the model runner keeps (`Sequence.state`, worker/state_cache.py), and
    the states after full blocks are kept as checkpoints by block hash; a prefix hit may end only
    at a block whose checkpoint exists, where the recurrent layers resume. Holds no blocks."""

    kind = "recurrent_state"
    holds_blocks = False

    def __init__(self, checkpoints: StateCheckpoints):
        self.block_size = 0
        self.span = None
        self.pool = None
        self.checkpoints = checkpoints

    def resume_point(self, hashes, k: int) -> int:
        while k and not self.checkpoints.has(hashes[k - 1][0]):
            k -= 1
        return k

    def loadable(self, hashes, first: int, n: int) -> int:
        return self.resume_point(hashes, n)


# The kinds of group a model's cache may declare (models/cache_spec.py), by name.
GROUP_KINDS: dict[str, type[KVCacheGroup]] = {
    "full": FullAttentionGroup,
    "sliding_window": SlidingWindowGroup,
    "chunked_local": ChunkedLocalGroup,
}


def make_group(spec: GroupSpec, block_size: int, num_blocks: int) -> KVCacheGroup:
    """The group `spec` declares, its pool `spec.num_blocks` long (default `num_blocks`)."""
    kind = GROUP_KINDS.get(spec.kind)
    if kind is None:
        raise ValueError(f"unknown KV cache group kind {spec.kind!r}; known: {', '.join(GROUP_KINDS)}")
    return kind(block_size, spec.num_blocks or num_blocks, spec.span)
