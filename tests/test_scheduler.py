"""Prefix caching, chunked prefill and preemption in the running engine (tiny checkpoint)."""

import random

import pytest

from mlxpaged import LLM, EngineConfig, LLMEngine, SamplingParams

from drive import run_all
from reference import contiguous_generate


def tokens(done):
    return {rid: [c.token_ids for c in o.outputs] for rid, o in done.items()}


def test_prefix_rule_in_the_engine(tiny_loaded, mlx_lm_tiny):
    ref_model, _ = mlx_lm_tiny
    a = [(17 * i + 3) % 300 + 1 for i in range(96)]
    b = a[:85] + [5, 6, 7, 8]
    c = a[:2] + [a[2] + 1] + a[3:]
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=64))
    g = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cached = {}
    for name, prompt in [("A", a), ("B", b), ("C", c), ("A2", a)]:
        engine.add_request(prompt, g, request_id=name)
        out = run_all(engine)[name]
        cached[name] = out.num_cached_tokens
        assert out.outputs[0].token_ids == contiguous_generate(ref_model, prompt, 8)
    assert cached == {"A": 0, "B": 80, "C": 0, "A2": 80}
    assert engine.stats_dict()["prefix_cache_hit_tokens"] == 160


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefix_caching_on_equals_off(tiny_loaded, block_size):
    system = [(31 * i) % 250 + 1 for i in range(40)]
    prompts = [system + [(i * 13 + j) % 250 + 1 for j in range(3 + i)] for i in range(6)] + [system]
    g = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = []
    for caching in (True, False):
        engine = LLMEngine(
            tiny_loaded, EngineConfig.of(block_size=block_size, num_blocks=256, enable_prefix_caching=caching)
        )
        for i, p in enumerate(prompts):
            engine.add_request(p, g, request_id=str(i))
            if i == 0:
                run_all(engine)  # the first request fills the cache
        results.append((tokens(run_all(engine)), engine.stats_dict()["prefix_cache_hit_tokens"]))
    (on, hits_on), (off, hits_off) = results
    assert on == off and hits_off == 0 and hits_on >= 6 * (40 // block_size) * block_size - block_size


def test_chunked_prefill_matches_contiguous(tiny_loaded, mlx_lm_tiny):
    ref_model, _ = mlx_lm_tiny
    long = [(7 * i) % 300 + 1 for i in range(150)]
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=64, max_num_batched_tokens=32))
    engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), request_id="short")
    engine.add_request(long, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), request_id="long")
    steps = 0
    done = {}
    chunks = []  # the long prompt's prefill chunk per step
    forward = engine.runner.forward

    def recording(batch):
        chunks.extend(n for s, n in batch if s.num_prompt_tokens == 150 and n > 1)
        assert sum(n for _, n in batch) <= 32, "a step computes at most max_num_batched_tokens"
        return forward(batch)

    engine.runner.forward = recording
    while engine.has_unfinished_requests():
        for o in engine.step():
            done.update({o.request_id: o} if o.finished else {})
        steps += 1
    # 150 prompt tokens in chunks of at most 32, less the decode that runs beside each chunk.
    assert sum(chunks) == 150 and len(chunks) == 5 and max(chunks) <= 31
    assert done["long"].outputs[0].token_ids == contiguous_generate(ref_model, long, 10)
    assert done["short"].outputs[0].token_ids == contiguous_generate(ref_model, [1, 2, 3], 30)


@pytest.mark.parametrize("caching,order", [(True, "fcfs"), (False, "fcfs"), (True, "shortest")])
def test_preemption_recomputes_to_the_same_tokens(tiny_loaded, caching, order):
    prompts = [[(11 * i + j) % 300 + 1 for j in range(10 + 7 * i)] for i in range(5)]
    params = [SamplingParams(n=1 + i % 3, temperature=0.8, seed=i, max_tokens=40, ignore_eos=True) for i in range(5)]

    def run(num_blocks):
        engine = LLMEngine(
            tiny_loaded,
            EngineConfig.of(block_size=4, num_blocks=num_blocks, enable_prefix_caching=caching, prefill_order=order),
        )
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(p, sp, request_id=str(i))
        done = run_all(engine)
        pool = engine.block_manager.pool
        assert all(b.ref_cnt == 0 for b in pool.blocks) and pool.num_free == pool.num_blocks  # nothing leaked
        return tokens(done), engine.stats_dict()["preemptions"]

    ample, p0 = run(1024)
    tight, p1 = run(60)
    assert p0 == 0 and p1 > 0
    assert tight == ample


