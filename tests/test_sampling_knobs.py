"""min_p, logit_bias and the presence, frequency and repetition penalties against numpy.

Distributions: 20,000 draws fit the numpy reference (chi-square, p > 0.001, as test_sampler.py)
and reject a plausible wrong definition (p < 1e-9), so passing means something. Engine: the
tiny model's tokens with penalties equal a contiguous mlx-lm loop that applies the numpy
penalties, with overlapped steps (the previous token is still on the device when the next
draw is built) and without.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxpaged.config import EngineConfig
from mlxpaged.engine.llm_engine import LLMEngine
from mlxpaged.engine.sampler import (
    KEEP_FROM,
    GuideMasks,
    PenaltyCounts,
    TokenHistory,
    apply_penalties,
    process_logits,
    sample_arrays,
    sample_batch,
    sample_key,
    unpack_bitmask,
)
from mlxpaged.engine.sampling_params import SamplingParams
from mlxpaged.errors import MlxPagedError

from chi_square import ALPHA, LOGITS, gof_pvalue
from drive import run_all
from reference import ref_draw

N = 20_000


def ref_process(logits: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    """vLLM's order in numpy (float64): logit_bias, repetition (prompt + output), frequency, presence."""
    x = logits.astype(np.float64).copy()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    counts = np.bincount(np.array(output, dtype=np.int64), minlength=x.size)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def ref_min_p_probs(x: np.ndarray, temperature: float, min_p: float) -> np.ndarray:
    probs = softmax(x / temperature)
    probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def draw_counts(params: SamplingParams, history: TokenHistory | None = None, logits=LOGITS) -> np.ndarray:
    """Token counts of N draws of `params` on `logits`, each with its own key, in one sample_batch."""
    keys = mx.random.split(mx.random.key(1234), N)
    lg = mx.broadcast_to(mx.array(logits), (N, logits.size))
    toks, _, _ = sample_batch(
        lg, [params] * N, [(keys, i) for i in range(N)], histories=[history] * N if history is not None else None
    )
    return np.bincount(np.array(toks), minlength=logits.size)


# Prompt [1, 1, 8] (a negative logit); known output [0, 0, 3] and a pending token 2 (drawn by the previous step,
# still an MLX array): the output the penalties see is [0, 0, 3, 2].
PROMPT, KNOWN, PENDING = [1, 1, 8], [0, 0, 3], 2


def history() -> TokenHistory:
    return TokenHistory(PROMPT + KNOWN, len(PROMPT), (mx.array([7, PENDING]), 1))


@pytest.mark.parametrize(
    "kwargs,wrong",
    [
        (
            dict(presence_penalty=1.5),
            lambda p: ref_process(LOGITS, SamplingParams(frequency_penalty=1.5), PROMPT, KNOWN + [PENDING]),
        ),
        (dict(presence_penalty=-1.0), lambda p: ref_process(LOGITS, p, PROMPT, KNOWN)),  # the pending token forgotten
        (dict(frequency_penalty=0.9), lambda p: ref_process(LOGITS, p, PROMPT, KNOWN)),  # the pending token forgotten
        (
            dict(frequency_penalty=-0.7),
            lambda p: ref_process(LOGITS, SamplingParams(presence_penalty=-0.7), PROMPT, KNOWN + [PENDING]),
        ),
        (dict(repetition_penalty=1.8), lambda p: ref_process(LOGITS, p, [], KNOWN + [PENDING])),  # output only
        (
            dict(repetition_penalty=0.5),
            lambda p: LOGITS / np.where(np.isin(np.arange(10), PROMPT + KNOWN + [PENDING]), 0.5, 1.0),
        ),  # divides all
    ],
)
def test_penalties_match_numpy_distribution(kwargs, wrong):
    p = SamplingParams(temperature=1.3, **kwargs)
    want = softmax(ref_process(LOGITS, p, PROMPT, KNOWN + [PENDING]) / 1.3)
    other = softmax(wrong(p) / 1.3)
    assert 0.5 * np.abs(want - other).sum() > 0.008
    counts = draw_counts(p, history())
    assert gof_pvalue(counts, want) > ALPHA
    assert gof_pvalue(counts, other) < 1e-9


@pytest.mark.parametrize("temperature,min_p", [(2.0, 0.2), (0.7, 0.05), (1.5, 0.3)])
def test_min_p_matches_numpy_distribution(temperature, min_p):
    """min_p after the temperature (vLLM); applying it to the untempered logits is rejected."""
    p = SamplingParams(temperature=temperature, min_p=min_p)
    want = ref_min_p_probs(LOGITS.astype(np.float64), temperature, min_p)
    before = softmax(LOGITS.astype(np.float64))
    before = np.where(before >= min_p * before.max(), LOGITS / temperature, -np.inf)
    other = softmax(before)
    assert (want == 0).any() and 0.5 * np.abs(want - other).sum() > 0.01
    counts = draw_counts(p)
    assert gof_pvalue(counts, want) > ALPHA
    assert gof_pvalue(counts, other) < 1e-9


