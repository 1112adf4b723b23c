"""Decode attention that reads a table's runs of consecutive blocks in place, and the allocator
that keeps a sequence's blocks in such runs.

The runs path (attention/reference.py) is checked against attention computed in numpy over the
blocks the table names, with the blocks just past (and just before) every run poisoned: a slice
taken one block past a run's end, or a run split or joined at the wrong id, reads poison. The
allocator's `after` hint is checked against a plain model of free blocks and tables (hypothesis).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxpaged.attention import reference
from mlxpaged.attention.reference import paged_attention_reference, table_runs
from mlxpaged.core.block_pool import BlockPool

BS = 16


def numpy_attention(q, k_pool, v_pool, table, ctx, scale, window=None, sinks=None, chunk=None):
    """One sequence's decode in float64 numpy: the table's blocks laid out, positions `lo..ctx-1`."""
    H, d = q.shape
    kvh = k_pool.shape[1]
    lo = 0 if window is None else max(0, ctx - window)
    if chunk is not None:
        lo = (ctx - 1) // chunk * chunk
    k = np.concatenate([k_pool[b] for b in table], axis=1)[:, lo:ctx].astype(np.float64)  # [kvh, n, d]
    v = np.concatenate([v_pool[b] for b in table], axis=1)[:, lo:ctx].astype(np.float64)
    out = np.zeros((H, d))
    for h in range(H):
        s = k[h // (H // kvh)] @ q[h].astype(np.float64) * scale
        z = np.exp(s - s.max())
        den = z.sum() + (0.0 if sinks is None else np.exp(sinks[h] - s.max()))
        out[h] = (z / den) @ v[h // (H // kvh)]
    return out


def poisoned_pools(num_blocks, kvh, d, tables, seed):
    """Random pools whose blocks outside every table are huge: any read of one shows."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((num_blocks, kvh, BS, d)).astype(np.float32)
    v = rng.standard_normal((num_blocks, kvh, BS, d)).astype(np.float32)
    used = {b for t in tables for b in t}
    for b in range(num_blocks):
        if b not in used:
            k[b] = 30.0  # a key that wins every softmax
            v[b] = 1e4
    return k, v


# Three sequences: two runs with a poisoned gap, one run ending just before poison, a run that
# starts right after another sequence's run (the same id + 1 is not this table's).
SCATTERED = [
    list(range(10, 22)) + list(range(40, 52)),
    list(range(60, 80)),
    list(range(22, 30)) + list(range(80, 90)) + list(range(2, 9)),
]
# Sharing (a prefix hit, a fork): one prefix run continued by one sequence's own next block and
# not by the others'; a sequence reading the middle of another's run.
SHARED = [
    list(range(10, 30)) + [30, 31],
    list(range(10, 30)) + [50, 51, 52],
    list(range(14, 26)) + list(range(60, 66)),
]


@pytest.mark.parametrize("tables", [SCATTERED, SHARED], ids=["scattered", "shared"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2)])
@pytest.mark.parametrize(
    "opts", [{}, {"window": 200}, {"chunk": 128}, {"sinks": True}, {"window": 150, "sinks": True}], ids=str
)
def test_runs_read_in_place_match_numpy(tables, heads, kv_heads, opts, monkeypatch):
    monkeypatch.setattr(reference, "MIN_RUN_BLOCKS", 1)  # runs of any length take the in-place path
    d, num_blocks = 32, 96
    k, v = poisoned_pools(num_blocks, kv_heads, d, tables, seed=heads + kv_heads)
    ctx = [len(tables[0]) * BS - 5, len(tables[1]) * BS, len(tables[2]) * BS - 15]
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, heads, d)).astype(np.float32)
    sinks = rng.standard_normal(heads).astype(np.float32) if opts.get("sinks") else None
    width = max(map(len, tables))
    padded = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)  # block 0: poison
    bt, cl = mx.array(padded), mx.array(ctx, dtype=mx.int32)
    window, chunk = opts.get("window"), opts.get("chunk")
    plan = reference._runs_plan(bt, cl, BS, window, chunk)
    assert plan is not None  # the in-place path is the one under test
    if tables is SHARED and window is None and chunk is None:
        assert plan.members[plan.pieces.index((10, 4))] == [0, 1]  # read once for both
        assert plan.members[plan.pieces.index((14, 12))] == [0, 1, 2]
    out = paged_attention_reference(
        mx.array(q),
        mx.array(k),
        mx.array(v),
        bt,
        cl,
        0.2,
        {},
        window,
        None if sinks is None else mx.array(sinks),
        chunk,
    )
    for i in range(3):
        want = numpy_attention(q[i], k, v, tables[i], ctx[i], 0.2, window, sinks, chunk)
        np.testing.assert_allclose(np.array(out[i]), want, rtol=2e-4, atol=2e-4)