@pytest.mark.parametrize("order", ["fcfs", "shortest"])
def test_randomized_workload_keeps_invariants(tiny_loaded, order):
    rng = random.Random(0)
    for _trial in range(3):
        engine = LLMEngine(
            tiny_loaded,
            EngineConfig.of(
                block_size=rng.choice([2, 4, 8]),
                num_blocks=rng.randint(40, 90),
                max_num_seqs=rng.randint(2, 8),
                max_num_batched_tokens=rng.randint(16, 64),
                prefill_order=order,
            ),
        )
        shared = [rng.randint(1, 300) for _ in range(rng.randint(0, 24))]
        pending = []
        for i in range(10):
            p = shared[: rng.randint(0, len(shared))] + [rng.randint(1, 300) for _ in range(rng.randint(1, 20))]
            pending.append(
                (
                    p,
                    SamplingParams(
                        n=rng.randint(1, 3),
                        temperature=rng.choice([0, 0.7]),
                        seed=i,
                        max_tokens=rng.randint(1, 24),
                        ignore_eos=True,
                    ),
                )
            )
        finished, max_tokens = 0, {}
        while pending or engine.has_unfinished_requests():
            if pending and rng.random() < 0.4:
                p, sp = pending.pop()
                max_tokens[engine.add_request(p, sp)] = (sp.n, sp.max_tokens)
            for o in engine.step():
                finished += o.finished
                if o.finished:
                    n, m = max_tokens[o.request_id]
                    assert [len(c.token_ids) for c in o.outputs] == [m] * n
            engine.check_invariants()
        assert finished == 10
        pool = engine.block_manager.pool
        assert pool.num_free == pool.num_blocks  # every block free or cached


def test_llm_api(tiny_loaded, mlx_lm_tiny):
    ref_model, tok = mlx_lm_tiny
    llm = LLM(tiny_loaded, num_blocks=128)
    outs = llm.generate(
        ["The KV cache stores", tok.encode("Paged attention")],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    )
    assert [o.outputs[0].token_ids for o in outs] == [
        contiguous_generate(ref_model, tok.encode("The KV cache stores"), 12),
        contiguous_generate(ref_model, tok.encode("Paged attention"), 12),
    ]
    assert outs[0].outputs[0].text == tok.decode(outs[0].outputs[0].token_ids)
    # Stop strings end the sample and are cut from its text.
    full = outs[0].outputs[0].text
    stop = full[3:6]
    (o,) = llm.generate(
        "The KV cache stores", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    )
    assert o.outputs[0].finish_reason == "stop" and o.outputs[0].text == full[: full.find(stop)]


def test_eos_ends_a_sample(tiny_loaded):
    llm = LLM(tiny_loaded, num_blocks=64)
    (o,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    second = o.outputs[0].token_ids[1]
    (o2,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[second]))
    assert o2.outputs[0].token_ids == o.outputs[0].token_ids[:2] and o2.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("kwargs", [dict(n=0), dict(max_tokens=0), dict(top_p=0.0), dict(temperature=-1)])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_hash_collision_recomputes_in_the_engine(tiny_loaded, mlx_lm_tiny):
    """Every block hashes alike: B must recompute, never read A's cached blocks."""
    ref_model, _ = mlx_lm_tiny
    engine = LLMEngine(
        tiny_loaded, EngineConfig.of(block_size=4, num_blocks=64), hash_fn=lambda parent, tokens, extra: b"same"
    )
    a = [(5 * i) % 300 + 1 for i in range(24)]
    b = [(7 * i) % 300 + 2 for i in range(24)]
    g = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for name, p in [("A", a), ("B", b)]:
        engine.add_request(p, g, request_id=name)
        outs.update(run_all(engine))
    assert outs["B"].num_cached_tokens == 0
    assert outs["B"].outputs[0].token_ids == contiguous_generate(ref_model, b, 10)


