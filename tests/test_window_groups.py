"""The windowed layers' own block group (core/block_manager.py, vLLM's SlidingWindowManager): a
block wholly out of the window goes back to its pool while the sequence runs; a prefix hit needs
only the window's blocks of that group; copy-on-write, forks, truncation, the disk tier and
preemption act on both groups. The block arithmetic is checked against positions counted one by
one; the engine's tokens against mlx-lm's own model on its own caches (a RotatingKVCache on each
windowed layer), with a windowed pool small enough that released blocks are reused at once.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.core.block_manager import BlockManager
from mlxpaged.core.kv_groups import GroupSpec
from mlxpaged.core.sequence import Sequence
from mlxpaged.loading.loader import load
from mlxpaged.testing.tiny_model import write_tiny_family
from mlxpaged.worker.kv_cache import CacheShape, PagedKVCache

from drive import run_all
from reference import contiguous_generate

SYSTEM = "Paged attention borrows an idea from operating systems: virtual memory and paging. "
LONG = SYSTEM + "Copy-on-write lets many samples share the blocks of one prompt until they diverge."


def windowed(window: int, num_blocks: int | None = None) -> list[GroupSpec]:
    """A full-attention group and a sliding-window group of `window` tokens (`num_blocks` long)."""
    return [GroupSpec("full"), GroupSpec("sliding_window", window, num_blocks)]


def visible_blocks(num_tokens: int, window: int, block_size: int, num_blocks: int) -> set[int]:
    """Blocks holding a position that a token at `num_tokens` or later sees (p - window + 1 .. p),
    counted position by position."""
    lo = max(0, num_tokens - window + 1)
    return {i for i in range(num_blocks) if any(p >= lo for p in range(i * block_size, (i + 1) * block_size))}


@pytest.mark.parametrize("window", [1, 3, 4, 6, 9, 16])
def test_released_blocks_are_exactly_those_no_later_token_sees(window):
    bm = BlockManager(64, 4, groups=windowed(window))
    s = Sequence(list(range(100)), 100)
    for n in (1, 3, 5, 8, 2, 11, 1, 1, 7):  # prefill chunks and decodes across block boundaries
        assert bm.allocate_slots(s, n) is not None
        s.num_computed_tokens += n
        bm.allocate_slots(s, 0)  # releases what the next token cannot see, takes nothing
        held = {i for i, b in enumerate(s.tables[1]) if b is not None}
        assert held == visible_blocks(s.num_computed_tokens, window, 4, len(s.block_table)), (window, n)
        assert len(s.block_table) == len(s.tables[1]) and None not in s.block_table
        bm.check([s])


def test_prefix_hit_needs_only_the_window_of_the_windowed_group():
    """A sequence computed in chunks through a windowed pool of 4 blocks: its early windowed
    blocks were reused (evicted) as it ran. A later hit still covers every full block the full
    group holds where the window's blocks there are cached, and stops where they are not."""
    bm = BlockManager(64, 4, groups=windowed(6, 4))
    a = Sequence(list(range(30)), 30)
    while a.num_computed_tokens < 30:
        n = min(4, 30 - a.num_computed_tokens)
        assert bm.allocate_slots(a, n) is not None
        a.num_computed_tokens += n
        bm.cache_full_blocks(a)
        bm.check([a])
    hashes = list(a.block_hashes)
    bm.free(a)
    cached = {i for i, h in enumerate(hashes) if bm.groups[1].pool.lookup(h, tuple(range(4 * i, 4 * i + 4)))}
    assert 0 not in cached and {5, 6} <= cached  # the head was reused, the window's tail kept
    b = Sequence(list(range(30)) + [99], 31)
    assert bm.match_prefix(b) == 28  # all 7 full blocks: the window at 28 sees blocks 5 and 6
    assert [x is None for x in b.tables[1]] == [True] * 5 + [False] * 2
    bm.free(b)
    c = Sequence(list(range(22)) + [98] * 9, 31)  # shares blocks 0..4 with a
    want = max(k for k in range(6) if k == 0 or visible_blocks(4 * k, 6, 4, k) <= cached)
    assert bm.match_prefix(c) == 4 * want
    assert {i for i, x in enumerate(c.tables[1]) if x is not None} == (
        visible_blocks(4 * want, 6, 4, want) if want else set()
    )
    bm.check([c])


