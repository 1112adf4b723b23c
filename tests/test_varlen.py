"""One forward pass per step: `paged_attention_varlen` against SDPA on contiguous keys, and the
engine's packed steps against mlx-lm's contiguous cache."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams
from mlxpaged.attention import paged_attention_varlen

import drive
from attention_cases import CASES, make_varlen_case, sdpa_with_mask
from reference import contiguous_generate


@pytest.mark.parametrize(
    "head_dim,group,block_size", list(itertools.product([64, 128], [1, 7], [1, 16])) + [(64, 2, 256)]
)
def test_varlen_reference_matches_sdpa(head_dim, group, block_size):
    rng = np.random.default_rng(head_dim + 10 * group + block_size)
    for q_lens, prefixes in CASES:
        case = make_varlen_case(rng, head_dim, group, block_size, q_lens, prefixes)
        q, kc, vc, tables, cu, ctx = case
        scale = head_dim**-0.5
        got = paged_attention_varlen(*(mx.array(a) for a in case), impl="reference")
        assert got.shape == q.shape
        want = sdpa_with_mask(q, kc, vc, tables, cu, ctx, scale)
        np.testing.assert_allclose(np.array(got), want, atol=3e-5, rtol=1e-4)


def test_varlen_rejects_mismatched_metadata():
    rng = np.random.default_rng(0)
    q, kc, vc, tables, cu, ctx = (mx.array(a) for a in make_varlen_case(rng, 64, 2, 16, [3, 1], [0, 4]))
    with pytest.raises(ValueError):
        paged_attention_varlen(q, kc, vc, tables, cu[:-1], ctx)
    with pytest.raises(ValueError):
        paged_attention_varlen(q, kc, vc, tables[:1], cu, ctx)


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run_all(engine):
    return {k: o.outputs[0].token_ids for k, o in drive.run_all(engine).items()}


def ragged_prompts(count=8):
    return [[(13 * i + 5 * j) % 300 + 1 for j in range(3 + 11 * i)] for i in range(count)]


def test_one_model_call_per_step(tiny_loaded):
    """A step with 3 decodes and 2 prefill chunks calls the model exactly once, with all 5 sequences."""
    engine = LLMEngine(
        tiny_loaded, EngineConfig.of(num_blocks=128, max_num_batched_tokens=64, attention_impl="reference")
    )
    for i, p in enumerate(ragged_prompts(3)):
        engine.add_request(p[:5], greedy(20), request_id=f"d{i}")
    engine.step()  # the three short prompts prefill together in one pass
    engine.add_request(ragged_prompts(8)[7], greedy(5), request_id="long")  # 80 tokens: chunked
    engine.add_request(ragged_prompts(8)[6][:30], greedy(5), request_id="mid")
    calls = []
    model = engine.runner.model
    engine.runner.model = lambda tokens, cache, meta: (
        calls.append((tokens.shape, meta.cu_seqlens_q.tolist())) or model(tokens, cache, meta)
    )
    out = engine.scheduler
    engine.step()
    assert len(calls) == 1
    (shape,), cu = calls[0]
    # 3 decodes, then "long"'s first chunk (the budget's 61 tokens left), and no room for "mid"
    assert cu[:4] == [0, 1, 2, 3] and shape == cu[-1] == 64
    engine.step()
    assert len(calls) == 2
    q_lens = np.diff(calls[1][1]).tolist()
    assert q_lens[:3] == [1, 1, 1] and len(q_lens) == 5  # 3 decodes + the rest of "long" + "mid"
    assert out._num_running_seqs == 5 == sum(len(r.live_seqs()) for r in out.running.values())


@pytest.mark.parametrize("caching", [True, False])
def test_ragged_prompts_together_match_contiguous(tiny_loaded, mlx_lm_tiny, caching):
    ref_model, _ = mlx_lm_tiny
    prompts = ragged_prompts(8)
    prompts = [prompts[0] + p if i % 2 else p for i, p in enumerate(prompts)]  # some share a prefix
    engine = LLMEngine(
        tiny_loaded,
        EngineConfig.of(num_blocks=256, block_size=4, enable_prefix_caching=caching, attention_impl="reference"),
    )
    for i, p in enumerate(prompts):
        engine.add_request(p, greedy(12), request_id=str(i))
    got = run_all(engine)
    for i, p in enumerate(prompts):
        assert got[str(i)] == contiguous_generate(ref_model, p, 12), i


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_at_any_chunk_size(tiny_loaded, mlx_lm_tiny, chunk):
    ref_model, _ = mlx_lm_tiny
    prompts = ragged_prompts(4)[1:]
    engine = LLMEngine(
        tiny_loaded, EngineConfig.of(num_blocks=128, max_num_batched_tokens=chunk + 3, attention_impl="reference")
    )
    for i, p in enumerate(prompts):
        engine.add_request(p, greedy(8), request_id=str(i))
    got = run_all(engine)
    for i, p in enumerate(prompts):
        assert got[str(i)] == contiguous_generate(ref_model, p, 8)


def test_arrivals_while_others_decode(tiny_loaded, mlx_lm_tiny):
    ref_model, _ = mlx_lm_tiny
    prompts = ragged_prompts(6)
    engine = LLMEngine(
        tiny_loaded, EngineConfig.of(num_blocks=128, max_num_batched_tokens=40, attention_impl="reference")
    )
    done = {}
    for i, p in enumerate(prompts):
        engine.add_request(p, greedy(10), request_id=str(i))
        for _ in range(3):  # the newcomer prefills beside the running decodes
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    done.update(run_all(engine))
    for i, p in enumerate(prompts):
        assert done[str(i)] == contiguous_generate(ref_model, p, 10)
