"""Token sampling: vLLM's order of logits processors, one random stream per sample, logprobs.

Order (vLLM v1's `Sampler.forward`, as `SamplingParams` promises; mlx-lm applies top-p before
temperature). Every row of a step goes through it in one graph; a step in which no row asks
for a processor builds none of its arrays:
  0. logprobs, when asked for, are the log-softmax of the raw logits (vLLM's default);
  1. grammar mask: a constrained row's forbidden tokens become -inf (vLLM applies the
     structured-output bitmask before its sampler);
  2. logit_bias: added to the logits (vLLM's non-argmax-invariant processors);
  3. penalties, on the biased logits (vLLM's `apply_penalties`): repetition_penalty first, on
     the tokens of the prompt and the output (a positive logit divided by it, a negative one
     multiplied), then frequency_penalty times each token's count in the output and
     presence_penalty once per token present in the output are subtracted;
  4. temperature 0 is greedy: argmax of the logits after steps 1-3, nothing else; otherwise the
     logits are divided by the temperature;
  5. min_p: tokens whose probability is below min_p times the largest one's become -inf
     (vLLM's argmax-invariant processors, after the temperature);
  6. top-k: keep the tokens whose tempered logit is >= the k-th largest (ties at it are kept);
  7. top-p: on the tempered, top-k-renormalized distribution, keep the most probable tokens
     whose mass before them (in descending order) is < top_p, i.e. the smallest prefix reaching
     top_p; tokens tied with the last kept one are kept too;
  8. draw: argmax(filtered + Gumbel noise of the sub-key), which is `mx.random.categorical`.
The "output" of step 3 includes a sample's pending token (the one the previous, overlapped
step drew and nobody has read back): its value joins the counts inside the graph.

Streams: sample `i` of a request seeded `s` starts from `sample_key(s, i)`, the Threefry-2x32
(20 rounds, MLX's own PRNG) encryption of the counter (0, i) under the seed's key
`mx.random.key(s)` (the construction of JAX's `fold_in`). For one seed the cipher permutes
counters, so distinct indices never share a starting key; distinct seeds are distinct ciphers.
Every draw splits the key: `key, sub = mx.random.split(key)`; the token is drawn with `sub`
and `key` is kept. A sample's tokens therefore depend only on its (seed, index) and its
logits, never on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..worker.model_runner import gather_rows
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


class PenaltyCounts:
    """A sample's token counts for its penalties, kept on the device from one step to the next, so
    a step sends only the tokens appended since the last one: sending the whole history again is
    O(context) host work a step (a 30K-token agent prompt, with repetition_penalty).

    Invariant: `counts [V]` float32 counts the first `counted` output tokens of the sample; `prompt
    [V]` bool marks the prompt's tokens, made at the first step that needs it. A history shorter
    than `counted` (tokens taken back) starts the counts over. The engine keeps one per sample
    with penalties (`Sequence.penalties`); only `apply_penalties` writes it.
    """

    __slots__ = ("counted", "counts", "prompt")

    def __init__(self):
        self.counted = 0
        self.counts: mx.array | None = None
        self.prompt: mx.array | None = None


@dataclass
class TokenHistory:
    """A row's tokens, for its penalties: the prompt and the known generated ids (`token_ids`,
    the first `num_prompt_tokens` of them the prompt) and the pending token, a row `(array, row)`
    of an earlier step's still lazy tokens, or None; `counts`, the sample's kept counts (None:
    counted from the whole history this once)."""

    token_ids: list[int]
    num_prompt_tokens: int
    pending: tuple | None = None
    counts: PenaltyCounts | None = None


@dataclass
class GuideMasks:
    """The grammar masks of a step's constrained rows: row `rows[j]` may draw token t only if bit
    `t % 32` of `bits[j, t // 32]` is set (int32 `[len(rows), ceil(V / 32)]`, filled on the CPU)."""

    rows: list[int]
    bits: np.ndarray


def unpack_bitmask(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """Bool `[R, vocab_size]`: token t allowed iff bit `t % 32` of `bits[:, t // 32]` (int32) is set.

    Unpacked on the CPU (little-endian words: byte `4w + b // 8`, bit `b % 8`), so the graph
    applies it with one `where`."""
    return np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].view(
        bool
    )


KEEP_FROM = 1024  # tokens a row's counts cover from which it keeps them (below, its own arrays cost more)


def apply_penalties(x: mx.array, params: list[SamplingParams], histories: list[TokenHistory]) -> mx.array:
    """vLLM's penalties on `x [R, V]` (float32), row `i` with `params[i]` over `histories[i]`.

    A row whose counts cover fewer than `KEEP_FROM` tokens is counted from its history this step
    (one scatter for all such rows); a longer one with `PenaltyCounts` starts from its kept
    counts and takes only the tokens appended since (its history is O(context) to send again,
    its own `[V]` arrays a few operations). The pending token joins the counts inside the graph.
    """
    r, v = x.shape
    rows, toks, prompt_rows, prompt_toks = [], [], [], []  # the rows counted from their histories
    kept, kept_at, new_rows, new_toks = [], [], [], []  # the rows that keep their counts
    pend_rows, pend_refs = [], []
    for i, (p, h) in enumerate(zip(params, histories)):
        rep = p.repetition_penalty != 1.0
        gen = len(h.token_ids) - h.num_prompt_tokens
        c = h.counts
        if c is None or (len(h.token_ids) if rep else gen) < KEEP_FROM:
            out = h.token_ids[h.num_prompt_tokens :]
            rows += [i] * len(out)
            toks += out
            if rep:
                prompt_rows += [i] * h.num_prompt_tokens
                prompt_toks += h.token_ids[: h.num_prompt_tokens]
        else:
            if c.counts is None or c.counted > gen or c.counts.shape[0] != v:  # (another width: a stand-in forward's)
                c.counts, c.counted, c.prompt = mx.zeros((v,), dtype=mx.float32), 0, None
            if rep and c.prompt is None:
                ids = mx.array(np.array(h.token_ids[: h.num_prompt_tokens], dtype=np.int32))
                c.prompt = mx.zeros((v,), dtype=mx.float32).at[ids].add(1.0) > 0
            if gen > c.counted:  # the tokens appended since: usually the one read back since the last step
                new = h.token_ids[h.num_prompt_tokens + c.counted :]
                new_rows += [len(kept)] * len(new)
                new_toks += new
                c.counted = gen
            kept.append(c)
            kept_at.append(i)
        if h.pending is not None:
            pend_rows.append(i)
            pend_refs.append(h.pending)
    counts = mx.zeros((r, v), dtype=mx.float32)
    if rows:
        counts = counts.at[_ints(rows), _ints(toks)].add(1.0)
    prompt = (
        mx.zeros((r, v), dtype=mx.float32).at[_ints(prompt_rows), _ints(prompt_toks)].add(1.0) > 0
        if prompt_rows
        else None
    )
    if kept:
        own = mx.stack([c.counts for c in kept])  # [K, V]
        if new_rows:
            own = own.at[_ints(new_rows), _ints(new_toks)].add(1.0)
            for k, c in enumerate(kept):
                c.counts = own[k]
        at = _ints(kept_at)
        counts[at] = own
        if any(c.prompt is not None for c in kept):
            no = mx.zeros((v,), dtype=mx.bool_)
            prompt = mx.zeros((r, v), dtype=mx.bool_) if prompt is None else prompt
            prompt[at] = mx.stack([c.prompt if c.prompt is not None else no for c in kept])
    if pend_rows:  # the pending token counts for this step only: its value is not known yet
        counts = counts.at[_ints(pend_rows), gather_rows(pend_refs).astype(mx.int32)].add(1.0)
    seen = counts > 0 if prompt is None else (counts > 0) | prompt
    rep = mx.array([p.repetition_penalty for p in params], dtype=mx.float32)[:, None]
    rep = mx.where(seen, rep, 1.0)
    x = mx.where(x > 0, x / rep, x * rep)
    freq = mx.array([p.frequency_penalty for p in params], dtype=mx.float32)[:, None]
    pres = mx.array([p.presence_penalty for p in params], dtype=mx.float32)[:, None]
    return x - freq * counts - pres * (counts > 0)


def _ints(xs: list[int]) -> mx.array:
    return mx.array(np.array(xs, dtype=np.int32))


def apply_min_p(x: mx.array, min_p: mx.array) -> mx.array:
    """Tempered `x [R, V]` with the tokens of probability < min_p * the row's largest set to -inf
    (in log space: x < max(x) + log(min_p)); min_p `[R]` float32, > 0."""
    cut = mx.max(x, axis=-1, keepdims=True) + mx.log(min_p)[:, None]
    return mx.where(x >= cut, x, mx.array(-mx.inf, dtype=x.dtype))


class RowKinds(NamedTuple):
    """Indices of the rows with a logit bias, with penalties, that draw (not greedy), that want logprobs."""

    bias: list[int]
    penalties: list[int]
    drawn: list[int]
    logprobs: list[int]


def row_kinds(params: list[SamplingParams]) -> RowKinds:
    """Each row's kinds in one pass over the rows (each step's host time)."""
    bias, pen, drawn, lp = [], [], [], []
    for i, p in enumerate(params):
        if p.logit_bias:
            bias.append(i)
        if p.has_penalties:
            pen.append(i)
        if not p.greedy:
            drawn.append(i)
        if p.logprobs is not None:
            lp.append(i)
    return RowKinds(bias, pen, drawn, lp)


def process_logits(
    logits: mx.array,
    params: list[SamplingParams],
    masks: GuideMasks | None,
    histories: list | None,
    kinds: RowKinds | None = None,
) -> mx.array:
    """Steps 1-3 of the module's order on `logits [B, V]`; `logits` itself when no row needs any.
    `kinds`: `row_kinds(params)`, if the caller has it."""
    kinds = kinds or row_kinds(params)
    bias_rows, pen_rows = kinds.bias, kinds.penalties
    if masks is None and not bias_rows and not pen_rows:
        return logits
    x = logits
    b, v = x.shape
    if masks is not None and masks.rows:
        allowed = mx.array(unpack_bitmask(masks.bits, v))
        neg_inf = mx.array(-mx.inf, dtype=x.dtype)
        if masks.rows == list(range(b)):  # every row constrained: no gather, no scatter
            x = mx.where(allowed, x, neg_inf)
        else:
            idx = mx.array(masks.rows)
            x = mx.array(x)  # a new array: `logits` itself stays as it is (logprobs read it)
            x[idx] = mx.where(allowed, x[idx], neg_inf)
    if bias_rows or pen_rows:
        x = x.astype(mx.float32)
    if bias_rows:
        rows, toks, vals = [], [], []
        for i in bias_rows:
            for t, val in params[i].logit_bias.items():
                rows.append(i)
                toks.append(t)
                vals.append(val)
        x = x + mx.zeros((b, v), dtype=mx.float32).at[mx.array(rows), mx.array(toks)].add(
            mx.array(vals, dtype=mx.float32)
        )
    if pen_rows:
        if histories is None or any(histories[i] is None for i in pen_rows):
            raise ValueError("rows with penalties need their token histories")
        idx = mx.array(pen_rows)
        x[idx] = apply_penalties(x[idx], [params[i] for i in pen_rows], [histories[i] for i in pen_rows])
    return x


_split_rows = mx.vmap(lambda k: mx.random.split(k))


def _draw_rows(x: mx.array, keys: mx.array) -> tuple[mx.array, mx.array]:
    """Each row's draw with its own key, as `sample_token` makes it: (tokens [R], next keys [R, 2])."""
    pairs = _split_rows(keys)  # [R, 2, 2]: (next key, sub-key) per row
    noise = mx.vmap(lambda k: mx.random.gumbel(x.shape[-1:], key=k))(pairs[:, 1])
    return mx.argmax(x + noise, axis=-1), pairs[:, 0]