def test_copy_on_write_fork_and_truncate_act_on_both_groups():
    bm = BlockManager(32, 4, groups=windowed(5))
    p = Sequence(list(range(10)), 10)
    assert bm.allocate_slots(p, 10) is not None
    p.num_computed_tokens = 10
    child = Sequence(list(p.token_ids), 10)
    bm.fork(p, child)
    assert [b.ref_cnt for b in child.tables[1] if b is not None] == [2, 2, 2]
    child.token_ids.append(5)
    copies = bm.allocate_slots(child, 1)  # the shared, partly filled last block is copied in both groups
    assert copies[0] == [(p.block_table[2].block_id, child.block_table[2].block_id)]
    assert copies[1] == [(p.tables[1][2].block_id, child.tables[1][2].block_id)]
    child.num_computed_tokens = 11
    bm.check([p, child])
    child.token_ids += [1, 2, 3, 4]
    assert bm.allocate_slots(child, 4) is not None
    child.num_computed_tokens = 15
    bm.truncate(child, 12)  # a rejected proposal's slots go back in both groups
    assert len(child.block_table) == len(child.tables[1]) == 3
    bm.check([p, child])
    bm.allocate_slots(child, 0)
    with pytest.raises(ValueError, match="group 1's blocks there were released"):
        bm.truncate(child, 4)
    bm.free(child)
    bm.free(p)
    assert bm.groups[1].pool.num_used == 0 == bm.pool.num_used


def test_random_operations_keep_both_groups_consistent():
    """Allocations, forks, frees, truncations and prefix hits at random, with prompts sharing
    prefixes; after each, the invariants of both groups hold (reference counts equal table
    occurrences, nothing the window sees is released)."""
    rng = random.Random(5)
    bm = BlockManager(48, 4, groups=windowed(7, 20))
    live: list[Sequence] = []
    for _ in range(600):
        op = rng.random()
        if op < 0.25 and len(live) < 6:
            base = rng.choice([list(range(40)), list(range(100, 140))])
            s = Sequence(base[: rng.randrange(5, 40)], 0)
            s.num_prompt_tokens = len(s.token_ids)
            bm.match_prefix(s)
            live.append(s)
        elif op < 0.55 and live:
            s = rng.choice(live)
            n = rng.randrange(0, 6)
            s.token_ids += [
                rng.randrange(200, 204) for _ in range(max(0, s.num_computed_tokens + n - len(s.token_ids)))
            ]
            if bm.allocate_slots(s, n) is not None:
                s.num_computed_tokens += n
                bm.cache_full_blocks(s)
        elif op < 0.65 and live:
            parent = rng.choice(live)
            child = Sequence(list(parent.token_ids), parent.num_prompt_tokens)
            bm.fork(parent, child)
            live.append(child)
        elif op < 0.75 and live:
            s = rng.choice(live)
            keep = max(len(s.block_hashes) * 4, s.num_computed_tokens - rng.randrange(0, 3))
            if None not in s.tables[1][bm.groups[1].first_needed(keep) :]:
                bm.truncate(s, keep)
        elif live:
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        bm.check(live)
    for s in live:
        bm.free(s)
    assert bm.groups[1].pins  # shared prefixes were recomputed and pinned on the way
    # Only pins hold blocks now (a block that two forked sequences pinned is held twice, one
    # reference each, as bm.check counted).
    assert bm.groups[1].pool.num_used == len({b.block_id for bl in bm.groups[1].pins.values() for b in bl})
    bm.trim_groups()
    assert bm.pool.num_used == 0 == bm.groups[1].pool.num_used


