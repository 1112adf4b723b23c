"""Beam search on shared blocks against a plain beam search over mlx-lm's contiguous caches."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxpaged import BeamSearchParams, EngineConfig, LLMEngine, SamplingParams
from mlxpaged.engine.llm import LLM

from reference import (
    contiguous_generate,
    reference_beam_search,  # noqa: E402
)

PROMPTS = ["The KV cache stores", "Paged attention borrows an idea from operating systems:", "Write a Python"]


def engine_beams(
    loaded, prompts, width, max_tokens, eos=None, num_blocks=256, block_size=16, check=True, ignore_eos=False
):
    engine = LLMEngine(
        loaded, EngineConfig.of(num_blocks=num_blocks, block_size=block_size, attention_impl="reference")
    )
    if eos is not None:
        engine.eos_token_ids = set(eos)
    p = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=ignore_eos)
    rids = [engine.add_beam_request(pr, p) for pr in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if check:
                engine.check_invariants()
            if o.finished:
                done[o.request_id] = o
    pool = engine.block_manager.pool
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    return [done[r] for r in rids], engine


def assert_same(got, want):
    assert len(got.outputs) == len(want)
    for c, (score, toks, cum) in zip(got.outputs, want):
        assert c.token_ids == toks
        assert c.cumulative_logprob == pytest.approx(cum, abs=1e-4)
        assert c.score == pytest.approx(score, abs=1e-4)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_beams_match_reference(tiny_loaded, mlx_lm_tiny, width):
    ref_model, tok = mlx_lm_tiny
    prompts = [tok.encode(p) for p in PROMPTS]
    outs, engine = engine_beams(tiny_loaded, prompts, width, 12)
    for p, o in zip(prompts, outs):
        assert_same(o, reference_beam_search(ref_model, p, width, 12, eos=set(tok.eos_token_ids)))
    if width > 1:
        st_ = engine.stats_dict()
        assert st_["beam_forks"] > 0 and st_["blocks_in_use_peak"] < st_["blocks_without_sharing"]


@pytest.mark.parametrize("width", [2, 4])
def test_beams_with_eos_match_reference(tiny_loaded, mlx_lm_tiny, width):
    """Make frequent tokens EOS, so hypotheses finish early and the early-stopping rule matters."""
    ref_model, tok = mlx_lm_tiny
    prompts = [tok.encode(p) for p in PROMPTS]
    greedy = [contiguous_generate(ref_model, p, 10) for p in prompts]
    eos = {g[i] for g in greedy for i in (1, 3, 5)}
    outs, _ = engine_beams(tiny_loaded, prompts, width, 16, eos=eos)
    assert any(c.finish_reason == "stop" for o in outs for c in o.outputs)
    for p, o in zip(prompts, outs):
        want = reference_beam_search(ref_model, p, width, 16, eos=eos)
        assert_same(o, want)
        assert [c.text for c in o.outputs] == [tok.decode(t[:-1] if t[-1] in eos else t) for _, t, _ in want]


def test_width_one_is_greedy(tiny_loaded, mlx_lm_tiny):
    ref_model, tok = mlx_lm_tiny
    prompt = tok.encode(PROMPTS[1])
    (out,), _ = engine_beams(tiny_loaded, [prompt], 1, 20, ignore_eos=True)
    assert out.outputs[0].token_ids == contiguous_generate(ref_model, prompt, 20)


def test_beams_beside_ordinary_requests_and_through_llm(tiny_loaded, mlx_lm_tiny):
    ref_model, tok = mlx_lm_tiny
    llm = LLM(tiny_loaded, num_blocks=256, attention_impl="reference")
    prompt = tok.encode(PROMPTS[0])
    other = llm.engine.add_request(
        tok.encode(PROMPTS[2]), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=10))
    assert_same(out, reference_beam_search(ref_model, prompt, 3, 10, eos=set(tok.eos_token_ids)))
    assert other not in llm.engine._requests  # the greedy request ran in the same batches and finished


def test_beams_join_a_running_engine_with_overlapped_steps(tiny_loaded, mlx_lm_tiny):
    """Beam search is a layer that sleeps until the first beam request (the plain step calls no
    beam code); one arriving while ordinary requests decode with a step in flight still ranks
    the reference's beams, and the ordinary requests keep mlx-lm's tokens."""
    from mlxpaged.engine.beam_search import BeamLayer

    ref_model, tok = mlx_lm_tiny
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=256, attention_impl="reference", async_scheduling=True))
    plain = [tok.encode(p) for p in PROMPTS[1:]]
    for i, p in enumerate(plain):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True), request_id=f"plain{i}")
    done = {}
    for _ in range(4):
        for o in engine.step():
            done[o.request_id] = o
    assert engine._inflight is not None  # a step in flight when the beams join
    assert not any(isinstance(x, BeamLayer) for x in engine.layers.read_back + engine.layers.reads_at_once)
    prompt = tok.encode(PROMPTS[0])
    rid = engine.add_beam_request(prompt, BeamSearchParams(beam_width=3, max_tokens=10))
    assert any(isinstance(x, BeamLayer) for x in engine.layers.read_back)
    while engine.has_unfinished_requests():
        for o in engine.step():
            engine.check_invariants()
            done[o.request_id] = o
    assert_same(done[rid], reference_beam_search(ref_model, prompt, 3, 10, eos=set(tok.eos_token_ids)))
    for i, p in enumerate(plain):
        assert done[f"plain{i}"].outputs[0].token_ids == contiguous_generate(ref_model, p, 14)


def test_preempted_beam_search_recomputes_to_the_same_beams(tiny_loaded, mlx_lm_tiny):
    ref_model, tok = mlx_lm_tiny
    prompts = [tok.encode(p) for p in PROMPTS]
    ample, _ = engine_beams(tiny_loaded, prompts, 4, 24, block_size=4, num_blocks=400)
    tight, engine = engine_beams(tiny_loaded, prompts, 4, 24, block_size=4, num_blocks=44)
    assert engine.stats_dict()["preemptions"] > 0
    for a, t in zip(ample, tight):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in t.outputs]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    width=st.integers(1, 5),
    max_tokens=st.integers(1, 20),
    num_blocks=st.integers(30, 120),
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_prompts=st.integers(1, 3),
)
def test_block_accounting_holds(tiny_loaded, width, max_tokens, num_blocks, block_size, num_prompts):
    prompts = [[(7 * i + 3 * j) % 300 + 1 for j in range(5 + 4 * i)] for i in range(num_prompts)]
    need = max(-(-(len(p) + max_tokens) // block_size) * width for p in prompts)  # one search alone, unshared
    outs, engine = engine_beams(
        tiny_loaded, prompts, width, max_tokens, num_blocks=max(num_blocks, need), block_size=block_size
    )  # invariants checked after every step
    assert all(len(o.outputs) == width for o in outs)  # one EOS id leaves >= W live candidates each step
    assert engine.block_manager.pool.num_free == engine.block_manager.pool.num_blocks
