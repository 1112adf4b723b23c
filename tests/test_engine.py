"""The paged engine against mlx-lm's contiguous cache on the same tiny checkpoint."""

import mlx.core as mx
import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.worker.kv_cache import CacheShape, PagedKVCache

from reference import contiguous_generate, decode_in_turns, tables_interleave

PROMPTS = ["The KV cache stores", "Paged attention borrows an idea from operating systems:"]


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def drain_checked(engine) -> dict:
    """Step until every request finishes, checking the block invariants after each output;
    returns the final outputs by request id."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            engine.check_invariants()
            if out.finished:
                done[out.request_id] = out
    return done


def test_interleaved_turns_match_contiguous(tiny_loaded, mlx_lm_tiny):
    """Two sequences decode in turns (one token each, alternately) in one pool."""
    ref_model, tok = mlx_lm_tiny
    seqs = decode_in_turns(tiny_loaded, [tok.encode(p) for p in PROMPTS], 100, num_blocks=64)
    for p, s in zip(PROMPTS, seqs):
        assert s.output_token_ids == contiguous_generate(ref_model, tok.encode(p), 100)
    assert tables_interleave(seqs)


def test_batched_decode_matches_contiguous(tiny_loaded, mlx_lm_tiny):
    ref_model, tok = mlx_lm_tiny
    prompts = PROMPTS + [
        "Write a Python function",
        "Blocks of sixteen tokens are found through a block table, one per sequence.",
    ]
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=128, attention_impl="reference"))
    rids = [engine.add_request(p, greedy(60)) for p in prompts]
    done = drain_checked(engine)
    assert engine.stats.running_seqs_peak == 4
    for p, r in zip(prompts, rids):
        assert done[r].outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(p), 60)
        assert done[r].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("block_size", [1, 4, 256])
def test_block_sizes_match_contiguous(tiny_loaded, mlx_lm_tiny, block_size):
    ref_model, tok = mlx_lm_tiny
    engine = LLMEngine(tiny_loaded, EngineConfig.of(block_size=block_size, num_blocks=4096 // block_size))
    outs = []
    for p in PROMPTS:
        engine.add_request(p, greedy(30))
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    outs.sort(key=lambda o: int(o.request_id))
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == contiguous_generate(ref_model, tok.encode(p), 30)


def test_long_block_tables_match_contiguous(tiny_loaded, mlx_lm_tiny):
    """Block size 2: the tables pass `LONG_TABLE` blocks mid-run (from then on a step copies them
    from each sequence's id buffer, before from its id list), at several lengths in one batch,
    with 7-token prefill chunks ending mid-block, a prefix hit and a fork (a repeated prompt with
    n = 2), and a pool too small for all of it (preemption by recomputation)."""
    from mlxpaged.worker.model_runner import LONG_TABLE

    ref_model, tok = mlx_lm_tiny
    n_out = 2 * LONG_TABLE + 16
    config = EngineConfig.of(block_size=2, num_blocks=260, max_num_batched_tokens=7)
    engine = LLMEngine(tiny_loaded, config)
    rids = [engine.add_request(p, greedy(n_out)) for p in PROMPTS]
    engine.step()
    twice = SamplingParams(temperature=0.0, n=2, max_tokens=n_out, ignore_eos=True)
    rids.append(engine.add_request(PROMPTS[0], twice))
    done = drain_checked(engine)
    st = engine.stats_dict()
    assert st["preemptions"] > 0 and st["prefix_cache_hit_tokens"] > 0
    for p, r in zip(PROMPTS + PROMPTS[:1], rids):
        want = contiguous_generate(ref_model, tok.encode(p), n_out)
        assert [c.token_ids for c in done[r].outputs] == [want] * len(done[r].outputs), r
    assert len(done[rids[-1]].outputs) == 2


def test_decode_tables_follow_every_change_of_a_table():
    """The decode steps' table matrix, kept between steps, equals the tables after each kind of
    change the block manager makes (a new block, a copy-on-write of the last, a rollback, a
    batch of other sequences), including changes that keep a table's length."""
    import numpy as np

    from mlxpaged.core.sequence import BlockIds
    from mlxpaged.worker.model_runner import DecodeTables

    def padded(tables):
        width = max(len(t.list) for t in tables)
        return [t.list + [0] * (width - len(t.list)) for t in tables]

    def visible(matrix, tables):  # the entries a step reads: each row up to its table's length
        return [matrix[i, : len(t.list)].tolist() + [0] * (matrix.shape[1] - len(t.list)) for i, t in enumerate(tables)]

    def same_version(new, old):
        new.version = old.version
        return new

    tables = [BlockIds([3, 4]), BlockIds([5]), BlockIds([6, 7, 8])]
    dt = DecodeTables()
    changes = [
        lambda: None,
        lambda: tables[1].append(9),  # a new block
        lambda: tables[0].__setitem__(-1, 10),  # copy-on-write of the last block: same length
        lambda: tables[2].append(11),  # the widest table grows
        lambda: (tables[2].truncate(2), tables[2].append(12)),  # a rollback, then a new block: same length
        lambda: tables[2].truncate(1),  # the widest shrinks
        lambda: tables.__setitem__(1, same_version(BlockIds([21, 22]), tables[1])),  # another sequence in its row
        lambda: tables.append(BlockIds([13, 14, 15, 16])),  # another batch
        lambda: tables.pop(0),
    ]
    for change in changes:
        change()
        m = np.array(dt.array(list(tables)))  # the MLX array a step passes
        assert m.dtype.name == "int32" and m.shape == (len(tables), max(len(t.list) for t in tables))
        assert visible(m, tables) == padded(tables)


def test_row_plans_follow_the_scheduled_samples(tiny_loaded, mlx_lm_tiny):
    """A decode-only step reuses the last one's `RowPlan` (who draws from which logits row) only
    while it decodes the same samples in the same order: here a request joins beside the same
    decodes, requests finish, one is aborted and another takes its place (as many rows, other
    samples), samples fork (n = 2) and greedy rows mix with sampled ones; every sample's tokens
    are mlx-lm's, and between decode-only steps of equal size plans were both reused and rebuilt."""
    ref_model, tok = mlx_lm_tiny
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=64, max_num_seqs=3, attention_impl="reference"))
    prompts = [tok.encode(f"{PROMPTS[i % 2]} {i}") for i in range(7)]
    params = [
        SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(temperature=0.8, top_k=20, n=1 + (i == 3), seed=i, max_tokens=9, ignore_eos=True)
        for i in range(7)
    ]
    plan, seen = engine._plan, {"reused": 0, "rebuilt": 0}

    def counting(out):
        last, got = engine._last_plan, plan(out)
        if not out.prefills and last is not None and len(out.decodes) == len(last.decodes or ()):
            seen["reused" if got is last else "rebuilt"] += 1
        return got

    engine._plan = counting
    done = {}
    for i in (0, 1):
        engine.add_request(prompts[i], params[i], request_id=str(i))
    for step in range(200):
        if step == 3:  # a prefill beside the last decode-only step's decodes
            engine.add_request(prompts[6], params[6], request_id="6")
        if step == 6:  # another sample in the aborted one's row
            assert engine.abort_request("1")
            for i in range(2, 6):
                engine.add_request(prompts[i], params[i], request_id=str(i))
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
        if not engine.has_unfinished_requests():
            break
    assert sorted(done) == ["0", "2", "3", "4", "5", "6"]
    for i in (0, 2, 3, 4, 5, 6):
        sp = params[i]
        for j, c in enumerate(done[str(i)].outputs):
            assert c.token_ids == contiguous_generate(ref_model, prompts[i], sp.max_tokens, sp, seed=i, sample_index=j)
    assert seen["reused"] >= 5 and seen["rebuilt"] >= 1, seen