def test_pools_of_each_group_follow_their_own_ids():
    """Two groups: the windowed layers' pools are their own length, and a resize, a copy and the
    disk tier's gather and write move only the group's own rows."""
    shape = CacheShape(3, 2, 8, mx.float32)
    cache = PagedKVCache(shape, 6, 4, groups=(0, 1, 0), group_blocks=(6, 3))
    assert [k.shape[0] for k in cache.keys] == [6, 3, 6] and cache.nbytes == 15 * 2 * 2 * 4 * 8 * 4
    rng = np.random.default_rng(0)
    for i in range(3):
        cache.keys[i] = mx.array(rng.normal(size=cache.keys[i].shape).astype(np.float32))
    before = [np.array(k) for k in cache.keys]
    cache.copy_blocks([(2, 0)], group=1)
    got = [np.array(k) for k in cache.keys]
    np.testing.assert_array_equal(got[1][0], before[1][2])
    np.testing.assert_array_equal(got[0], before[0])  # the other group is untouched
    np.testing.assert_array_equal(got[2], before[2])
    rows = cache.gather_blocks([[5, 1], [1, 2]])
    np.testing.assert_array_equal(np.array(rows[1]).view(np.float32), got[1][[1, 2]])
    np.testing.assert_array_equal(np.array(rows[0]).view(np.float32), got[0][[5, 1]])
    other = PagedKVCache(shape, 6, 4, groups=(0, 1, 0), group_blocks=(6, 3))
    flat = [np.array(r).reshape(2, -1) for r in rows]
    other.write_blocks(flat, [[(0, 0), (1, 3)], [(1, 0)]])  # only row 1's windowed rows are wanted
    np.testing.assert_array_equal(np.array(other.keys[1])[0], got[1][2])
    np.testing.assert_array_equal(np.array(other.keys[1])[1:], 0)
    np.testing.assert_array_equal(np.array(other.keys[0])[[0, 3]], got[0][[5, 1]])
    cache.resize(5, group=1)
    assert [k.shape[0] for k in cache.keys] == [6, 5, 6] and cache.group_blocks == [6, 5]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    import mlx_lm

    out = {}
    for family, window in (("gpt_oss", 4), ("gemma3_text", 6), ("gpt_oss", 9)):
        path = write_tiny_family(tmp_path_factory.mktemp(family), family, sliding_window=window)
        out[family, window] = (load(str(path), "float32"), *mlx_lm.load(str(path)))
    return out


def _grown(loaded, kv_chunk_blocks=8, **kw):
    """A pool that grows (the default outside tests): the windowed group starts and grows a window's
    worth at a time, so a block it released is soon another's."""
    return LLMEngine(
        loaded,
        EngineConfig.of(
            block_size=4,
            kv_chunk_blocks=kv_chunk_blocks,
            kv_memory_gb=0.05,
            max_num_batched_tokens=8,
            attention_impl="reference",
            **kw,
        ),
    )


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _peak_window_blocks(engine, rids) -> tuple[dict, int]:
    done, peak = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
        peak = max(peak, engine.block_manager.groups[1].pool.num_used)
    assert set(rids) <= set(done)
    return done, peak