def test_min_p_with_top_k_top_p_and_bias_exact():
    """Processed logits of a mixed batch equal the reference exactly where finite, -inf where dropped."""
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(4, 300)).astype(np.float32) * 3
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100.0}, repetition_penalty=1.2),
        SamplingParams(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: -100.0, 9: 2.5}),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, repetition_penalty=0.8),
    ]
    hists = [
        TokenHistory([1, 2, 3, 7, 7], 2),
        TokenHistory([4, 9, 9, 9, 3], 1, (mx.array([11]), 0)),
        None,
        TokenHistory([5, 6], 2),
    ]
    got = np.array(process_logits(mx.array(logits), params, None, hists))
    outs = [[3, 7, 7], [9, 9, 9, 3, 11], [], []]
    prompts = [[1, 2], [4], [], [5, 6]]
    for i, p in enumerate(params):
        want = ref_process(logits[i], p, prompts[i], outs[i])
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-4)
    # a greedy row takes the argmax of the processed logits (vLLM): the +100 token
    s = sample_arrays(
        mx.array(logits), params, [None, sample_key(1, 0), sample_key(1, 1), sample_key(1, 2)], histories=hists
    )
    assert s.tokens.tolist()[0] == 7


def test_no_processor_no_array():
    """Rows that ask for no mask, bias or penalty are the logits themselves: no extra array."""
    logits = mx.array(np.zeros((3, 10), dtype=np.float32))
    assert process_logits(logits, [SamplingParams(temperature=t) for t in (0, 1, 2)], None, None) is logits


