"""Paged attention in pure MLX ops: the reference every kernel is checked against.

Decode: each sequence's blocks are gathered through its block table into a contiguous
`[num_kv_heads, max_blocks * block_size, head_dim]` array, positions at or past
`context_lens[i]` are masked, and grouped-query attention runs in float32 (SDPA). The index
arrays derived from the tables are built once per forward pass when the caller passes a
`scratch` dict (the pass's `AttentionMetadata.scratch`), not once per layer.
Varlen: sequences with one new token go through the decode path together; each longer one
gathers its own blocks and runs `mx.fast.scaled_dot_product_attention` with a causal mask
offset by its cached prefix.
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

import mlx.core as mx

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

        table, rows, mask = _memo(scratch, ("prefill", s, window, chunk), index)
        k, v = (gather_blocks(p, table, rows)[:, :, :c].astype(q.dtype) for p in (k_cache, v_cache))
        qs = q[cu[s] : cu[s + 1]].transpose(1, 0, 2)[None]  # [1, H, n, d]
        snk = None if sinks is None else sinks.astype(q.dtype)
        out = _attention(qs, k, v, scale, mask, snk, softcap)
        pieces.append(out[0].transpose(1, 0, 2))
        s += 1
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)