def test_requests_arriving_together_share_a_prefix(tiny_loaded):
    """Two requests with one 40-token system prompt, submitted at once: the second reuses the
    first's blocks (it waits one step for them) and decodes exactly as without caching."""
    system = [(13 * i) % 250 + 1 for i in range(40)]
    prompts = [system + [7, 8, 9], system + [10, 11]]
    g = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = []
    for caching in (True, False):
        engine = LLMEngine(tiny_loaded, EngineConfig.of(block_size=16, num_blocks=64, enable_prefix_caching=caching))
        for i, p in enumerate(prompts):
            engine.add_request(p, g, request_id=str(i))
        done = run_all(engine)
        results.append((tokens(done), [done[str(i)].num_cached_tokens for i in range(2)]))
    (on, hits_on), (off, hits_off) = results
    assert on == off and hits_on == [0, 32] and hits_off == [0, 0]


def test_preemption_takes_the_newest_and_requeues_it_first(tiny_loaded, mlx_lm_tiny):
    """Out of blocks, the most recently admitted request is preempted, and it goes back to the
    front of the waiting queue, ahead of a request that never ran."""
    ref_model, _ = mlx_lm_tiny
    # Two sequences at most run at once; each needs 7 blocks at full length, the pool has 12.
    engine = LLMEngine(tiny_loaded, EngineConfig.of(block_size=4, num_blocks=12, max_num_seqs=2, watermark=0.0))
    g = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = {rid: [(11 * i + 7 * k) % 250 + 1 for i in range(8)] for k, rid in enumerate(["old", "new", "queued"])}
    for rid, prompt in prompts.items():
        engine.add_request(prompt, g, request_id=rid)
    sched, events = engine.scheduler, []
    preempt = sched._preempt_newest

    def spy(out):
        running = list(sched.running)
        victim = preempt(out)
        events.append((victim.request_id, running, [r.request_id for r in sched.waiting]))
        return victim

    sched._preempt_newest = spy
    done = run_all(engine)
    assert events, "the pool was meant to run out"
    victim, running, waiting = events[0]
    assert (victim, running) == ("new", ["old", "new"]), "the newest running request is preempted"
    assert waiting == ["new", "queued"], "and it waits ahead of the request that never ran"
    for rid, prompt in prompts.items():
        assert done[rid].outputs[0].token_ids == contiguous_generate(ref_model, prompt, 20)


def test_block_reused_only_under_its_own_parent(tiny_loaded, mlx_lm_tiny):
    """After A = [X, W, t] and C = [Z, Y, t], B = [X, Y, t] reuses X's block but recomputes Y
    (C's copy of Y was computed after Z), and its tokens are mlx-lm's."""
    ref_model, _ = mlx_lm_tiny
    bs = 4
    X, W, Z, Y, t = ([(13 * i + 5 * k) % 250 + 1 for i in range(bs)] for k in range(5))
    engine = LLMEngine(tiny_loaded, EngineConfig.of(block_size=bs, num_blocks=64))
    g = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for rid, prompt in (("A", X + W + t), ("C", Z + Y + t)):
        engine.add_request(prompt, g, request_id=rid)
        run_all(engine)
    engine.add_request(X + Y + t, g, request_id="B")
    out = run_all(engine)["B"]
    assert out.num_cached_tokens == bs
    assert out.outputs[0].token_ids == contiguous_generate(ref_model, X + Y + t, 16)


def _first_token_steps(engine, arrivals=None, max_steps=400):
    """Step `engine` to the end (queueing `arrivals[i]` [(rid, prompt, params)] before step i); each
    request's step of its first output token, and its finished output."""
    first, done, step = {}, {}, 0
    arrivals = dict(arrivals or {})
    while engine.has_unfinished_requests() or arrivals:
        for rid, p, sp in arrivals.pop(step, []):
            engine.add_request(p, sp, request_id=rid)
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                first.setdefault(out.request_id, step)
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
        step += 1
        assert step < max_steps
    return first, done


def _order_engine(tiny_loaded, order, budget=16):
    return LLMEngine(
        tiny_loaded,
        EngineConfig.of(num_blocks=128, max_num_batched_tokens=budget, prefill_order=order, async_scheduling=False),
    )


