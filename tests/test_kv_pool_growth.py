"""A KV pool that grows as blocks are needed and gives memory back when idle
(BlockPool.enable_growth / trim, PagedKVCache.resize, kv_cache.growable_pool)."""

import mlx.core as mx
import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.core.block_pool import BlockPool
from mlxpaged.errors import MlxPagedError
from mlxpaged.worker.kv_cache import CHUNK_TOKENS, CacheShape

from drive import run_all
from reference import contiguous_generate


class Recorder:
    """The resizes a pool reports (`take_resize`), collected after each call as the engine does."""

    def __init__(self, pool):
        self.pool, self.calls = pool, []

    def __call__(self, result=None):
        if (r := self.pool.take_resize()) is not None:
            self.calls.append((r[0], list(r[1])))
        return result


def test_pool_grows_a_chunk_at_a_time_up_to_the_cap():
    pool = BlockPool(2)
    rec = Recorder(pool)
    pool.enable_growth(7, 2)
    assert pool.num_free == 7  # what allocations can take, growth included
    got = [rec(pool.allocate()) for _ in range(7)]
    assert [b.block_id for b in got] == list(range(7))
    assert rec.calls == [(4, []), (6, []), (7, [])]  # the last chunk stops at the cap
    assert rec(pool.allocate()) is None and pool.num_free == 0 and len(rec.calls) == 3
    pool.check()


def test_a_large_pool_grows_by_an_eighth_of_itself():
    """Each growth copies every device pool, so past 8 chunks the step is an eighth of the pool
    (the copying stays a bounded multiple of the final size)."""
    pool = BlockPool(64)
    rec = Recorder(pool)
    pool.enable_growth(100, 2)
    for _ in range(64):
        rec(pool.allocate())
    rec(pool.allocate())
    assert rec.calls == [(72, [])]  # 64 // 8 = 8 blocks, not the chunk's 2
    for _ in range(7 + 9 + 10 + 1):
        rec(pool.allocate())
    assert [n for n, _ in rec.calls] == [72, 81, 91, 100]  # + 9, + 10, then the cap
    pool.check()


def test_the_default_pool_starts_at_4096_slots_and_grows_1024_at_a_time(tiny_loaded):
    from mlxpaged.worker.kv_cache import GROW_TOKENS, growable_pool

    config = EngineConfig.of(kv_memory_gb=1.0)
    start, cap, chunk = growable_pool(tiny_loaded, config)
    assert (start, chunk) == (CHUNK_TOKENS // 16, GROW_TOKENS // 16) == (256, 64)
    assert growable_pool(tiny_loaded, EngineConfig.of(kv_memory_gb=1.0, kv_chunk_blocks=8))[::2] == (8, 8)


def test_trim_keeps_the_most_recent_cached_blocks_and_copies_them_down():
    pool = BlockPool(2)
    rec = Recorder(pool)
    pool.enable_growth(8, 2)
    blocks = [rec(pool.allocate()) for _ in range(6)]
    for b in blocks:
        pool.cache(b, bytes([b.block_id]), (b.block_id,))
    for i in (0, 1, 2, 3, 5, 4):  # 5 then 4 released last: the two most recently used
        pool.release(blocks[i])
    assert rec(pool.trim()) == 4
    assert pool.num_blocks == 2 and len(pool.blocks) == 2
    n, copies = rec.calls[-1]
    assert n == 2 and sorted(src for src, _ in copies) == [4, 5] and sorted(d for _, d in copies) == [0, 1]
    dst = dict(copies)
    for h in (4, 5):  # the kept blocks answer for their tokens at their new ids
        b = pool.lookup(bytes([h]), (h,))
        assert b is not None and b.block_id == dst[h]
    for h in (0, 1, 2, 3):  # the older ones were evicted
        assert pool.lookup(bytes([h]), (h,)) is None
    assert list(pool.free_queue) == [dst[5], dst[4]]  # LRU order kept: 5 was released before 4
    pool.check()
    assert [pool.allocate().block_id for _ in range(3)] == [dst[5], dst[4], 2]  # and it grows again


def test_trim_waits_while_any_block_is_in_use():
    pool = BlockPool(2)
    pool.enable_growth(8, 2)
    blocks = [pool.allocate() for _ in range(5)]
    for b in blocks[1:]:
        pool.release(b)
    assert pool.trim() == 0 and pool.num_blocks == 6  # block 0 is held: no id may change meaning
    pool.release(blocks[0])
    assert pool.trim() == 4
    pool.check()


def _prompts(n, length):
    return [[(13 * i + 7 * j) % 300 + 3 for j in range(length + 9 * i)] for i in range(n)]


def test_a_growing_pool_generates_mlx_lm_tokens(tiny_loaded, mlx_lm_tiny):
    engine = LLMEngine(tiny_loaded, EngineConfig.of(kv_chunk_blocks=2, attention_impl="reference"))
    assert engine.num_blocks == 2 and engine.max_blocks > 40
    prompts = _prompts(8, 40)  # 8 x 4 blocks: past 24 blocks the pool grows by an eighth of itself
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for p in prompts]
    done = run_all(engine)
    assert engine.num_blocks > 24 and engine.kv_cache.keys[0].shape[0] == engine.num_blocks  # it grew, pools too
    model, _ = mlx_lm_tiny
    for rid, p in zip(ids, prompts):
        assert done[rid].outputs[0].token_ids == contiguous_generate(model, p, 12)