def logprob_arrays(x: mx.array, tokens: mx.array, top: int):
    """Log-softmax of `x [R, V]` in float32: (`tokens [R]`'s logprobs [R], top ids [R, top] and their
    logprobs, unordered; None, None for top 0). The prompt's logprobs use it too (prompt_logprobs.py)."""
    x = x.astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    if top == 0:
        return chosen, None, None
    ids = mx.argpartition(-lp, kth=top - 1, axis=-1)[:, :top]
    return chosen, ids, mx.take_along_axis(lp, ids, axis=-1)


def best_first(ids: list[int], vals: list[float]) -> list[tuple[int, float]]:
    """A read-back top (argpartition leaves it unordered): best first, ties by lower id."""
    return sorted(zip(ids, vals), key=lambda t: (-t[1], t[0]))


def _logprob_arrays(logits: mx.array, tokens: mx.array, rows: list[int], top: int):
    """`logprob_arrays` of `logits[rows]` for the chosen `tokens[rows]`."""
    idx = mx.array(rows)
    return logprob_arrays(logits[idx], tokens[idx], top)


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
        out = [self.tokens]
        for a in (self.keys, self.chosen, self.top_ids, self.top_vals):  # (a loop: no comprehension's call)
            if a is not None:
                out.append(a)
        return out