def test_bitmask_matches_numpy():
    rng = np.random.default_rng(6)
    v = 70  # not a multiple of 32
    bits = rng.integers(-(2**31), 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)
    x = rng.normal(size=(3, v)).astype(np.float32)
    allowed = np.array([[(int(bits[r, t // 32]) >> (t % 32)) & 1 for t in range(v)] for r in range(3)], dtype=bool)
    assert np.array_equal(unpack_bitmask(bits, v), allowed)
    got = np.array(process_logits(mx.array(x), [SamplingParams()] * 3, GuideMasks([0, 1, 2], bits), None))
    assert np.array_equal(np.isfinite(got), allowed) and np.array_equal(got[allowed], x[allowed])
    # in a batch, only the listed rows are masked
    params = [SamplingParams(temperature=0)] * 3
    logits = mx.array(x)
    s = sample_arrays(logits, params, [None] * 3, masks=GuideMasks([1], bits[1:2]))
    toks = s.tokens.tolist()
    assert np.array_equal(np.array(logits), x)  # the caller's logits are not written to
    assert toks[0] == int(np.argmax(x[0])) and toks[2] == int(np.argmax(x[2]))
    assert toks[1] == int(np.argmax(np.where(allowed[1], x[1], -np.inf)))


@pytest.mark.parametrize("bias", [100.0, -100.0])
def test_logit_bias_forces_and_bans(bias):
    """+100 on one token: every draw is that token; -100 on the most likely token: never drawn."""
    tok = 6 if bias > 0 else 0
    counts = draw_counts(SamplingParams(temperature=1.5, logit_bias={tok: bias}))
    if bias > 0:
        assert counts[tok] == N
    else:
        assert counts[tok] == 0 and (counts > 0).sum() == LOGITS.size - 1


def run_one(loaded, p: SamplingParams) -> list[int]:
    engine = LLMEngine(loaded, EngineConfig.of(num_blocks=64))
    rid = engine.add_request("The KV cache stores", p)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done[rid].outputs[0].token_ids


def test_logit_bias_in_the_engine(tiny_loaded):
    """+100 makes every generated token that token; -100 on each token the unbiased run drew bans them."""
    p = dict(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    free = run_one(tiny_loaded, SamplingParams(**p))
    assert run_one(tiny_loaded, SamplingParams(**p, logit_bias={37: 100.0})) == [37] * 24
    banned = set(free)
    got = run_one(tiny_loaded, SamplingParams(**p, logit_bias={t: -100.0 for t in banned}))
    assert len(got) == 24 and not banned & set(got)


def test_kept_penalty_counts_follow_the_history():
    """A sample's counts kept from call to call (`PenaltyCounts`: a history of `KEEP_FROM` tokens
    or more) take only the tokens appended since; a shorter history (tokens taken back) starts
    them over: each result is numpy's."""
    rng = np.random.default_rng(0)
    p = SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4)
    prompt, kept = [t % 50 for t in range(KEEP_FROM)], PenaltyCounts()  # tokens 50-63 only in outputs
    pending = mx.array([61, 62])  # a step's still lazy tokens: row 1 is this sample's pending one
    for out in ([], [55], [55, 57, 55, 5], [55, 57, 55, 5, 59], [55, 58]):
        for pend, counted in ((None, out), ((pending, 1), out + [62])):
            logits = rng.normal(size=64).astype(np.float32)
            history = TokenHistory(prompt + out, len(prompt), pend, kept)
            got = apply_penalties(mx.array(logits[None]), [p], [history])
            np.testing.assert_allclose(np.array(got[0]), ref_process(logits, p, prompt, counted), rtol=1e-5, atol=1e-5)
            assert kept.counted == len(out)  # the pending token is counted for its step only


def reference_tokens(model, prompt: list[int], p: SamplingParams, num: int) -> list[int]:
    """mlx-lm's model and contiguous cache, the numpy penalties and the reference draw."""
    cache = make_prompt_cache(model)
    key = None if p.greedy else mx.array(np.array(sample_key(p.seed, 0)))
    out, x = [], mx.array([prompt])
    for _ in range(num):
        logits = np.array(model(x, cache=cache)[0, -1].astype(mx.float32))
        z = mx.array(ref_process(logits, p, prompt, out).astype(np.float32))
        tok, key = ref_draw(z, p, key)
        out.append(tok)
        x = mx.array([[tok]])
    return out


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_penalties_match_contiguous_reference(tiny_loaded, mlx_lm_tiny, async_scheduling):
    """Greedy and sampled requests with penalties and biases, several in one batch: each one's tokens
    are the reference's (so the penalties count the pending token, which is on the device)."""
    model, tok = mlx_lm_tiny
    prompts = [tok.encode(t) for t in ("The KV cache stores", "Paged attention borrows", "0123456789", "Write a")]
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, frequency_penalty=1.2, presence_penalty=0.8, max_tokens=20, ignore_eos=True),
        SamplingParams(
            temperature=0.8, seed=4, frequency_penalty=0.6, logit_bias={10: 2.0}, max_tokens=20, ignore_eos=True
        ),
        SamplingParams(
            temperature=1.2,
            seed=8,
            top_k=30,
            repetition_penalty=0.7,
            presence_penalty=-0.5,
            max_tokens=20,
            ignore_eos=True,
        ),
    ]
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=64, async_scheduling=async_scheduling))
    ids = [engine.add_request(pr, p) for pr, p in zip(prompts, params)]
    done = run_all(engine)
    for rid, pr, p in zip(ids, prompts, params):
        assert done[rid].outputs[0].token_ids == reference_tokens(model, pr, p, 20), rid
    # the penalties matter here: without them the greedy rows differ
    plain = reference_tokens(model, prompts[0], SamplingParams(temperature=0), 20)
    assert plain != done[ids[0]].outputs[0].token_ids


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_kept_penalty_counts_match_contiguous_reference(tiny_loaded, mlx_lm_tiny, async_scheduling):
    """Prompts of `KEEP_FROM` tokens and more with repetition_penalty: the rows keep their counts
    from step to step (only the new token is sent, the pending one joins in the graph), and each
    request's tokens are the reference's."""
    model, _ = mlx_lm_tiny
    prompts = [[(7 * j + k) % 40 + 1 for j in range(KEEP_FROM + 40 * k)] for k in range(3)]
    params = [
        SamplingParams(  # a logit bias beside the penalties
            temperature=0,
            repetition_penalty=1.6,
            frequency_penalty=2.0,
            logit_bias={60: 6.0},
            max_tokens=24,
            ignore_eos=True,
        ),
        SamplingParams(
            temperature=0.9, seed=3, repetition_penalty=0.8, frequency_penalty=1.5, max_tokens=24, ignore_eos=True
        ),
        SamplingParams(temperature=0, repetition_penalty=1.2, presence_penalty=2.0, max_tokens=24, ignore_eos=True),
    ]
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=256, async_scheduling=async_scheduling))
    ids = [engine.add_request(pr, p) for pr, p in zip(prompts, params)]
    done = run_all(engine)
    for rid, pr, p in zip(ids, prompts, params):
        assert done[rid].outputs[0].token_ids == reference_tokens(model, pr, p, 24), rid


def test_logit_bias_outside_vocabulary_is_refused(tiny_loaded):
    engine = LLMEngine(tiny_loaded, EngineConfig.of(num_blocks=16))
    with pytest.raises(MlxPagedError, match="logit_bias token id 384"):
        engine.add_request("x", SamplingParams(logit_bias={384: 1.0}))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(min_p=-0.1),
        dict(min_p=1.5),
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(repetition_penalty=0),
        dict(repetition_penalty=-1),
        dict(logit_bias={1: 101}),
        dict(logit_bias={-1: 1.0}),
        dict(logit_bias={"a": 1.0}),
        dict(logit_bias=[1]),
        dict(min_p=float("nan")),
        dict(guided={"json_object": True}),
    ],
)
def test_bad_knobs_are_rejected(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))) as e:
        SamplingParams(**kwargs)
    assert "\n" not in str(e.value)


def test_logit_bias_string_keys_become_ids():
    """JSON bodies carry token ids as strings (OpenAI's logit_bias)."""
    assert SamplingParams(logit_bias={"5": -100, 7: 1}).logit_bias == {5: -100.0, 7: 1.0}
