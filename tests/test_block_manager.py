"""The allocator: reference counts, copy-on-write, fork, free, prefix cache, against a shadow model."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxpaged.core.block_manager import BlockManager
from mlxpaged.core.sequence import Sequence


class ShadowKV:
    """What each pool slot holds, written only through the allocator's tables and copies.

    A slot holds the token's whole context (every token up to and including it), not only its
    value: a real K/V row depends on everything before it, so a block reused under another
    prefix (a broken parent chain in the block hash) reads back the wrong context.
    """

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.slots = {}  # (block_id, offset) -> token

    def write(self, seq: Sequence, n: int) -> None:
        copies = self.bm.allocate_slots(seq, n)
        assert copies is not None
        for src, dst in copies[0] if copies else ():  # group 0's (the only group)
            for o in range(self.bm.block_size):
                if (src, o) in self.slots:
                    self.slots[(dst, o)] = self.slots[(src, o)]
        bs = self.bm.block_size
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block = seq.block_table[p // bs]
            assert block.ref_cnt == 1, "write into a shared block"
            self.slots[(block.block_id, p % bs)] = tuple(seq.token_ids[: p + 1])
        seq.num_computed_tokens += n
        self.bm.cache_full_blocks(seq)

    def contexts(self, seq: Sequence) -> list[tuple[int, ...] | None]:
        bs = self.bm.block_size
        return [self.slots.get((seq.block_table[p // bs].block_id, p % bs)) for p in range(seq.num_computed_tokens)]

    def read(self, seq: Sequence) -> list[int | None]:
        return [c[-1] if c else None for c in self.contexts(seq)]


ops = st.lists(
    st.tuples(st.sampled_from(["new", "grow", "fork", "free"]), st.integers(0, 7), st.integers(1, 40)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_blocks=st.integers(1, 48),
    caching=st.booleans(),
    vocab=st.integers(2, 5),
)
def test_random_operations_keep_invariants(ops, block_size, num_blocks, caching, vocab):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    kv = ShadowKV(bm)
    seqs: list[Sequence] = []
    counter = 0
    for op, which, n in ops:
        counter += 1
        if op == "new":
            s = Sequence([(counter * 7 + i) % vocab for i in range(n)], n)
            bm.match_prefix(s)
            assert s.num_computed_tokens < s.num_tokens
            need = s.num_tokens - s.num_computed_tokens
            if bm.blocks_needed(s, need) <= bm.pool.num_free:
                kv.write(s, need)
                seqs.append(s)
            else:
                table = list(s.block_table)
                assert bm.allocate_slots(s, need) is None and s.block_table == table  # "no room", nothing changed
                bm.free(s)  # give back the prefix hits
        elif seqs:
            s = seqs[which % len(seqs)]
            if op == "grow":
                s.token_ids += [(counter + i) % vocab for i in range(n)]
                snapshot = ([b.block_id for b in s.block_table], bm.pool.num_free)
                if bm.blocks_needed(s, n) <= bm.pool.num_free:
                    kv.write(s, n)
                else:
                    assert bm.allocate_slots(s, n) is None  # "no room", and nothing changed
                    assert ([b.block_id for b in s.block_table], bm.pool.num_free) == snapshot
                    del s.token_ids[-n:]
            elif op == "fork":
                child = Sequence(list(s.token_ids[: s.num_computed_tokens]), 1)
                bm.fork(s, child)
                seqs.append(child)
            elif op == "free":
                bm.free(s)
                seqs.remove(s)
        bm.check(seqs)
        for s in seqs:  # every sequence reads back exactly its own tokens, each in its own context
            assert kv.contexts(s) == [tuple(s.token_ids[: p + 1]) for p in range(s.num_computed_tokens)]
    for s in seqs:
        bm.free(s)
    assert bm.pool.num_free == num_blocks and all(b.ref_cnt == 0 for b in bm.pool.blocks)


def test_cow_copies_partial_shared_block_only():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    kv = ShadowKV(bm)
    a = Sequence(list(range(6)), 6)
    kv.write(a, 6)  # blocks [0..3] full, [4, 5] partial
    b = Sequence(list(range(6)), 6)
    bm.fork(a, b)
    a.token_ids.append(100)
    kv.write(a, 1)
    assert bm.num_cow_copies == 1 and a.block_table[0] is b.block_table[0] and a.block_table[1] is not b.block_table[1]
    b.token_ids.append(200)
    kv.write(b, 1)  # b is the last holder now: writes in place
    assert bm.num_cow_copies == 1
    assert kv.read(a) == list(range(6)) + [100] and kv.read(b) == list(range(6)) + [200]


def test_draft_rows_follow_the_blocks():
    """`draft_computed` (a draft model's rows in the same blocks) never counts rows the draft's
    pool does not hold: a fork shares them, copy-on-write starts the copied block over (the copy
    is made in the target's pool), a rollback cuts it, freeing resets it."""
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    a = Sequence(list(range(7)), 7)
    assert bm.allocate_slots(a, 7) == []
    a.num_computed_tokens = a.draft_computed = 6  # blocks [0..3] full, [4, 5] partial
    b = Sequence(list(range(7)), 7)
    bm.fork(a, b)
    assert b.draft_computed == 6
    assert bm.allocate_slots(a, 1) != [] and a.draft_computed == 4  # its block 1 is a copy now
    assert b.draft_computed == 6 and bm.allocate_slots(b, 1) == []  # last holder: no copy, rows kept
    assert b.draft_computed == 6
    b.num_computed_tokens = 7
    bm.truncate(b, 5)
    assert b.draft_computed == 5
    bm.free(b)
    assert b.draft_computed == 0


def test_no_room_is_none_not_a_crash():
    bm = BlockManager(2, 4)
    s = Sequence(list(range(12)), 12)
    assert bm.allocate_slots(s, 12) is None and s.block_table == [] and bm.pool.num_free == 2
    assert bm.allocate_slots(s, 8) == [] and bm.pool.num_free == 0
    s.num_computed_tokens = 8
    assert bm.allocate_slots(s, 1) is None and len(s.block_table) == 2


@pytest.mark.parametrize("bad", [0, 3, 512, -16])
def test_block_size_must_be_power_of_two(bad):
    with pytest.raises(ValueError):
        BlockManager(8, bad)


def test_prefix_rule_of_the_seed():
    """A: 96 prompt tokens; B shares A's first 85 -> 80 reused; C differs at token 3 -> 0."""
    bm = BlockManager(64, 16)
    kv = ShadowKV(bm)
    a_tokens = [1000 + i for i in range(96)]
    a = Sequence(list(a_tokens), 96)
    assert bm.match_prefix(a) == 0
    kv.write(a, 96)
    bm.free(a)  # finished: its blocks stay cached
    b = Sequence(a_tokens[:85] + [7] * 20, 105)
    assert bm.match_prefix(b) == 80
    c = Sequence(a_tokens[:2] + [5] + a_tokens[3:], 96)
    assert bm.match_prefix(c) == 0
    again = Sequence(list(a_tokens), 96)
    assert bm.match_prefix(again) == 80  # all but the last block's worth: never the last token
    bm.free(b)
    bm.free(again)
    short = Sequence(a_tokens[:16], 16)
    assert bm.match_prefix(short) == 0  # one block, holding the last token


def test_hash_collision_is_a_miss():
    """Force every block onto one hash: the second request must not read the first's cache."""
    bm = BlockManager(16, 4, hash_fn=lambda parent, tokens, extra: b"same")
    kv = ShadowKV(bm)
    a = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9], 9)
    kv.write(a, 9)
    bm.free(a)
    b = Sequence([9, 9, 9, 9, 5, 6, 7, 8, 9], 9)
    assert bm.match_prefix(b) == 0
    same = Sequence([1, 2, 3, 4, 0, 0, 0, 0, 1], 9)
    assert bm.match_prefix(same) == 4  # block 0 really matches; block 1's hash hits a different block