@pytest.mark.parametrize("key", [("gpt_oss", 4), ("gemma3_text", 6), ("gpt_oss", 9)])
def test_windowed_group_holds_a_window_and_gives_mlx_lm_tokens(families, key):
    """Two requests at once, prompts many windows long in chunks of 8: the windowed group holds a
    window plus a chunk per sequence while the full group holds everything, and the tokens are
    mlx-lm's. Then a request that extends the first prompt hits every full block of it."""
    loaded, ref_model, tok = families[key]
    window = key[1]
    engine = _grown(loaded)
    rids = [engine.add_request(p, _greedy(24)) for p in (SYSTEM, LONG)]
    done, peak = _peak_window_blocks(engine, rids)
    per_seq = -(-(window + 8) // 4) + 1  # a window and a chunk of 8, each straddling a block boundary
    assert peak <= 2 * per_seq
    assert engine.stats.blocks_in_use_peak >= len(tok.encode(LONG)) // 4  # the full group keeps all
    for rid, prompt in zip(rids, (SYSTEM, LONG)):
        assert done[rid].outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(prompt), 24), key
    # The next turn, as an agent's: the whole history (prompt and answer) and more. Its hit covers
    # every full block of the history although the windowed group released all but the last window.
    history = tok.encode(LONG) + list(done[rids[1]].outputs[0].token_ids)
    more = history + tok.encode(" Blocks out of the window go back to the pool.")
    rid = engine.add_request(more, _greedy(8))
    got = run_all(engine)[rid]
    assert got.num_cached_tokens == (len(history) - 1) // 4 * 4  # the last output token was never stored
    assert got.outputs[0].token_ids == contiguous_generate(ref_model, more, 8)


def test_samples_beams_and_preemption_on_a_small_windowed_pool(families):
    """n=3 seeded samples (copy-on-write of both groups' last block) and a greedy request together,
    in a full group so small that requests are preempted and recomputed. (Beams on two groups:
    tests/test_per_layer_kv.py, whose gemma4 has windowed layers too.)"""
    from reference import contiguous_samples

    loaded, ref_model, tok = families["gpt_oss", 4]
    engine = LLMEngine(
        loaded,
        EngineConfig.of(block_size=4, num_blocks=34, max_num_batched_tokens=8, attention_impl="reference"),
    )
    sampled = SamplingParams(temperature=0.8, top_k=20, n=3, max_tokens=16, seed=3, ignore_eos=True)
    b = engine.add_request(LONG, _greedy(16))  # 20 blocks of prompt, then the samples' 11 and more
    a = engine.add_request(SYSTEM, sampled)
    done = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    ids = tok.encode(SYSTEM)
    want = contiguous_samples(ref_model, ids, 16, sampled, seed=3, sample_indices=range(3))
    assert [o.token_ids for o in done[a].outputs] == want
    assert done[b].outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(LONG), 16)
    assert engine.block_manager.groups[1].pool.num_used == 0 == engine.block_manager.pool.num_used


def test_disk_tier_restores_the_window_of_the_windowed_group(families, tmp_path):
    """A fresh engine takes the prompt's blocks from the disk: the full group all of them, the
    windowed group only the window's, and the tokens are mlx-lm's."""
    loaded, ref_model, tok = families["gemma3_text", 6]
    d = str(tmp_path / "cache")
    first = _grown(loaded, prefix_cache_dir=d)
    first.add_request(LONG, _greedy(2))
    run_all(first)
    first.prefix_store.flush()
    second = _grown(loaded, prefix_cache_dir=d)
    sched = second.scheduler
    rid = second.add_request(LONG, _greedy(12))
    loads = []
    admit = sched._admit

    def spy(req, out):
        admit(req, out)
        loads.append((len(out.loads[0]), len(out.loads[1])))

    sched._admit = spy
    done = run_all(second)[rid]
    assert done.num_cached_tokens >= len(tok.encode(LONG)) // 4 * 4 - 4
    ((full, windowed),) = loads
    assert full == done.num_cached_tokens // 4 and windowed <= -(-6 // 4) + 1
    assert done.outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(LONG), 12)