def test_short_runs_take_the_gather():
    """A table of scattered ids (runs of one block) is gathered: the same answer either way."""
    table = [7, 3, 12, 5, 9, 1, 14, 11, 2]
    assert table_runs(table) == [(b, 1) for b in table]
    k, v = poisoned_pools(16, 2, 32, [table], seed=3)
    q = np.random.default_rng(4).standard_normal((1, 4, 32)).astype(np.float32)
    bt, cl = mx.array([table], dtype=mx.int32), mx.array([len(table) * BS - 3], dtype=mx.int32)
    assert reference._runs_plan(bt, cl, BS, None, None) is None
    out = paged_attention_reference(mx.array(q), mx.array(k), mx.array(v), bt, cl, 0.2)
    np.testing.assert_allclose(np.array(out[0]), numpy_attention(q[0], k, v, table, int(cl[0]), 0.2), atol=2e-4)


@given(st.lists(st.integers(0, 40), max_size=30))
def test_table_runs_lay_out_the_table(ids):
    runs = table_runs(ids)
    assert [first + j for first, n in runs for j in range(n)] == ids
    # Maximal: no run continues into the next.
    assert all(a + n != b for (a, n), (b, _) in zip(runs, runs[1:]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "new", "free", "cache"]), st.integers(0, 7)), max_size=80))
def test_allocator_extends_runs_against_a_plain_model(ops):
    """`allocate(after)` against a model of the free blocks: it takes `after + 1` exactly when that
    block is free and uncached, never a block in use; the pool's invariants hold throughout."""
    pool = BlockPool(24)
    tables: list[list] = []
    free = set(range(24))
    for op, k in ops:
        if op == "new" or (op == "grow" and not tables):
            block = pool.allocate()
            if block is None:
                assert not free
                continue
            tables.append([block])
        elif op == "grow":
            t = tables[k % len(tables)]
            nxt = pool.blocks[t[-1].block_id + 1] if t[-1].block_id + 1 < pool.num_blocks else None
            extend = nxt is not None and nxt.block_id in free and nxt.block_hash is None
            block = pool.allocate(t[-1].block_id)
            if block is None:
                assert not free
                continue
            if extend:
                assert block is nxt
            t.append(block)
        elif op == "free" and tables:
            for b in tables.pop(k % len(tables)):
                pool.release(b)
                free.add(b.block_id)
            continue
        elif op == "cache" and tables:
            t = tables[k % len(tables)]
            if t[0].block_hash is None:
                pool.cache(t[0], bytes([k, len(ops) % 256, t[0].block_id]), (k,))
            continue
        else:
            continue
        assert block.block_id in free, "allocated a block in use"
        free.discard(block.block_id)
        pool.check()
    pool.check()
    assert free == set(pool.free_queue)


def test_a_growing_table_is_one_run():
    """A sequence growing block by block keeps one run where the least recently freed order
    would scatter it: blocks freed alternately from two ranges."""
    order = [b for pair in zip(range(10, 30), range(30, 50)) for b in pair]  # 10, 30, 11, 31, ...

    def grown(hint: bool) -> list[int]:
        pool = BlockPool(64)
        held = [pool.allocate() for _ in range(64)]
        for b in order:
            pool.release(held[b])
        t = [pool.allocate()]
        for _ in range(15):
            t.append(pool.allocate(t[-1].block_id if hint else None))
        return [b.block_id for b in t]

    assert grown(hint=True) == list(range(10, 26))
    assert len(table_runs(grown(hint=False))) == 16  # without the hint: every block its own run


