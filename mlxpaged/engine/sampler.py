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

from dataclasses import dataclass

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


def filter_rows(x: mx.array, top_k: mx.array, top_p: mx.array) -> mx.array:
    """Tempered logits `x [R, V]` (float32) with the tokens each row's top-k/top-p drop set to -inf.

    top_k `[R]` int32 (V keeps all), top_p `[R]` float32 (1 keeps all). One sort serves both.
    """
    neg_inf = mx.array(-mx.inf, dtype=mx.float32)
    desc = -mx.sort(-x, axis=-1)
    kth = mx.take_along_axis(desc, (top_k - 1)[:, None], axis=-1)  # [R, 1]
    x = mx.where(x >= kth, x, neg_inf)
    # top-p on the top-k survivors, renormalized over every kept token (ties at the k-th too)
    desc = mx.where(desc >= kth, desc, neg_inf)
    probs = mx.exp(desc - mx.logsumexp(x, axis=-1, keepdims=True))
    before = mx.cumsum(probs, axis=-1, inclusive=False)
    num_kept = mx.sum(before < top_p[:, None], axis=-1, keepdims=True)  # >= 1: nothing precedes the first
    pth = mx.take_along_axis(desc, num_kept - 1, axis=-1)
    pth = mx.where(top_p[:, None] < 1.0, pth, neg_inf)  # top_p = 1 drops nothing, rounding aside
    return mx.where(x >= pth, x, neg_inf)


def filter_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """Tempered logits `[V]` (float32) with the tokens top-k/top-p drop set to -inf."""
    x = logits.astype(mx.float32) / params.temperature
    if not params.needs_filter(x.shape[-1]):
        return x
    k = params.top_k if 0 < params.top_k < x.shape[-1] else x.shape[-1]
    return filter_rows(x[None], mx.array([k]), mx.array([params.top_p], dtype=mx.float32))[0]


def sample_token(logits: mx.array, params: SamplingParams, key: mx.array | None) -> tuple[mx.array, mx.array | None]:
    """Draw one token from `logits [V]`; returns (token as a 0-d array, the advanced key)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1), key
    key, sub = mx.random.split(key)
    return mx.random.categorical(filter_logits(logits, params), key=sub), key


_split_rows = mx.vmap(lambda k: mx.random.split(k))


def _draw_rows(x: mx.array, keys: mx.array) -> tuple[mx.array, mx.array]:
    """Each row's draw with its own key, as `sample_token` makes it: (tokens [R], next keys [R, 2])."""
    pairs = _split_rows(keys)  # [R, 2, 2]: (next key, sub-key) per row
    noise = mx.vmap(lambda k: mx.random.gumbel(x.shape[-1:], key=k))(pairs[:, 1])
    return mx.argmax(x + noise, axis=-1), pairs[:, 0]


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


def gather_rows(refs: list) -> mx.array:
    """Stack `refs` into one array; each is an array or `(array, row)`, a row of an earlier
    step's (maybe still lazy) output. Rows of one array in order cost one gather, or nothing."""
    first = refs[0]
    if isinstance(first, tuple) and all(isinstance(r, tuple) and r[0] is first[0] for r in refs):
        rows = [r[1] for r in refs]
        if rows == list(range(first[0].shape[0])):
            return first[0]
        return first[0][mx.array(rows)]
    return mx.stack([r[0][r[1]] if isinstance(r, tuple) else r for r in refs])


@dataclass
class SampleArrays:
    """One step's draws, still on the device: materialize them with `read_samples`.

    tokens `[R]` (every row); keys `[len(sampled), 2]`, the advanced keys of the non-greedy rows
    `sampled` in order; logprobs of rows `lp_rows` (chosen `[L]`, top ids and values `[L, top]`).
    """

    params: list[SamplingParams]
    tokens: mx.array
    sampled: list[int]
    keys: mx.array | None
    lp_rows: list[int]
    top: int
    chosen: mx.array | None = None
    top_ids: mx.array | None = None
    top_vals: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.tokens, self.keys, self.chosen, self.top_ids, self.top_vals) if a is not None]