def test_idle_trim_frees_memory_and_keeps_the_prefix_cache_correct(tiny_loaded, mlx_lm_tiny):
    engine = LLMEngine(tiny_loaded, EngineConfig.of(kv_chunk_blocks=2, attention_impl="reference"))
    filler, shared = _prompts(2, 60)
    shared = shared[:48]  # three full blocks
    engine.add_request(filler, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.add_request(shared + [5], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    run_all(engine)  # `shared` took blocks above the filler's and was released last
    grown = engine.num_blocks
    held = {b.block_id for b in engine.block_manager.pool.cached.values()}
    assert grown >= 8 and max(held) >= 2
    mx.clear_cache()
    before = mx.get_active_memory()
    given = engine.trim_pool()
    mx.clear_cache()
    assert given == grown - 2 and engine.num_blocks == 2
    assert all(a.shape[0] == 2 for a in engine.kv_cache.arrays)
    freed = before - mx.get_active_memory()
    assert freed >= 0.9 * given * engine.cache_shape.bytes_per_block(16)
    # The two most recent cached blocks (the head of `shared`) moved into ids 0-1: a request on
    # the same prefix hits them and still generates mlx-lm's tokens.
    prompt = shared + [9, 8, 7]
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    out = run_all(engine)[rid]
    assert out.num_cached_tokens == 32
    assert out.outputs[0].token_ids == contiguous_generate(mlx_lm_tiny[0], prompt, 10)


def test_a_request_that_fits_the_cap_is_admitted_and_one_beyond_it_is_refused(tiny_loaded, mlx_lm_tiny):
    bpb = CacheShape.of(tiny_loaded).bytes_per_block(16)
    engine = LLMEngine(
        tiny_loaded, EngineConfig.of(kv_chunk_blocks=2, kv_memory_gb=8.5 * bpb / 1e9, attention_impl="reference")
    )
    assert (engine.num_blocks, engine.max_blocks) == (2, 8)
    prompt = _prompts(1, 100)[0]  # 100 + 28 - 1 tokens: 8 blocks, all the cap holds
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True))
    out = run_all(engine)[rid]
    assert out.outputs[0].token_ids == contiguous_generate(mlx_lm_tiny[0], prompt, 28)
    with pytest.raises(MlxPagedError, match="pool has 8"):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=30))


def test_a_growing_pool_is_capped_by_memory_not_by_max_kv_tokens(tiny_loaded):
    """An agent's context (27k prompt tokens + max_tokens 32,000) must fit whatever
    the memory cap allows; the cap once stopped at max_kv_tokens // block_size = 4,096 blocks."""
    bpb = CacheShape.of(tiny_loaded).bytes_per_block(16)
    config = EngineConfig.of(kv_memory_gb=9000.5 * bpb / 1e9, attention_impl="reference")
    engine = LLMEngine(tiny_loaded, config)
    assert config.cache.max_kv_tokens // 16 < engine.max_blocks == 9000
    assert engine.num_blocks == CHUNK_TOKENS // 16  # nothing beyond the first chunk until used
    prompt = _prompts(1, 20)[0]
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=70_000 - 20, ignore_eos=True))
    with pytest.raises(MlxPagedError, match="raise --kv-memory-gb"):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=9001 * 16))


def test_a_fixed_pool_does_not_grow_or_trim(tiny_loaded):
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=6, attention_impl="reference"))
    assert engine.max_blocks == 6
    engine.add_request(_prompts(1, 20)[0], SamplingParams(temperature=0.0, max_tokens=4))
    run_all(engine)
    assert engine.trim_pool() == 0 and engine.num_blocks == 6


def test_bad_pool_settings_are_refused():
    with pytest.raises(ValueError, match="kv_memory_gb"):
        EngineConfig.of(kv_memory_gb=0)
    with pytest.raises(ValueError, match="kv_chunk_blocks"):
        EngineConfig.of(kv_chunk_blocks=0)


