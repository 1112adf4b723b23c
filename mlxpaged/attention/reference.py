"""Paged attention in pure MLX ops: the reference every kernel is checked against.

Decode: each sequence's blocks are gathered through its block table into a contiguous
`[num_kv_heads, max_blocks * block_size, head_dim]` array, positions at or past
`context_lens[i]` are masked, and grouped-query attention runs in float32.
Varlen: sequences with one new token go through the decode path together; each longer one
gathers its own blocks and runs `mx.fast.scaled_dot_product_attention` with a causal mask
offset by its cached prefix.
A quantized pool (`QuantizedPool`) is read the same way: the gather takes only the rows of the
tables (codes, scales, biases) and dequantizes those, never the whole pool; everything after
the gather is the float path, so the result is the float reference on `pool.dequantize()`.
"""

from __future__ import annotations

import mlx.core as mx

from .. import kv_quant
from ..utils import cdiv


def gather_blocks(pool: mx.array | kv_quant.QuantizedPool, block_tables: mx.array) -> mx.array:
    """The blocks of each sequence laid out contiguously (dequantized, for a quantized pool).

    pool `[num_blocks, kvh, bs, d]`, block_tables `[S, nb]` -> `[S, kvh, nb * bs, d]`. Seeing the
    pool as rows of (block, head) `[num_blocks * kvh, bs, d]` makes the gather land in this
    layout directly, with no transpose copy.
    """
    _, kvh, bs, d = pool.shape
    rows = block_tables[:, None, :] * kvh + mx.arange(kvh)[None, :, None]  # [S, kvh, nb]
    if isinstance(pool, kv_quant.QuantizedPool):
        return kv_quant.gather_rows(pool, rows).reshape(block_tables.shape[0], kvh, -1, d)
    return pool.reshape(-1, bs, d)[rows].reshape(block_tables.shape[0], kvh, -1, d)


def paged_attention_reference(
    q: mx.array,  # [num_seqs, num_heads, head_dim]
    k_cache: mx.array,  # [num_blocks, num_kv_heads, block_size, head_dim], or a QuantizedPool
    v_cache: mx.array,  # [num_blocks, num_kv_heads, block_size, head_dim], or a QuantizedPool
    block_tables: mx.array,  # [num_seqs, max_blocks] int32
    context_lens: mx.array,  # [num_seqs] int32
    scale: float,
) -> mx.array:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    group = num_heads // num_kv_heads
    ctx = max_blocks * block_size

    k = gather_blocks(k_cache, block_tables).astype(mx.float32)
    v = gather_blocks(v_cache, block_tables).astype(mx.float32)
    qf = q.astype(mx.float32).reshape(num_seqs, num_kv_heads, group, head_dim) * scale
    scores = qf @ k.transpose(0, 1, 3, 2)  # [S, kvh, group, ctx]
    valid = mx.arange(ctx)[None, :] < context_lens[:, None]  # [S, ctx]
    scores = mx.where(valid[:, None, None, :], scores, -mx.inf)
    probs = mx.softmax(scores, axis=-1)
    out = probs @ v  # [S, kvh, group, d]
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)


def paged_attention_varlen_reference(
    q: mx.array,  # [T, num_heads, head_dim]: the new tokens of S sequences, concatenated
    k_cache: mx.array,  # [num_blocks, num_kv_heads, block_size, head_dim], or a QuantizedPool
    v_cache: mx.array,  # [num_blocks, num_kv_heads, block_size, head_dim], or a QuantizedPool
    block_tables: mx.array,  # [S, max_blocks] int32
    cu_seqlens_q: mx.array,  # [S + 1] int32
    context_lens: mx.array,  # [S] int32: cached plus new tokens
    scale: float,
) -> mx.array:  # [T, num_heads, head_dim]
    cu = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    block_size = k_cache.shape[2]
    pieces = []
    s, num_seqs = 0, len(ctx)
    while s < num_seqs:
        if cu[s + 1] - cu[s] == 1:
            e = s
            while e < num_seqs and cu[e + 1] - cu[e] == 1:
                e += 1  # a run of decodes: one batched call
            pieces.append(paged_attention_reference(
                q[cu[s] : cu[e]], k_cache, v_cache, block_tables[s:e], context_lens[s:e], scale))
            s = e
            continue
        n, c = cu[s + 1] - cu[s], ctx[s]
        table = block_tables[s : s + 1, : cdiv(c, block_size)]
        k, v = (gather_blocks(p, table)[:, :, :c].astype(q.dtype) for p in (k_cache, v_cache))
        qs = q[cu[s] : cu[s + 1]].transpose(1, 0, 2)[None]  # [1, H, n, d]
        # New token j sits at position c - n + j and sees every position up to its own.
        mask = "causal" if n == c else mx.arange(c - n, c)[:, None] >= mx.arange(c)[None, :]
        out = mx.fast.scaled_dot_product_attention(qs, k, v, scale=scale, mask=mask)
        pieces.append(out[0].transpose(1, 0, 2))
        s += 1
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)
