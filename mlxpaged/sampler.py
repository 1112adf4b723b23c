"""Token sampling: vLLM's order of filters, one random stream per sample, logprobs.

Order (vLLM's, as `SamplingParams` promises; mlx-lm applies top-p before temperature):
  1. divide the logits by the temperature (temperature 0 is greedy: argmax, nothing else);
  2. top-k: keep the tokens whose tempered logit is >= the k-th largest (ties at it are kept);
  3. top-p: on the tempered, top-k-renormalized distribution, keep the most probable tokens
     whose mass before them (in descending order) is < top_p, i.e. the smallest prefix reaching
     top_p; tokens tied with the last kept one are kept too;
  4. draw: argmax(filtered + Gumbel noise of the sub-key), which is `mx.random.categorical`.

Streams: sample `i` of a request seeded `s` starts from `sample_key(s, i)`, the Threefry-2x32
(20 rounds, MLX's own PRNG) encryption of the counter (0, i) under the seed's key
`mx.random.key(s)` (the construction of JAX's `fold_in`). For one seed the cipher permutes
counters, so distinct indices never share a starting key; distinct seeds are distinct ciphers.
Every draw splits the key: `key, sub = mx.random.split(key)`; the token is drawn with `sub`
and `key` is kept. A sample's tokens therefore depend only on its (seed, index) and its
logits, never on what else shares the batch.

Logprobs are the log-softmax of the raw logits, before temperature, top-k and top-p (vLLM's
default), for the rows whose `params.logprobs` is not None.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .outputs import TokenLogprob
from .sampling_params import SamplingParams

_M32 = 0xFFFFFFFF
_ROT = (13, 15, 26, 6, 17, 29, 16, 24)


def _threefry2x32(k0: int, k1: int, c0: int, c1: int) -> tuple[int, int]:
    """Threefry-2x32-20 of counter (c0, c1) under key (k0, k1) (Salmon et al., Random123)."""
    ks = (k0, k1, 0x1BD11BDA ^ k0 ^ k1)
    x0, x1 = (c0 + ks[0]) & _M32, (c1 + ks[1]) & _M32
    for r in range(20):
        x0 = (x0 + x1) & _M32
        x1 = ((x1 << _ROT[r % 8]) | (x1 >> (32 - _ROT[r % 8]))) & _M32
        x1 ^= x0
        if r % 4 == 3:
            s = r // 4 + 1
            x0 = (x0 + ks[s % 3]) & _M32
            x1 = (x1 + ks[(s + 1) % 3] + s) & _M32
    return x0, x1


def sample_key(seed: int, sample_index: int) -> mx.array:
    """The starting key (uint32 [2]) of sample `sample_index` of a request seeded `seed`.

    Equal to Threefry-2x32(key=mx.random.key(seed), counter=(0, sample_index)); requires
    0 <= seed < 2**64 and 0 <= sample_index < 2**32.
    """
    seed, sample_index = int(seed), int(sample_index)
    if not (0 <= seed < 2**64 and 0 <= sample_index < 2**32):
        raise ValueError(f"seed must be in [0, 2**64) and sample index in [0, 2**32), got {seed}, {sample_index}")
    y = _threefry2x32(seed >> 32, seed & _M32, 0, sample_index)
    return mx.array(np.array(y, dtype=np.uint32))


def filter_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """Tempered logits `[V]` (float32) with the tokens top-k/top-p drop set to -inf."""
    x = logits.astype(mx.float32) / params.temperature
    vocab = x.shape[-1]
    neg_inf = mx.array(-mx.inf, dtype=mx.float32)
    cand = x
    if 0 < params.top_k < vocab:
        cand = mx.topk(x, params.top_k)  # only these can survive top-p
        x = mx.where(x >= mx.min(cand), x, neg_inf)
    if params.top_p < 1.0:
        desc = -mx.sort(-cand)
        # Normalize over every kept token (ties beyond the k-th included), not just `cand`.
        probs = mx.exp(desc - mx.logsumexp(x))
        before = mx.cumsum(probs, inclusive=False)
        num_kept = mx.sum(before < params.top_p)  # >= 1: nothing comes before the first
        x = mx.where(x >= mx.take(desc, num_kept - 1), x, neg_inf)
    return x


def sample_token(logits: mx.array, params: SamplingParams, key: mx.array | None) -> tuple[mx.array, mx.array | None]:
    """Draw one token from `logits [V]`; returns (token as a 0-d array, the advanced key)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1), key
    key, sub = mx.random.split(key)
    return mx.random.categorical(filter_logits(logits, params), key=sub), key


def _logprob_arrays(logits: mx.array, tokens: mx.array, rows: list[int], top: int):
    """Log-softmax of `logits[rows]`: (chosen token's logprob [R], top ids [R, top], their logprobs)."""
    idx = mx.array(rows)
    x = logits[idx].astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens[idx][:, None], axis=-1)[:, 0]
    if top == 0:
        return chosen, None, None
    ids = mx.argpartition(-lp, kth=top - 1, axis=-1)[:, :top]
    return chosen, ids, mx.take_along_axis(lp, ids, axis=-1)


def sample_batch(logits: mx.array, params: list[SamplingParams], keys: list[mx.array | None]):
    """Sample row `i` of `logits [B, V]` with `params[i]` and `keys[i]`.

    Returns (tokens: list[int], the advanced keys, logprobs: list[TokenLogprob | None]) with
    one entry per row; a row's logprobs are None when its `params.logprobs` is None. Greedy
    rows share one argmax; the logprobs of all rows come from one log-softmax and one
    argpartition, evaluated with the tokens.
    """
    greedy = mx.argmax(logits, axis=-1)
    out, new_keys = [], []
    for i, (p, k) in enumerate(zip(params, keys)):
        if p.greedy:
            out.append(greedy[i])
            new_keys.append(k)
        else:
            tok, k = sample_token(logits[i], p, k)
            out.append(tok)
            new_keys.append(k)
    toks = mx.stack(out) if out else greedy
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    top = min(max((params[i].logprobs for i in rows), default=0), logits.shape[-1])
    lp = _logprob_arrays(logits, toks, rows, top) if rows else ()
    mx.eval(toks, *[k for k in new_keys if k is not None], *[a for a in lp if a is not None])
    token_list = toks.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    if rows:
        chosen = lp[0].tolist()
        ids = lp[1].tolist() if top else [[] for _ in rows]
        vals = lp[2].tolist() if top else [[] for _ in rows]
        for j, i in enumerate(rows):
            # argpartition leaves the top unordered: best first, ties by lower id.
            best = sorted(zip(ids[j], vals[j]), key=lambda t: (-t[1], t[0]))[: params[i].logprobs]
            logprobs[i] = TokenLogprob(token_list[i], chosen[j], best)
    return token_list, new_keys, logprobs