def test_an_idle_engine_trims_both_groups_and_keeps_its_window_blocks(families):
    """A long request beside a short one grows both pools; idle, the engine trims them back to
    their starting sizes, moving the cached blocks it keeps (the most recently released: the short
    request's, which ends last) below the new sizes in each group. A hit on them gives mlx-lm's tokens."""
    loaded, ref_model, tok = families["gpt_oss", 9]
    engine = _grown(loaded)
    bm = engine.block_manager
    start = (bm.pool.num_blocks, bm.groups[1].pool.num_blocks)
    short = tok.encode(SYSTEM)[:14]
    a = engine.add_request(short, _greedy(20))
    engine.add_request(LONG, _greedy(2))
    done = run_all(engine)
    assert bm.groups[1].pool.num_blocks > start[1] and bm.pool.num_blocks > start[0]
    kv = engine.kv_cache

    def rows_by_hash() -> dict:  # each group's cached blocks' K rows, by hash, on one layer of the group
        layer = [kv.groups.index(0), kv.groups.index(1)]
        return {
            (g, h): np.array(kv.keys[layer[g]][b.block_id])
            for g, pool in enumerate((bm.pool, bm.groups[1].pool))
            for h, b in pool.cached.items()
        }

    before = rows_by_hash()
    assert engine.trim_pool() > 0
    after = rows_by_hash()
    assert {g for g, _ in after} == {0, 1} and set(after) <= set(before)
    for key, rows in after.items():  # a kept block holds its own rows, wherever it was moved
        np.testing.assert_array_equal(rows, before[key])
    assert (bm.pool.num_blocks, bm.groups[1].pool.num_blocks) == start == tuple(engine.kv_cache.group_blocks)
    assert [k.shape[0] for k in engine.kv_cache.keys] == [start[g] for g in engine.kv_cache.groups]
    history = short + list(done[a].outputs[0].token_ids)
    prompt = history + tok.encode(" Again.")
    rid = engine.add_request(prompt, _greedy(6))
    got = run_all(engine)[rid]
    assert got.num_cached_tokens >= 16
    assert got.outputs[0].token_ids == contiguous_generate(ref_model, prompt, 6)


def test_a_shared_prefix_recomputed_once_is_pinned_for_the_next(families):
    """Three conversations share a system prompt, one after another, in a growing windowed pool
    that reuses released blocks at once: the second finds the whole prompt in the full group but
    not the window at its end (the first's window moved on), recomputes and pins that window; the
    third takes the whole shared prompt. Every answer is mlx-lm's."""
    loaded, ref_model, tok = families["gpt_oss", 4]
    engine = _grown(loaded, kv_chunk_blocks=64)  # the full group keeps every block (it has room)
    shared = (len(tok.encode(SYSTEM)) - 1) // 4 * 4  # the shared prompt's full blocks, at the least
    got = {}
    for q in ("What is a block table?", "Why copy on write?", "Who evicts a block?"):
        prompt = SYSTEM + q
        rid = engine.add_request(prompt, _greedy(12))
        out = run_all(engine)[rid]
        assert out.outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(prompt), 12), q
        got[q] = out.num_cached_tokens
    first, second, third = got.values()
    assert first == 0 and second < shared <= third
    assert len(engine.block_manager.groups[1].pins) == 1


def test_draft_speculation_rolls_back_both_groups(families, tmp_path):
    """A draft model (another tiny gpt-oss: its proposals are rejected) proposes 3 tokens a step
    for a windowed target whose windowed group reuses released blocks at once: the rejected slots
    roll back in both groups and the tokens are plain decoding's (mlx-lm's)."""
    loaded, ref_model, tok = families["gpt_oss", 4]
    draft = write_tiny_family(tmp_path / "draft", "gpt_oss", seed=1, sliding_window=4)
    engine = _grown(loaded, speculative="draft", draft_model=str(draft), num_speculative_tokens=3)
    rids = [engine.add_request(p, _greedy(20)) for p in (LONG,)]
    done, peak = _peak_window_blocks(engine, rids)
    st = engine.stats_dict()
    assert st["spec_accepted_tokens"] < st["spec_proposed_tokens"], st
    assert peak <= -(-(4 + 8) // 4) + 1
    assert done[rids[0]].outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(LONG), 20)
