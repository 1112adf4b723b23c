"""The sampler against exact distributions and an independent numpy reference (tests/reference.py).

Chi-square tests accept at p > 0.001; each also shows it rejects the wrong hypothesis (the other
filter order, or the old `seed + i` streams), so passing means something.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxpaged.engine.outputs import CompletionOutput, TokenLogprob
from mlxpaged.engine.sampler import filter_logits, sample_batch, sample_key, sample_token
from mlxpaged.engine.sampling_params import SamplingParams

from chi_square import (  # noqa: E402
    ALPHA,
    LOGITS,
    chi2_sf,  # noqa: E402
    gof_pvalue,
)
from reference import filters_first_probs, ref_draw, ref_sample_keys, threefry2x32, vllm_keep_mask, vllm_probs


def pair_pvalue(a: np.ndarray, b: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square test that token pairs (a, b) are independent draws from `probs` each."""
    v = probs.size
    counts = np.bincount(a * v + b, minlength=v * v)
    return gof_pvalue(counts, np.outer(probs, probs))


def draw(keys: mx.array, params: SamplingParams, steps: int = 1) -> np.ndarray:
    """`steps` successive tokens of `sample_token` on LOGITS for every key, vectorized over keys."""
    logits = mx.array(LOGITS)

    def run(key):
        toks = []
        for _ in range(steps):
            tok, key = sample_token(logits, params, key)
            toks.append(tok)
        return mx.stack(toks)

    return np.array(mx.vmap(run)(keys))  # [num_keys, steps]


def stream_keys(seeds, num_samples: int) -> mx.array:
    return mx.stack([sample_key(s, i) for s in seeds for i in range(num_samples)])


def test_chi2_sf_matches_tables():
    # Critical values at p = 0.001 from standard chi-square tables.
    for df, crit in [(1, 10.828), (2, 13.816), (3, 16.266), (4, 18.467), (5, 20.515), (10, 29.588), (24, 51.179)]:
        assert abs(chi2_sf(crit, df) - 1e-3) < 2e-6, df


def test_threefry_reference_is_mlx_prng():
    """The numpy Threefry gives Random123's known answers and MLX's own `split`."""
    kat = [
        ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
        ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
        ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
    ]
    for key, ctr, want in kat:
        y0, y1 = threefry2x32(key, [ctr[0]], [ctr[1]])
        assert (int(y0[0]), int(y1[0])) == want
    for seed in (0, 7, 2**40 + 3):
        n = 5  # split(key, n) encrypts the counters (j, j + n), j < n, and lays out [y0..., y1...]
        y0, y1 = threefry2x32((seed >> 32, seed & 0xFFFFFFFF), np.arange(n), np.arange(n, 2 * n))
        assert np.array(mx.random.split(mx.random.key(seed), n)).ravel().tolist() == [*y0.tolist(), *y1.tolist()]


def test_sample_key_is_the_documented_rule():
    seeds = [0, 1, 100, 2**31 - 1, 2**32 + 5, 2**64 - 1]
    for s in seeds:
        idx = [0, 1, 2, 249, 65535, 2**32 - 1]
        assert np.array(mx.stack([sample_key(s, i) for i in idx])).tolist() == ref_sample_keys(s, idx).tolist()
    assert sample_key(3, 4).dtype == mx.uint32 and sample_key(3, 4).shape == (2,)
    with pytest.raises(ValueError):
        sample_key(-1, 0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(2.0, 7, 0.7), (0.5, 0, 0.8), (2.5, 4, 0.8)])