def test_lru_evicts_tail_before_head():
    bm = BlockManager(6, 4)
    kv = ShadowKV(bm)
    a = Sequence(list(range(16)), 16)  # four full blocks
    kv.write(a, 16)
    head, tail = a.block_table[0], a.block_table[-1]
    bm.free(a)
    assert len(bm.pool.cached) == 4
    fresh = [bm.pool.allocate() for _ in range(3)]  # 2 never-used blocks, then the oldest cached one
    assert tail in fresh and head not in fresh and head.block_hash is not None


def test_block_reused_only_under_its_own_parent():
    """A = [X, W, t] and C = [Z, Y, t] are cached; B = [X, Y, t] may reuse X (A's first block)
    but not C's Y, which was computed after Z: the hash chains the parent."""
    bs = 4
    X, W, Z, Y, t = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [17]
    bm = BlockManager(32, bs, enable_prefix_caching=True)
    kv = ShadowKV(bm)
    for prompt in (X + W + t, Z + Y + t):
        s = Sequence(list(prompt), len(prompt))
        assert bm.match_prefix(s) == 0
        kv.write(s, len(prompt))
        bm.free(s)  # the full blocks stay cached
    b = Sequence(X + Y + t, 9)
    assert bm.match_prefix(b) == bs  # X only
    kv.write(b, b.num_tokens - b.num_computed_tokens)
    assert kv.contexts(b) == [tuple(b.token_ids[: p + 1]) for p in range(9)]
    again = Sequence(Z + Y + [99], 9)
    assert bm.match_prefix(again) == 2 * bs  # the same chain does match whole
