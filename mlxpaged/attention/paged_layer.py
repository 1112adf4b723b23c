"""`PagedAttention`: the one layer that knows how the paged KV cache is laid out.

A model computes q, k, v (after RoPE) and calls this layer; it writes the new keys and values
into the layer's pools through the slot mapping, then attends:
- decode (one new token per sequence): `paged_attention` over each sequence's block table;
- prefill of a first chunk (nothing cached before it): causal attention on the new keys, as
  mlx-lm does;
- prefill of a later chunk, or after a prefix-cache hit: the cached prefix's blocks are gathered
  and the chunk attends to them plus itself, with a causal mask offset by the prefix length.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import paged_attention
from .metadata import AttentionMetadata
from .reference import gather_blocks
from ..utils import cdiv


class PagedAttention(nn.Module):
    """Write-then-attend for layer `layer_idx` of a `PagedKVCache`. Holds no parameters."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def __call__(self, q: mx.array, k: mx.array, v: mx.array, cache, meta: AttentionMetadata) -> mx.array:
        """q `[B, num_heads, L, hd]`, k and v `[B, num_kv_heads, L, hd]` -> `[B, L, num_heads * hd]`."""
        B, _, L, hd = q.shape
        # [B, kvh, L, hd] -> [B * L, kvh, hd], the order of slot_mapping
        k_rows = k.transpose(0, 2, 1, 3).reshape(B * L, self.num_kv_heads, hd)
        v_rows = v.transpose(0, 2, 1, 3).reshape(B * L, self.num_kv_heads, hd)
        k_pool, v_pool = cache.write(self.layer_idx, k_rows, v_rows, meta.slot_mapping)

        if not meta.is_prefill:
            out = paged_attention(
                q.reshape(B, self.num_heads, hd), k_pool, v_pool,
                meta.block_tables, meta.context_lens, scale=self.scale, impl=meta.impl,
            )
            return out.reshape(B, 1, -1)

        if meta.prefix_len == 0:
            keys, values, mask = k, v, "causal"
        else:
            ctx = meta.prefix_len + L
            table = meta.block_tables[:, : cdiv(ctx, k_pool.shape[2])]
            keys, values = (gather_blocks(p, table)[:, :, :ctx] for p in (k_pool, v_pool))
            pos = mx.arange(meta.prefix_len, ctx)[:, None]
            mask = pos >= mx.arange(ctx)[None, :]
        out = mx.fast.scaled_dot_product_attention(
            q, keys.astype(q.dtype), values.astype(q.dtype), scale=self.scale, mask=mask
        )
        return out.transpose(0, 2, 1, 3).reshape(B, L, -1)