def test_vllm_order_matches_exact_distribution(temperature, top_k, top_p):
    """20,000 draws fit vLLM's order (temperature, then top-k, then top-p) and reject the other."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = vllm_probs(LOGITS, temperature, top_k, top_p)
    other = filters_first_probs(LOGITS, temperature, top_k, top_p)
    assert 0.5 * np.abs(ours - other).sum() > 0.05  # the two orders really differ here
    toks = draw(stream_keys(range(8), 2500), params)[:, 0]
    counts = np.bincount(toks, minlength=LOGITS.size)
    assert gof_pvalue(counts, ours) > ALPHA
    assert gof_pvalue(counts, other) < 1e-9


def test_eight_requests_streams_are_distinct_and_independent():
    """Seeds 100..107, 2,500 samples each: all keys differ, and overlapping `seed + i` pairs
    (sample i + 1 of seed s against sample i of seed s + 1) are independent draws."""
    params = SamplingParams(temperature=2.0, top_k=7, top_p=0.7)
    probs = vllm_probs(LOGITS, 2.0, 7, 0.7)
    seeds, n = range(100, 108), 2500
    keys = stream_keys(seeds, n)
    assert len({tuple(k) for k in np.array(keys).tolist()}) == len(seeds) * n
    toks = draw(keys, params, steps=2).reshape(len(seeds), n, 2)
    first = toks[..., 0]
    assert gof_pvalue(np.bincount(first.ravel(), minlength=LOGITS.size), probs) > ALPHA
    assert gof_pvalue(np.bincount(toks[..., 1].ravel(), minlength=LOGITS.size), probs) > ALPHA
    assert pair_pvalue(first[:-1, 1:].ravel(), first[1:, :-1].ravel(), probs) > ALPHA  # across requests
    assert pair_pvalue(first[:, :-1].ravel(), first[:, 1:].ravel(), probs) > ALPHA  # samples of one request
    assert pair_pvalue(toks[..., 0].ravel(), toks[..., 1].ravel(), probs) > ALPHA  # steps of one stream
    # The old rule (sample i seeded seed + i) fails the same test: those pairs are the same stream.
    old = draw(mx.stack([mx.random.key(s + i) for s in seeds for i in range(n)]), params)[:, 0].reshape(len(seeds), n)
    assert pair_pvalue(old[:-1, 1:].ravel(), old[1:, :-1].ravel(), probs) < 1e-9


def test_same_seed_same_tokens_whatever_the_batch():
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(4, 500)).astype(np.float32) * 3)
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    alone, _, _ = sample_batch(logits[:1], [p], [sample_key(5, 2)])
    q = SamplingParams(temperature=1.2, top_k=20)
    mixed, _, _ = sample_batch(
        logits[[1, 0, 2]], [q, p, SamplingParams(temperature=0)], [sample_key(9, 0), sample_key(5, 2), None]
    )
    assert mixed[1] == alone[0]
    seq = [draw(mx.stack([sample_key(5, 2)] * 2), p, steps=30)[i].tolist() for i in range(2)]
    assert seq[0] == seq[1] and len(set(seq[0])) > 1


def test_sample_batch_matches_numpy_reference():
    """Every row, over several steps, draws the reference's token and advances its key the same way."""
    rng = np.random.default_rng(1)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=50),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=40, top_p=0.8),
        SamplingParams(temperature=0.5, top_k=-1),
        SamplingParams(temperature=2.0, top_p=0.5, logprobs=3),
    ]
    keys = [None if p.greedy else sample_key(42, i) for i, p in enumerate(params)]
    ref_keys = [None if p.greedy else mx.array(ref_sample_keys(42, [i])[0]) for i, p in enumerate(params)]
    for _ in range(5):
        logits = mx.array(rng.normal(size=(len(params), 2000)).astype(np.float32) * 4)
        toks, keys, _ = sample_batch(logits, params, keys)
        for i, p in enumerate(params):
            want, ref_keys[i] = ref_draw(logits[i], p, ref_keys[i])
            assert toks[i] == want, i
            assert (keys[i] is None) == p.greedy and (p.greedy or mx.array_equal(keys[i], ref_keys[i]))


def test_filter_keeps_ties_like_the_reference():
    """Coarse (bfloat16-like) logits have ties at the top-k and top-p cut-offs; all ties are kept."""
    rng = np.random.default_rng(2)
    tied = np.array([3.0, 2.0, 2.0, 2.0, 1.0, 0.0], dtype=np.float32)
    kept = np.isfinite(np.array(filter_logits(mx.array(tied), SamplingParams(temperature=1.0, top_k=2))))
    assert kept.tolist() == [True, True, True, True, False, False]
    for case in range(20):
        x = np.round(rng.normal(size=300) * 4) / 2  # many ties
        p = SamplingParams(
            temperature=float(rng.choice([0.6, 1.0, 1.7])),
            top_k=int(rng.choice([0, 5, 30])),
            top_p=float(rng.choice([1.0, 0.5, 0.9])),
        )
        got = np.isfinite(np.array(filter_logits(mx.array(x.astype(np.float32)), p)))
        want = vllm_keep_mask(x.astype(np.float32) / np.float32(p.temperature), p.top_k, p.top_p)
        assert (got == want).all(), case


def test_logprobs_match_numpy_log_softmax():
    """Raw log-softmax (before temperature and filters): the chosen token and the top k, best first."""
    rng = np.random.default_rng(3)
    logits_np = rng.normal(size=(6, 3000)).astype(np.float32) * 3
    params = [
        SamplingParams(temperature=0.7, top_k=10, logprobs=5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=1.5, top_p=0.9, logprobs=20),
        SamplingParams(temperature=0, logprobs=1),
        SamplingParams(temperature=0.3, logprobs=2),
    ]
    keys = [None if p.greedy else sample_key(7, i) for i, p in enumerate(params)]
    toks, _, lps = sample_batch(mx.array(logits_np), params, keys)
    x = logits_np.astype(np.float64)
    ref = x - x.max(-1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
    for i, (p, lp) in enumerate(zip(params, lps)):
        if p.logprobs is None:
            assert lp is None
            continue
        assert isinstance(lp, TokenLogprob) and lp.token_id == toks[i]
        assert abs(lp.logprob - ref[i, toks[i]]) < 1e-4
        best = np.argsort(-ref[i])[: p.logprobs]
        assert [t for t, _ in lp.top_logprobs] == best.tolist()
        assert np.allclose([v for _, v in lp.top_logprobs], ref[i, best], atol=1e-4)
    assert lps[2].top_logprobs == [] and lps[4].top_logprobs[0][0] == toks[4]  # greedy picks the best


def test_completion_output_logprobs_default_none():
    c = CompletionOutput(0, "a", [1], "stop")
    assert c.logprobs is None


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(logprobs=-1),
        dict(logprobs=21),
        dict(logprobs=2.5),
        dict(logprobs=True),
        dict(seed=-1),
        dict(seed=2**64),
        dict(seed=1.5),
    ],
)
def test_bad_sampling_params_are_rejected(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)