def test_engine_reads_runs_and_matches_mlx_lm(tiny_loaded, mlx_lm_tiny, monkeypatch):
    """Long prompts decoded by the engine on the runs path: one alone, then three sharing its
    prefix through prefix hits (each with its own suffix and blocks); every greedy token equals
    mlx-lm's on its contiguous cache."""
    from mlxpaged import EngineConfig, LLMEngine, SamplingParams

    from reference import contiguous_generate

    calls = []
    real = reference._attend_runs
    monkeypatch.setattr(reference, "_attend_runs", lambda *a: calls.append(len(a[3].pieces)) or real(*a))
    ref_model, _ = mlx_lm_tiny
    prefix = [(7 * j) % 200 + 1 for j in range(300)]
    prompts = [prefix] + [prefix + [(11 * j + i) % 200 + 1 for j in range(5 + 9 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=160, attention_impl="reference"))
    first = engine.add_request(prompts[0], params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    rest = [engine.add_request(p, params) for p in prompts[1:]]
    while engine.has_unfinished_requests():
        for out in engine.step():
            engine.check_invariants()
            if out.finished:
                done[out.request_id] = out
    assert calls and max(calls) > 1  # the runs path ran, over pieces shared between sequences
    for p, r in zip(prompts, [first] + rest):
        assert done[r].outputs[0].token_ids == contiguous_generate(ref_model, p, 20)


def sdpa_on_table(q, k_pool, v_pool, table, ctx, scale, sinks=None):
    """One prefill chunk (q `[n, H, d]`, the last n of `ctx` positions) by
    `mx.fast.scaled_dot_product_attention` on K/V laid out contiguously from the table in numpy,
    causal mask offset by the cached prefix."""
    n = q.shape[0]
    k = np.concatenate([k_pool[b] for b in table], axis=1)[None, :, :ctx]  # [1, kvh, ctx, d]
    v = np.concatenate([v_pool[b] for b in table], axis=1)[None, :, :ctx]
    mask = mx.arange(ctx - n, ctx)[:, None] >= mx.arange(ctx)[None]
    out = mx.fast.scaled_dot_product_attention(
        mx.array(q).transpose(1, 0, 2)[None],
        mx.array(k),
        mx.array(v),
        scale=scale,
        mask=mask,
        sinks=None if sinks is None else mx.array(sinks),
    )
    return np.array(out[0].transpose(1, 0, 2))


# One pass: a chunk whose prefix is two runs with a poisoned gap (cached up to mid-block), a decode,
# and a chunk over a prefix that shares the first one's first run and then takes its own (cached
# to a block boundary). (table, new tokens, context)
PREFILL_BATCH = [
    (list(range(10, 22)) + list(range(40, 50)), 7, 21 * BS + 3),
    (list(range(60, 80)), 1, 20 * BS - 4),
    (list(range(10, 22)) + list(range(50, 61)), 8, 22 * BS + 8),
]


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2)])
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_prefill_chunks_read_prefix_runs_in_place_match_sdpa(heads, kv_heads, sinks, monkeypatch):
    """Prefill chunks whose cached prefix is read as runs of the pool (no gather of it), in one
    varlen pass beside a decode, against SDPA on the contiguous K/V. Every block outside the
    tables is poisoned, so a run read one block long, or a partly cached block read without the
    causal mask, shows."""
    monkeypatch.setattr(reference, "MIN_RUN_BLOCKS", 1)  # two-run prefixes take the in-place path
    tables = [t for t, _, _ in PREFILL_BATCH]
    k, v = poisoned_pools(96, kv_heads, 32, tables, seed=heads * kv_heads)
    rng = np.random.default_rng(7)
    lens = [n for _, n, _ in PREFILL_BATCH]
    ctx = [c for _, _, c in PREFILL_BATCH]
    q = rng.standard_normal((sum(lens), heads, 32)).astype(np.float32)
    snk = rng.standard_normal(heads).astype(np.float32) if sinks else None
    width = max(map(len, tables))
    bt = mx.array(np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32))
    cu = np.concatenate([[0], np.cumsum(lens)])
    ran = []
    real = reference._attend_prefill_runs
    monkeypatch.setattr(reference, "_attend_prefill_runs", lambda *a: ran.append(a[3]) or real(*a))
    out = reference.paged_attention_varlen_reference(
        mx.array(q),
        mx.array(k),
        mx.array(v),
        bt,
        mx.array(cu, dtype=mx.int32),
        mx.array(ctx, dtype=mx.int32),
        0.2,
        {},
        sinks=None if snk is None else mx.array(snk),
    )
    assert ran == [[(10, 12), (40, 8)], [(10, 12), (50, 10)]]  # the cached whole blocks, as runs
    for i, (table, n, c) in enumerate(PREFILL_BATCH):
        got = np.array(out[cu[i] : cu[i + 1]])
        if n == 1:
            want = numpy_attention(q[cu[i]], k, v, table, c, 0.2, sinks=snk)[None]
        else:
            want = sdpa_on_table(q[cu[i] : cu[i + 1]], k, v, table, c, 0.2, snk)
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_long_prefill_chunks_take_the_gather():
    """A chunk of more query rows per KV head than `PREFILL_RUN_ROWS`, or a prefix of short runs,
    is gathered, and gives the same answer."""
    table = list(range(4, 30))
    k, v = poisoned_pools(40, 2, 32, [table], seed=5)
    for n, tab in [(reference.PREFILL_RUN_ROWS // 4 + 1, table), (6, table[::-1])]:
        ctx = len(tab) * BS - 2
        assert reference._prefill_runs_plan(mx.array([tab]), ctx - n, BS, 4 * n) is None
        q = np.random.default_rng(n).standard_normal((n, 8, 32)).astype(np.float32)
        out = reference.paged_attention_varlen_reference(
            mx.array(q),
            mx.array(k),
            mx.array(v),
            mx.array([tab], dtype=mx.int32),
            mx.array([0, n], dtype=mx.int32),
            mx.array([ctx], dtype=mx.int32),
            0.2,
        )
        np.testing.assert_allclose(np.array(out), sdpa_on_table(q, k, v, tab, ctx, 0.2), rtol=2e-4, atol=2e-4)


def test_engine_prefills_over_prefix_runs_and_matches_mlx_lm(tiny_loaded, mlx_lm_tiny, monkeypatch):
    """A long prompt prefilled in small chunks (each later chunk reads the cached prefix's runs in
    place), then a prompt that hits its prefix and prefills only its own suffix over it: every
    greedy token equals mlx-lm's on its contiguous cache."""
    from mlxpaged import EngineConfig, LLMEngine, SamplingParams

    from reference import contiguous_generate

    calls = []
    real = reference._attend_prefill_runs
    monkeypatch.setattr(
        reference, "_attend_prefill_runs", lambda *a: calls.append((a[0].shape[0], sum(m for _, m in a[3]))) or real(*a)
    )
    ref_model, _ = mlx_lm_tiny
    prompt = [(5 * j) % 200 + 1 for j in range(290)]
    hit = prompt[:270] + [(3 * j) % 200 + 7 for j in range(11)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    config = EngineConfig.of(num_blocks=96, max_num_batched_tokens=14, attention_impl="reference")
    engine = LLMEngine(tiny_loaded, config)
    done = {}
    for p in (prompt, hit):
        rid = engine.add_request(p, params)
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert done[rid].outputs[0].token_ids == contiguous_generate(ref_model, p, 12)
    # the first prompt's chunks from 8 cached blocks on, then the hit's 25 new tokens over its 16
    # cached blocks, in chunks of 14 and 11: (new tokens, whole cached blocks read as runs)
    assert len(calls) > (290 - 128) // 14 and calls[0][1] >= 8
    assert calls[-4:] == [(14, 16)] * 2 + [(11, 16)] * 2  # once per layer (2)