def test_n_samples_share_prompt_blocks(tiny_loaded, mlx_lm_tiny):
    """44-token prompt, 4 samples of 64 tokens, block 16: 22 blocks in use against 28, 3 copies."""
    ref_model, tok = mlx_lm_tiny
    prompt = (tok.encode(" ".join(PROMPTS) * 3))[:44]
    assert len(prompt) == 44
    params = SamplingParams(n=4, temperature=0.9, top_p=0.95, top_k=50, seed=7, max_tokens=64, ignore_eos=True)
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=64, block_size=16))
    engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
        engine.check_invariants()
    (out,) = outs
    st = engine.stats_dict()
    assert (st["blocks_in_use_peak"], st["blocks_without_sharing"], st["cow_copies"]) == (22, 28, 3)
    for i, c in enumerate(out.outputs):
        assert c.token_ids == contiguous_generate(ref_model, prompt, 64, params, seed=7, sample_index=i)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4  # the samples really differ
    pool = engine.block_manager.pool
    assert all(b.ref_cnt == 0 for b in pool.blocks) and pool.num_free == pool.num_blocks


def test_seeded_sample_does_not_depend_on_batch(tiny_loaded, mlx_lm_tiny):
    """A seeded sample gives the same tokens whatever else runs beside it."""
    ref_model, tok = mlx_lm_tiny
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=128))
    engine.add_request(PROMPTS[0], p, request_id="group")
    engine.add_request(PROMPTS[1], SamplingParams(temperature=1.0, seed=5, max_tokens=25))
    engine.add_request(
        PROMPTS[0], SamplingParams(temperature=1.0, seed=11, max_tokens=20, ignore_eos=True), request_id="alone"
    )
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["group"].outputs[0].token_ids == done["alone"].outputs[0].token_ids
    assert done["group"].outputs[2].token_ids == contiguous_generate(
        ref_model, tok.encode(PROMPTS[0]), 20, p, seed=11, sample_index=2
    )


def test_kv_write_in_place():
    """A step's write costs no copy of the pool and no memory growth, whatever the pool size."""
    shape = CacheShape(1, 2, 64, mx.float32)
    growth = []
    for num_blocks in (64, 8192):  # 0.5 MB and 64 MB pools
        cache = PagedKVCache(shape, num_blocks, 16)
        k = mx.random.normal((8, 2, 64))
        mx.eval(k)
        slots = mx.arange(8, dtype=mx.int32) * 16
        for step in range(40):
            if step == 10:
                mx.eval(k)
                base = mx.get_active_memory()
                mx.reset_peak_memory()
            cache.write(0, k, k, slots + step % 16)
            mx.eval(cache.keys, cache.values)
        growth.append((mx.get_active_memory() - base, mx.get_peak_memory() - base))
        assert mx.allclose(cache.keys[0][mx.arange(8), :, 39 % 16], k).item()
    pool_bytes = 8192 * 2 * 16 * 64 * 4
    for active, peak in growth:
        assert active < 64 * 1024 and peak < pool_bytes // 16, growth
