"""Prompt logprobs (SamplingParams.prompt_logprobs, what lm-eval's echo asks for) against mlx-lm's
own model run contiguously over the whole prompt: every prompt token's log-softmax and its top-k,
with chunked prefill, other requests decoding in the same steps, and a prefix already cached."""

import mlx.core as mx
import numpy as np
import pytest

from mlxpaged import EngineConfig, LLMEngine, SamplingParams


def reference(model, prompt: list[int]) -> np.ndarray:
    """log_softmax of mlx-lm's logits at every position, float64: [P, V]."""
    logits = model(mx.array(prompt)[None])[0].astype(mx.float32)
    x = np.array(logits, dtype=np.float64)
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


def check(out, model, prompt, k):
    want = reference(model, prompt)
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        e = got[p]
        assert e.token_id == prompt[p]
        np.testing.assert_allclose(e.logprob, want[p - 1, prompt[p]], atol=2e-4)
        assert len(e.top_logprobs) == k
        ids = [i for i, _ in e.top_logprobs]
        top = np.argsort(-want[p - 1], kind="stable")[:k]
        np.testing.assert_allclose([v for _, v in e.top_logprobs], want[p - 1, top], atol=2e-4)
        assert set(ids) == set(top.tolist()) or np.allclose(
            sorted(want[p - 1, ids]), sorted(want[p - 1, top]), atol=2e-4
        )


@pytest.mark.parametrize("chunk", [7, 64])
def test_prompt_logprobs_match_mlx_lm_across_chunks_beside_decodes(tiny_loaded, mlx_lm_tiny, chunk):
    model, _ = mlx_lm_tiny
    engine = LLMEngine(
        tiny_loaded,
        EngineConfig.of(num_blocks=128, block_size=4, max_num_batched_tokens=chunk, attention_impl="reference"),
    )
    prompt = [(13 * i) % 200 + 3 for i in range(45)]  # crosses blocks; several chunks at chunk=7
    # another request decoding while this one prefills (the same packed steps)
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), "other")
    engine.step()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3), "lp")
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    check(done["lp"], model, prompt, 3)
    assert done["other"].prompt_logprobs is None  # only who asks pays
    # the same prompt again, now in the prefix cache: still every position scored, none cached
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), "again")
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    check(done["again"], model, prompt, 0)
    assert done["again"].num_cached_tokens == 0
    # a request without prompt logprobs still takes the cached prefix
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), "hit")
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert done["hit"].num_cached_tokens > 0


def test_prompt_logprobs_are_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