@pytest.mark.parametrize("order", ["fcfs", "shortest"])
def test_shortest_prefill_first_serves_a_short_prompt_before_a_long_one(tiny_loaded, mlx_lm_tiny, order):
    """Arriving together, a long prompt first: with "shortest" the short one's first token comes
    first (it waits behind nobody), with "fcfs" after the long one's; the tokens are mlx-lm's."""
    long = [(7 * i) % 300 + 1 for i in range(120)]
    short = [(11 * i) % 300 + 2 for i in range(20)]
    g = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = _order_engine(tiny_loaded, order)
    engine.add_request(long, g, request_id="long")
    engine.add_request(short, g, request_id="short")
    first, done = _first_token_steps(engine)
    if order == "shortest":
        assert first["short"] == 1 and first["long"] > first["short"]  # 20 tokens: two steps of 16
    else:
        assert first["long"] == 7 and first["short"] > first["long"]  # 120 tokens: 8 steps of 16
    for rid, p in (("long", long), ("short", short)):
        assert done[rid].outputs[0].token_ids == contiguous_generate(mlx_lm_tiny[0], p, 6)


def test_shortest_prefill_first_counts_the_prefix_hit(tiny_loaded, mlx_lm_tiny):
    """A long prompt whose first 160 tokens are cached has 10 left: it goes before an uncached
    prompt of 64, though its prompt is longer."""
    cached = [(5 * i) % 300 + 1 for i in range(160)]
    g = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = _order_engine(tiny_loaded, "shortest")
    engine.add_request(cached + [9], g, request_id="warm")
    run_all(engine)
    hit = cached + [(3 * i) % 300 + 4 for i in range(10)]
    medium = [(13 * i) % 300 + 1 for i in range(64)]
    engine.add_request(medium, g, request_id="medium")
    engine.add_request(hit, g, request_id="hit")
    first, done = _first_token_steps(engine)
    assert done["hit"].num_cached_tokens == 160 and first["hit"] == 0 and first["medium"] > 0
    for rid, p in (("hit", hit), ("medium", medium)):
        assert done[rid].outputs[0].token_ids == contiguous_generate(mlx_lm_tiny[0], p, 4)


def test_shortest_prefill_first_starves_no_long_prompt(tiny_loaded):
    """A short prompt arrives every step and would always be shorter: the long one is passed over
    at most PASSED_OVER_LIMIT steps in a row, then computes a chunk."""
    from mlxpaged.core.scheduler import PASSED_OVER_LIMIT

    long = [(7 * i) % 300 + 1 for i in range(64)]
    g = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine = _order_engine(tiny_loaded, "shortest", budget=16)
    engine.add_request(long, g, request_id="long")
    steps = PASSED_OVER_LIMIT * 6  # arrivals outlast the bound below: without the guard it waits them out
    arrivals = {i: [(f"s{i}", [(3 * i + j) % 300 + 1 for j in range(16)], g)] for i in range(steps)}
    first, _ = _first_token_steps(engine, arrivals)
    # 4 chunks of 16, each after at most PASSED_OVER_LIMIT steps passed over
    assert first["long"] <= 4 * (PASSED_OVER_LIMIT + 1)


def test_prefill_order_is_checked():
    with pytest.raises(ValueError, match="prefill_order"):
        EngineConfig.of(prefill_order="lifo")


def test_shortest_prefill_first_waits_for_the_blocks_it_shares_and_no_longer(tiny_loaded, mlx_lm_tiny):
    """Arriving together with a prompt whose first 64 tokens are its own (a shared system prompt),
    a request under "shortest" is admitted once those 4 blocks are computed and hits all of them,
    not only the first; one that shares only the first block starts after that block, even
    queued behind the held one, and is served before both."""
    system = [(5 * i) % 300 + 1 for i in range(64)]
    long = system + [(7 * i) % 300 + 2 for i in range(100)]
    same = system + [(11 * i) % 300 + 3 for i in range(5)]
    head = system[:16] + [(13 * i) % 300 + 4 for i in range(10)]
    g = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine = _order_engine(tiny_loaded, "shortest")
    for rid, p in (("long", long), ("same", same), ("head", head)):
        engine.add_request(p, g, request_id=rid)
    first, done = _first_token_steps(engine)
    assert done["same"].num_cached_tokens == 64 and done["head"].num_cached_tokens == 16
    assert first["head"] < first["same"] < first["long"]  # "head" is not held behind "same"
    for rid, p in (("long", long), ("same", same), ("head", head)):
        assert done[rid].outputs[0].token_ids == contiguous_generate(mlx_lm_tiny[0], p, 3)
