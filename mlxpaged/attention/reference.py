"""Paged attention in pure MLX ops: the reference every kernel is checked against.

Decode reads each sequence's blocks where they lie when its table is made of long runs of
consecutive block ids (the allocator extends a sequence's run where it can, core/block_pool.py):
a run of n blocks is the slice `pool[first:first + n]`, a view `[n, num_kv_heads, block_size,
head_dim]`; one batched matmul over its (block, KV head) pairs scores each KV head's query heads,
the runs' scores are joined (`[num_heads, context]` floats, never the keys), softmax runs in
float32, and one batched matmul per run takes the values. Runs are cut at every run boundary of
the batch, so a block range that several sequences share (a prefix hit, a fork) is one slice read
once for all of them. No K or V row is copied. Tables of short runs (many small sequences, or
ids scattered by forks and frees) are gathered instead into a contiguous
`[num_kv_heads, max_blocks * block_size, head_dim]` array, positions at or past
`context_lens[i]` masked, grouped-query attention in float32 (SDPA). The host plan (the runs, or
the gather's index arrays) is built once per forward pass when the caller passes a `scratch` dict
(the pass's `AttentionMetadata.scratch`), not once per layer.
Varlen: sequences with one new token go through the decode path together. A longer one (a
prefill chunk) of few query rows per KV head (`PREFILL_RUN_ROWS`: a prompt's suffix after a
prefix hit, a long prompt's small later chunks) reads its cached whole blocks as runs in place the
same way, its own keys (and the partly cached block) gathered with the causal mask, one softmax
over both; any other gathers its blocks and runs `mx.fast.scaled_dot_product_attention` with a
causal mask offset by its cached prefix (a big chunk's matmuls dwarf that copy).
Two options per layer: `window` (sliding-window attention: a token at position p sees keys at
positions p - window + 1 .. p, as mlx-lm's RotatingKVCache and HF's sliding_window do) masks the
older keys out; `sinks` (`[num_heads]` logits, gpt-oss) add one per-head logit to every softmax's
denominator that no value goes with. Both go to `mx.fast.scaled_dot_product_attention` as a mask
and its `sinks`. `chunk` (chunked local attention, Llama 4: a token at position p sees the keys
of its own chunk, positions (p // chunk) * chunk .. p, as mlx-lm's ChunkedKVCache and its chunk
mask do) is a window whose start is aligned to the chunk.
A quantized pool (`QuantizedPool`) is read the same way: the gather takes only the rows of the
tables (codes, scales, biases) and dequantizes those, never the whole pool; everything after
the gather is the float path, so the result is the float reference on `pool.dequantize()`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..utils import cdiv
from . import kv_quant


def block_rows(block_tables: mx.array, num_kv_heads: int) -> mx.array:
    """`[S, kvh, nb]`: row `table * kvh + head` of the pool seen as `[num_blocks * kvh, bs, d]`."""
    return block_tables[:, None, :] * num_kv_heads + mx.arange(num_kv_heads)[None, :, None]


def gather_blocks(
    pool: mx.array | kv_quant.QuantizedPool, block_tables: mx.array, rows: mx.array | None = None
) -> mx.array:
    """The blocks of each sequence laid out contiguously (dequantized, for a quantized pool).

    pool `[num_blocks, kvh, bs, d]`, block_tables `[S, nb]` -> `[S, kvh, nb * bs, d]`. Seeing the
    pool as rows of (block, head) `[num_blocks * kvh, bs, d]` makes the gather land in this
    layout directly, with no transpose copy. `rows` is `block_rows(block_tables, kvh)`, if built.
    """
    _, kvh, bs, d = pool.shape
    rows = block_rows(block_tables, kvh) if rows is None else rows
    if isinstance(pool, kv_quant.QuantizedPool):
        return kv_quant.gather_rows(pool, rows).reshape(block_tables.shape[0], kvh, -1, d)
    return pool.reshape(-1, bs, d)[rows].reshape(block_tables.shape[0], kvh, -1, d)


def _memo(scratch: dict | None, key, build):
    """`build()`, kept in `scratch` under `key`: every layer of a pass shares the tables, so the
    index arrays derived from them are built by the first layer only."""
    if scratch is None:
        return build()
    if key not in scratch:
        scratch[key] = build()
    return scratch[key]


def _attention(q, k, v, scale: float, mask, sinks, softcap: float | None) -> mx.array:
    """`mx.fast.scaled_dot_product_attention`, or with `softcap` the same attention with each score
    soft-capped before the mask and softmax (as mlx-lm's gemma2 computes it). q `[B, H, L, d]`,
    k, v `[B, kvh, N, d]`; query head h reads KV head h // (H / kvh)."""
    if softcap is None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
    B, H, L, d = q.shape
    kvh, N = k.shape[1], k.shape[2]
    s = (q * scale).reshape(B, kvh, H // kvh, L, d) @ k[:, :, None].swapaxes(-1, -2)  # [B, kvh, rep, L, N]
    s = mx.tanh(s / softcap) * softcap
    if isinstance(mask, str):  # "causal": L new tokens at the end of N
        mask = mx.arange(L)[:, None] + (N - L) >= mx.arange(N)[None]
    if mask is not None:
        mask = mask if mask.ndim < 4 else mask[:, :, None]  # [B, 1, 1, N] -> [B, 1, 1, 1, N]
        s = mx.where(mask, s, mx.array(mx.finfo(s.dtype).min, s.dtype))
    out = mx.softmax(s, axis=-1, precise=True) @ v[:, :, None]
    return out.reshape(B, H, L, -1)


# A table is read as runs when its runs average at least this many blocks: below that the
# per-run ops (a handful per run and layer) cost more than gathering the few blocks.
MIN_RUN_BLOCKS = 8


def table_runs(ids) -> list[tuple[int, int]]:
    """`(first block id, number of blocks)` of each run of consecutive ids in `ids`, in order:
    the runs laid end to end are `ids` (`[first + j for first, n in runs for j in range(n)]`)."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(ids) != 1) + 1  # where a run ends: the next id is not one more
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [ids.size]))
    return list(zip(ids[starts].tolist(), (ends - starts).tolist()))


@dataclass
class RunsPlan:
    """How one decode pass reads its tables in place. `pieces` are `(first block id, n blocks)`
    slices of the pool: the tables' runs cut at every run boundary of the batch, so two pieces are
    the same slice or share no block, and a prefix that several sequences share is one piece that
    is read once for all of them. `members[k]`: the sequences reading piece k (`rows[k]` as an
    index array); `parts[i]`: sequence i's pieces in position order, each `(k, row in members[k],
    a, b)` with slots `a .. b - 1` of the piece visible to its query."""

    pieces: list[tuple[int, int]]
    members: list[list[int]]
    rows: list[mx.array | None]  # None: every sequence, in order (no gather of the queries)
    parts: list[list[tuple[int, int, int, int]]]


def _runs_plan(block_tables, context_lens, block_size, window, chunk) -> RunsPlan | None:
    """The pass's `RunsPlan`, or None when its pieces are too short to pay (`MIN_RUN_BLOCKS`).
    Read on the host: the runner builds both arrays from numpy or lists, so this forces no
    computation."""
    tables = np.array(block_tables)
    spans = []  # per sequence: its runs, and its visible positions lo..hi-1 from its first run's start
    for i, hi in enumerate(np.array(context_lens).tolist()):
        lo = 0
        if window is not None:
            lo = max(0, hi - window)
        if chunk is not None:  # the query sits at hi - 1
            lo = (hi - 1) // chunk * chunk
        first, last = lo // block_size, cdiv(hi, block_size)
        spans.append((table_runs(tables[i, first:last]), lo - first * block_size, hi - first * block_size))
    cuts = sorted({x for runs, _, _ in spans for f, n in runs for x in (f, f + n)})
    index: dict[tuple[int, int], int] = {}
    plan = RunsPlan([], [], [], [])
    blocks = 0
    for i, (runs, lo, hi) in enumerate(spans):
        parts, at = [], 0  # at: slots of this sequence's pieces so far
        for f, n in runs:
            c = bisect.bisect_left(cuts, f)
            while cuts[c] < f + n:
                piece = (cuts[c], cuts[c + 1] - cuts[c])
                k = index.setdefault(piece, len(plan.pieces))
                if k == len(plan.pieces):
                    plan.pieces.append(piece)
                    plan.members.append([])
                slots = piece[1] * block_size
                parts.append((k, len(plan.members[k]), max(lo - at, 0), min(hi - at, slots)))
                plan.members[k].append(i)
                blocks += piece[1]
                at += slots
                c += 1
        plan.parts.append(parts)
    if blocks < MIN_RUN_BLOCKS * sum(map(len, plan.parts)):
        return None
    everyone = list(range(len(spans)))
    plan.rows = [None if m == everyone else mx.array(m) for m in plan.members]
    return plan


def _attend_runs(q, k_cache, v_cache, plan: RunsPlan, scale, sinks):
    """The decode over `plan`'s pieces, read in place. A piece of n blocks is the view
    `[n, kvh, block_size, head_dim]`; one batched matmul over its (block, KV head) pairs scores the
    query heads of that KV head, for every sequence that reads the piece at once, and one takes
    its values. q `[S, H, d]`; returns `[S, H, d]` in q's dtype."""
    S, H, d = q.shape
    _, kvh, bs, _ = k_cache.shape
    g = H // kvh
    qc = q.astype(k_cache.dtype)
    scores = []
    for (first, n), rows in zip(plan.pieces, plan.rows):
        qm = qc if rows is None else qc[rows]  # [m, H, d]
        m = qm.shape[0]
        qm = qm.reshape(m, kvh, g, d).transpose(1, 0, 2, 3).reshape(1, kvh, m * g, d)
        s = (qm @ k_cache[first : first + n].swapaxes(-1, -2)).astype(mx.float32)  # [n, kvh, m * g, bs]
        # -> [m, H, n * bs]: each sequence's heads, positions in order
        scores.append(s.reshape(n, kvh, m, g, bs).transpose(2, 1, 3, 0, 4).reshape(m, H, n * bs))
    weights = [[None] * len(m) for m in plan.members]
    for parts in plan.parts:
        s = [scores[k][r, :, a:b] for k, r, a, b in parts]
        s = (s[0] if len(s) == 1 else mx.concatenate(s, axis=1)) * scale
        if sinks is not None:  # one more logit per head in the denominator, with no value
            s = mx.concatenate([s, sinks.astype(mx.float32)[:, None]], axis=1)
        p = mx.softmax(s, axis=-1)
        at = 0
        for k, r, a, b in parts:  # the piece's slots, zero where hidden
            weights[k][r] = mx.pad(p[:, at : at + b - a], [(0, 0), (a, plan.pieces[k][1] * bs - b)])
            at += b - a
    outs = [[] for _ in range(S)]
    for (first, n), members, w in zip(plan.pieces, plan.members, weights):
        m = len(members)
        w = mx.stack(w).reshape(m, kvh, g, n, bs).transpose(3, 1, 0, 2, 4).reshape(n, kvh, m * g, bs)
        o = (w.astype(v_cache.dtype) @ v_cache[first : first + n]).astype(mx.float32).sum(axis=0)  # [kvh, m * g, d]
        o = o.reshape(kvh, m, g, d).transpose(1, 0, 2, 3).reshape(m, H, d)
        for r, i in enumerate(members):
            outs[i].append(o if m == 1 else o[r : r + 1])
    out = mx.concatenate([sum(o[1:], o[0]) for o in outs]) if S > 1 else sum(outs[0][1:], outs[0][0])
    return out.astype(q.dtype)


# A prefill chunk reads its cached prefix's runs in place when it has at most this many query
# rows per KV head (heads per KV head x new tokens): a run's values are weighted block by block
# (`[blocks, kvh, rows, head_dim]` summed over the blocks), which writes rows / block_size times
# the run's V, so past this the one gather of the prefix costs less (and is small against the
# chunk's own matmuls).
PREFILL_RUN_ROWS = 32


def _prefill_runs_plan(table: mx.array, cached: int, block_size: int, rows: int):
    """The runs of a prefill chunk's cached whole blocks (positions `0 .. cached // block_size *
    block_size - 1`), or None when the chunk takes the gather: too many query rows
    (`PREFILL_RUN_ROWS`), no whole cached block, or runs too short to pay (`MIN_RUN_BLOCKS`).
    `table` `[1, blocks]`; read on the host (the runner builds it from numpy)."""
    full = cached // block_size
    if rows > PREFILL_RUN_ROWS or full == 0:
        return None
    runs = table_runs(np.array(table)[0, :full])
    return runs if full >= MIN_RUN_BLOCKS * len(runs) else None


def _attend_prefill_runs(q, k_cache, v_cache, runs, table, context: int, scale, sinks):
    """A prefill chunk's attention with its cached prefix read in place. q `[n, H, d]`: the new
    tokens at positions `context - n .. context - 1`; `runs` cover positions `0 .. p0 - 1` (whole
    cached blocks, no mask: every new token sees them); the rest, `p0 .. context - 1` (the partly
    cached block and the chunk's own keys, at most n + block_size - 1 rows), is gathered from
    `table` `[1, blocks]` with the causal mask. One softmax over all the scores, taken in two
    passes (the max over every run first) so no run's scores are copied or joined. Returns `[n,
    H, d]` in q's dtype."""
    n, H, d = q.shape
    _, kvh, bs, _ = k_cache.shape
    g = H // kvh
    p0 = sum(m for _, m in runs) * bs
    # query rows per KV head ordered (head in group, token): [1, kvh, g * n, d]
    qs = (q.astype(mx.float32) * scale).astype(k_cache.dtype)
    qs = qs.reshape(n, kvh, g, d).transpose(1, 2, 0, 3).reshape(1, kvh, g * n, d)
    scores = [(qs @ k_cache[f : f + m].swapaxes(-1, -2)).astype(mx.float32) for f, m in runs]  # [m, kvh, g*n, bs]
    tail = table[:, p0 // bs : cdiv(context, bs)]
    kt, vt = (gather_blocks(c, tail)[0, :, : context - p0] for c in (k_cache, v_cache))  # [kvh, T, d]
    st = (qs[0] @ kt.swapaxes(-1, -2)).astype(mx.float32)  # [kvh, g*n, T]
    qpos = mx.arange(context - n, context)
    visible = qpos[:, None] >= mx.arange(p0, context)[None]  # [n, T]
    st = mx.where(mx.tile(visible, (g, 1)), st, -mx.inf)
    top = st.max(axis=-1)  # [kvh, g*n]; the token's own key is always visible: finite
    for s in scores:
        top = mx.maximum(top, s.max(axis=(0, 3)))
    if sinks is not None:
        sk = mx.repeat(sinks.astype(mx.float32).reshape(kvh, g), n, axis=1)  # [kvh, g*n]
        top = mx.maximum(top, sk)
    pt = mx.exp(st - top[..., None])
    total = pt.sum(axis=-1)
    out = (pt.astype(vt.dtype) @ vt).astype(mx.float32)  # [kvh, g*n, d]
    for (f, m), s in zip(runs, scores):
        p = mx.exp(s - top[None, :, :, None])
        total = total + p.sum(axis=(0, 3))
        out = out + (p.astype(v_cache.dtype) @ v_cache[f : f + m]).astype(mx.float32).sum(axis=0)
    if sinks is not None:  # one more logit per head in the denominator, with no value
        total = total + mx.exp(sk - top)
    out = out / total[..., None]
    return out.reshape(kvh, g, n, d).transpose(2, 0, 1, 3).reshape(n, H, d).astype(q.dtype)


def paged_attention_reference(
    q: mx.array,  # [num_seqs, num_heads, head_dim]
    k_cache: mx.array,  # [num_blocks, num_kv_heads, block_size, head_dim], or a QuantizedPool
    v_cache: mx.array,  # [num_blocks, num_kv_heads, block_size, head_dim], or a QuantizedPool
    block_tables: mx.array,  # [num_seqs, max_blocks] int32
    context_lens: mx.array,  # [num_seqs] int32
    scale: float,
    scratch: dict | None = None,  # per-pass memo of the index arrays (see _memo)
    window: int | None = None,  # sliding window: the last `window` positions only
    sinks: mx.array | None = None,  # [num_heads] per-head sink logits
    chunk: int | None = None,  # chunked local attention: the query's own chunk only
    softcap: float | None = None,  # logit soft-capping (Gemma 2): scores become softcap * tanh(s / softcap)
) -> mx.array:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    # a quantized run must be dequantized, and the runs' scores are not capped: both gathered
    if softcap is None and not isinstance(k_cache, kv_quant.QuantizedPool):
        plan = _memo(
            scratch,
            ("runs", block_size, window, chunk),
            lambda: _runs_plan(block_tables, context_lens, block_size, window, chunk),
        )
        if plan is not None:
            return _attend_runs(q, k_cache, v_cache, plan, scale, sinks)
    ctx = block_tables.shape[1] * block_size

    def index():
        pos = mx.arange(ctx)[None, :]
        valid = pos < context_lens[:, None]  # [S, ctx]
        if window is not None:
            valid = valid & (pos >= context_lens[:, None] - window)
        if chunk is not None:  # the query sits at context_len - 1
            valid = valid & (pos >= (context_lens[:, None] - 1) // chunk * chunk)
        return block_rows(block_tables, num_kv_heads), valid[:, None, None, :]

    rows, valid = _memo(scratch, ("decode", num_kv_heads, window, chunk), index)
    k = gather_blocks(k_cache, block_tables, rows).astype(mx.float32)
    v = gather_blocks(v_cache, block_tables, rows).astype(mx.float32)
    # float32 throughout; SDPA groups the query heads over their KV head itself.
    qf = q.astype(mx.float32)[:, :, None, :]  # [S, H, 1, d]
    sinks = None if sinks is None else sinks.astype(mx.float32)
    out = _attention(qf, k, v, scale, valid, sinks, softcap)
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)


def paged_attention_varlen_reference(
    q: mx.array,  # [T, num_heads, head_dim]: the new tokens of S sequences, concatenated
    k_cache: mx.array,  # [num_blocks, num_kv_heads, block_size, head_dim], or a QuantizedPool
    v_cache: mx.array,  # [num_blocks, num_kv_heads, block_size, head_dim], or a QuantizedPool
    block_tables: mx.array,  # [S, max_blocks] int32
    cu_seqlens_q: mx.array,  # [S + 1] int32
    context_lens: mx.array,  # [S] int32: cached plus new tokens
    scale: float,
    scratch: dict | None = None,  # per-pass memo of the index arrays (see _memo)
    window: int | None = None,  # sliding window: the last `window` positions only
    sinks: mx.array | None = None,  # [num_heads] per-head sink logits
    chunk: int | None = None,  # chunked local attention: the query's own chunk only
    softcap: float | None = None,  # logit soft-capping (Gemma 2)
) -> mx.array:  # [T, num_heads, head_dim]
    cu, ctx = _memo(scratch, "host", lambda: (cu_seqlens_q.tolist(), context_lens.tolist()))
    block_size = k_cache.shape[2]
    num_kv_heads = k_cache.shape[1]
    pieces = []
    s, num_seqs = 0, len(ctx)
    while s < num_seqs:
        if cu[s + 1] - cu[s] == 1:
            e = s
            while e < num_seqs and cu[e + 1] - cu[e] == 1:
                e += 1  # a run of decodes: one batched call
            run = None if scratch is None else scratch.setdefault(("run", s, e), {})
            if (s, e) == (0, num_seqs):  # decodes only: no slicing at all
                pieces.append(
                    paged_attention_reference(
                        q, k_cache, v_cache, block_tables, context_lens, scale, run, window, sinks, chunk, softcap
                    )
                )
            else:
                pieces.append(
                    paged_attention_reference(
                        q[cu[s] : cu[e]],
                        k_cache,
                        v_cache,
                        block_tables[s:e],
                        context_lens[s:e],
                        scale,
                        run,
                        window,
                        sinks,
                        chunk,
                        softcap,
                    )
                )
            s = e
            continue
        n, c = cu[s + 1] - cu[s], ctx[s]

        def index(s=s, n=n, c=c):
            table = block_tables[s : s + 1, : cdiv(c, block_size)]
            # New token j sits at position c - n + j and sees every position up to its own
            # (and, in a window, none before c - n + j - window + 1).
            if window is None and chunk is None and n == c:
                return table, block_rows(table, num_kv_heads), "causal"
            qpos, kpos = mx.arange(c - n, c)[:, None], mx.arange(c)[None, :]
            mask = qpos >= kpos
            if window is not None:
                mask = mask & (kpos > qpos - window)
            if chunk is not None:
                mask = mask & (kpos >= qpos // chunk * chunk)
            return table, block_rows(table, num_kv_heads), mask

        if softcap is None and window is None and chunk is None and not isinstance(k_cache, kv_quant.QuantizedPool):
            runs = _memo(
                scratch,
                ("prefill runs", s, block_size, q.shape[1]),
                lambda s=s, n=n, c=c: _prefill_runs_plan(
                    block_tables[s : s + 1], c - n, block_size, n * (q.shape[1] // num_kv_heads)
                ),
            )
            if runs is not None:
                table = block_tables[s : s + 1, : cdiv(c, block_size)]
                qs = q[cu[s] : cu[s + 1]]
                pieces.append(_attend_prefill_runs(qs, k_cache, v_cache, runs, table, c, scale, sinks))
                s += 1
                continue
        table, rows, mask = _memo(scratch, ("prefill", s, window, chunk), index)
        k, v = (gather_blocks(p, table, rows)[:, :, :c].astype(q.dtype) for p in (k_cache, v_cache))
        qs = q[cu[s] : cu[s + 1]].transpose(1, 0, 2)[None]  # [1, H, n, d]
        snk = None if sinks is None else sinks.astype(q.dtype)
        out = _attention(qs, k, v, scale, mask, snk, softcap)
        pieces.append(out[0].transpose(1, 0, 2))
        s += 1
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)
