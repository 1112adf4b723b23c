"""Paged decode attention in pure MLX ops: the reference every kernel is checked against.

Each sequence's blocks are gathered through its block table into a contiguous
`[num_kv_heads, max_blocks * block_size, head_dim]` array, positions at or past
`context_lens[i]` are masked, and grouped-query attention runs in float32.
"""

from __future__ import annotations

import mlx.core as mx


def gather_blocks(pool: mx.array, block_tables: mx.array) -> mx.array:
    """The blocks of each sequence laid out contiguously.

    pool `[num_blocks, kvh, bs, d]`, block_tables `[S, nb]` -> `[S, kvh, nb * bs, d]`. Seeing the
    pool as rows of (block, head) `[num_blocks * kvh, bs, d]` makes the gather land in this
    layout directly, with no transpose copy.
    """
    _, kvh, bs, d = pool.shape
    rows = block_tables[:, None, :] * kvh + mx.arange(kvh)[None, :, None]  # [S, kvh, nb]
    return pool.reshape(-1, bs, d)[rows].reshape(block_tables.shape[0], kvh, -1, d)


def paged_attention_reference(
    q: mx.array,  # [num_seqs, num_heads, head_dim]
    k_cache: mx.array,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: mx.array,  # [num_blocks, num_kv_heads, block_size, head_dim]
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