def sample_arrays(
    logits: mx.array,
    params: list[SamplingParams],
    keys: list,
    *,
    masks: GuideMasks | None = None,
    histories: list | None = None,
    kinds: RowKinds | None = None,
) -> SampleArrays:
    """Build (without evaluating) the draw of row `i` of `logits [B, V]` with `params[i]` and
    `keys[i]` (an array, `(array, row)` as for `gather_rows`, or None for greedy rows), in the
    module's order. `masks`: the grammar masks of the constrained rows; `histories[i]`: a
    `TokenHistory` for every row with penalties; `kinds`: `row_kinds(params)`, if the caller has it.

    Masks, biases and penalties change only the rows that ask for them (none: no array);
    greedy rows share one argmax; sampled rows share one temperature division, one min-p cut
    (only the rows with min_p), one sort (only for the rows with top-k or top-p) and one
    vmapped split-and-draw over their keys; the logprobs of all rows come from one
    log-softmax and one argpartition.
    """
    kinds = kinds or row_kinds(params)
    if masks is None and not kinds.bias and not kinds.penalties:
        x_all = logits  # (the usual step: nothing to process, no call)
    else:
        x_all = process_logits(logits, params, masks, histories, kinds)
    toks = mx.argmax(x_all, axis=-1)
    sampled, rows = kinds.drawn, kinds.logprobs
    drawn_keys = None
    if sampled:
        vocab = logits.shape[-1]
        idx = mx.array(sampled) if len(sampled) < len(params) else None
        temps = mx.array([params[i].temperature for i in sampled], dtype=mx.float32)
        x = (x_all[idx] if idx is not None else x_all).astype(mx.float32) / temps[:, None]
        minp = [j for j, i in enumerate(sampled) if params[i].min_p > 0]
        if minp:
            midx = mx.array(minp)
            x[midx] = apply_min_p(x[midx], mx.array([params[sampled[j]].min_p for j in minp], dtype=mx.float32))
        filt = [j for j, i in enumerate(sampled) if params[i].needs_filter(vocab)]
        if filt:
            fidx = mx.array(filt)
            top_k = mx.array(
                [params[sampled[j]].top_k if 0 < params[sampled[j]].top_k < vocab else vocab for j in filt]
            )
            top_p = mx.array([params[sampled[j]].top_p for j in filt], dtype=mx.float32)
            x[fidx] = filter_rows(x[fidx], top_k, top_p)
        drawn, drawn_keys = _draw_rows(x, gather_rows([keys[i] for i in sampled]))
        if idx is None:
            toks = drawn.astype(toks.dtype)
        else:
            toks[idx] = drawn.astype(toks.dtype)
    top = min(max(params[i].logprobs for i in rows), logits.shape[-1]) if rows else 0
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
            best = best_first(ids[j], vals[j])[: s.params[i].logprobs]
            logprobs[i] = TokenLogprob(token_list[i], chosen[j], best)
    return token_list, new_keys, logprobs


def sample_batch(
    logits: mx.array,
    params: list[SamplingParams],
    keys: list[mx.array | None],
    *,
    masks: GuideMasks | None = None,
    histories: list | None = None,
):
    """Sample row `i` of `logits [B, V]` with `params[i]` and `keys[i]`, every row in one graph
    and one `eval`; `sample_arrays` then `read_samples`.

    Returns (tokens: list[int], the advanced keys, logprobs: list[TokenLogprob | None]) with
    one entry per row; a row's logprobs are None when its `params.logprobs` is None.
    """
    s = sample_arrays(logits, params, keys, masks=masks, histories=histories)
    mx.eval(*s.arrays())
    toks, new_keys, lps = read_samples(s)
    return toks, [k if k is not None else keys[i] for i, k in enumerate(new_keys)], lps