def _finish(loop, prompt, rid, max_tokens):
    """Submit one greedy request to a running `EngineLoop` and wait for its finished output."""
    import asyncio

    from mlxpaged.server.engine_loop import Sink

    async def one():
        sink = Sink(asyncio.get_running_loop())
        loop.submit(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), rid, sink)
        while True:
            for _, out in await sink.get():
                if out.finished:
                    return out

    return asyncio.run(one())


def _wait_trimmed(engine, seconds):
    import time

    from mlxpaged.testing.slowness import wall

    deadline = time.monotonic() + wall(seconds)
    while engine.num_blocks != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_blocks == 2 and engine.kv_cache.keys[0].shape[0] == 2


def test_the_server_loop_trims_the_pool_when_it_goes_idle(tiny_loaded):
    from mlxpaged.server.engine_loop import EngineLoop

    loop = EngineLoop(lambda: LLMEngine(tiny_loaded, EngineConfig.of(kv_chunk_blocks=2, attention_impl="reference")))
    loop.start()
    try:
        _finish(loop, _prompts(1, 90)[0], "r", 8)
        engine = loop.engine
        assert engine.stats.blocks_in_use_peak >= 6  # the pool had to grow past its 2 blocks
        _wait_trimmed(engine, 10)
    finally:
        loop.stop()


def test_the_server_loop_keeps_an_idle_pool_for_the_grace_then_trims(tiny_loaded, mlx_lm_tiny):
    """An agent's next turn arrives seconds after its last: within `idle_trim_s` (serve's
    --kv-idle-trim) the grown pool and every cached block of the conversation stay, so the next
    turn hits its whole history; once the engine has been idle that long, the pool shrinks back."""
    import time

    from mlxpaged.server.engine_loop import EngineLoop

    make = lambda: LLMEngine(tiny_loaded, EngineConfig.of(kv_chunk_blocks=2, attention_impl="reference"))  # noqa: E731
    loop = EngineLoop(make, idle_trim_s=3.0)
    loop.start()
    try:
        first = _prompts(1, 90)[0]
        out = _finish(loop, first, "turn1", 8)
        engine = loop.engine
        grown = engine.num_blocks
        assert grown >= 6
        time.sleep(0.5)  # idle, within the grace: nothing trimmed
        assert engine.num_blocks == grown
        # The next turn: the whole history (prompt and answer) plus a new message. Its full
        # blocks are the first turn's 97 computed tokens' 6 whole blocks.
        history = first + out.outputs[0].token_ids + [11, 12, 13, 14, 15]
        nxt = _finish(loop, history, "turn2", 6)
        assert nxt.num_cached_tokens == 96
        assert nxt.outputs[0].token_ids == contiguous_generate(mlx_lm_tiny[0], history, 6)
        _wait_trimmed(engine, 15)
    finally:
        loop.stop()


def test_serve_refuses_a_cap_together_with_a_fixed_size():
    from click.testing import CliRunner

    from mlxpaged.server.cli import serve

    r = CliRunner().invoke(serve, ["--kv-memory-gb", "1", "--num-blocks", "64"])
    assert r.exit_code == 1 and "--kv-memory-gb" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(serve, ["--kv-memory-gb", "0"])
    assert r.exit_code == 2 and "--kv-memory-gb" in r.output  # click's range check
    r = CliRunner().invoke(serve, ["--kv-idle-trim", "-1"])
    assert r.exit_code == 2 and "--kv-idle-trim" in r.output


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_a_resize_holds_the_new_pools_and_one_old_one_not_both_sizes_of_every_pool(kv_bits):
    """Growing (or trimming) copies each pool; done one pool at a time with MLX's cache off, the
    most memory held at once is one size of every pool plus one copy in the making, where
    evaluating every copy together held both sizes of every pool (the growth step was a
    server's peak RSS)."""
    from mlxpaged.worker.kv_cache import PagedKVCache

    def pool_bytes(p):
        return sum(a.nbytes for a in (p.arrays if kv_bits else [p]))

    shape = CacheShape(8, 2, 64, mx.float32, kv_bits=kv_bits)
    cache = PagedKVCache(shape, 64, 16)
    mx.eval(cache.arrays)
    old = cache.nbytes
    for size in (128, 40):  # grow, then trim
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        cache.resize(size)
        new = cache.nbytes
        one_new = max(pool_bytes(p) for p in cache.keys + cache.values)
        assert all(a.shape[0] == size for a in cache.arrays)
        slack = 1 << 19  # MLX's allocator rounds small buffers up (an 8-bit pool's scales)
        assert mx.get_active_memory() - before <= new - old + slack  # the old pools are gone
        # the larger size of every pool, and one pool's copy (or its zeros) being made
        assert mx.get_peak_memory() - before <= max(new - old, 0) + one_new + slack
        old = new