def sample_arrays(logits: mx.array, params: list[SamplingParams], keys: list) -> SampleArrays:
    """Build (without evaluating) the draw of row `i` of `logits [B, V]` with `params[i]` and
    `keys[i]` (an array, `(array, row)` as for `gather_rows`, or None for greedy rows).

    Greedy rows share one argmax; sampled rows share one temperature division, one sort (only
    for the rows with top-k or top-p) and one vmapped split-and-draw over their keys; the
    logprobs of all rows come from one log-softmax and one argpartition.
    """
    toks = mx.argmax(logits, axis=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    drawn_keys = None
    if sampled:
        vocab = logits.shape[-1]
        idx = mx.array(sampled) if len(sampled) < len(params) else None
        temps = mx.array([params[i].temperature for i in sampled], dtype=mx.float32)
        x = (logits[idx] if idx is not None else logits).astype(mx.float32) / temps[:, None]
        filt = [j for j, i in enumerate(sampled) if params[i].needs_filter(vocab)]
        if filt:
            fidx = mx.array(filt)
            top_k = mx.array([params[sampled[j]].top_k if 0 < params[sampled[j]].top_k < vocab else vocab for j in filt])
            top_p = mx.array([params[sampled[j]].top_p for j in filt], dtype=mx.float32)
            x[fidx] = filter_rows(x[fidx], top_k, top_p)
        drawn, drawn_keys = _draw_rows(x, gather_rows([keys[i] for i in sampled]))
        if idx is None:
            toks = drawn.astype(toks.dtype)
        else:
            toks[idx] = drawn.astype(toks.dtype)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    top = min(max((params[i].logprobs for i in rows), default=0), logits.shape[-1])
    lp = _logprob_arrays(logits, toks, rows, top) if rows else (None, None, None)
    return SampleArrays(params, toks, sampled, drawn_keys, rows, top, *lp)


def read_samples(s: SampleArrays, *, key_slices: bool = True):
    """Wait for `s` and read it: (tokens: list[int], keys, logprobs: list[TokenLogprob | None]).

    `keys[i]` is row i's advanced key (None for greedy rows); without `key_slices` it is the
    index of that key in `s.keys` instead of a slice (the caller keeps a reference to `s.keys`).
    """
    token_list = s.tokens.tolist()
    new_keys: list = [None] * len(s.params)
    for j, i in enumerate(s.sampled):
        new_keys[i] = s.keys[j] if key_slices else j
    logprobs: list[TokenLogprob | None] = [None] * len(s.params)
    if s.lp_rows:
        chosen = s.chosen.tolist()
        ids = s.top_ids.tolist() if s.top else [[] for _ in s.lp_rows]
        vals = s.top_vals.tolist() if s.top else [[] for _ in s.lp_rows]
        for j, i in enumerate(s.lp_rows):
            # argpartition leaves the top unordered: best first, ties by lower id.
            best = sorted(zip(ids[j], vals[j]), key=lambda t: (-t[1], t[0]))[: s.params[i].logprobs]
            logprobs[i] = TokenLogprob(token_list[i], chosen[j], best)
    return token_list, new_keys, logprobs


def sample_batch(logits: mx.array, params: list[SamplingParams], keys: list[mx.array | None]):
    """Sample row `i` of `logits [B, V]` with `params[i]` and `keys[i]`, every row in one graph
    and one `eval`; `sample_arrays` then `read_samples`.

    Returns (tokens: list[int], the advanced keys, logprobs: list[TokenLogprob | None]) with
    one entry per row; a row's logprobs are None when its `params.logprobs` is None.
    """
    s = sample_arrays(logits, params, keys)
    mx.eval(*s.arrays())
    toks, new_keys, lps = read_samples(s)
    return toks, [k if k is not None else keys[i] for i, k in enumerate(new_keys)], lps
