"""`PagedAttention`: the one layer that knows how the paged KV cache is laid out.

A model computes q, k, v (after RoPE) for the step's packed tokens and calls this layer; it
writes the new keys and values into the layer's pools through the slot mapping, then runs
`paged_attention_varlen` over every sequence's block table (decodes and prefill chunks alike).
With a quantized cache the write quantizes the new rows and the pools it returns are
`QuantizedPool`s, which `paged_attention_varlen` reads as they are; the queries first take the
cache's per-channel key scales (`PagedKVCache.scale_queries`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import paged_attention_varlen
from .metadata import AttentionMetadata


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
        """q `[T, num_heads, hd]`, k and v `[T, num_kv_heads, hd]` (one row per new token)
        -> `[T, num_heads * hd]`."""
        T = q.shape[0]
        k_pool, v_pool = cache.write(self.layer_idx, k, v, meta.slot_mapping)
        q = cache.scale_queries(self.layer_idx, q)  # the cache may store keys rescaled per channel
        out = paged_attention_varlen(
            q, k_pool, v_pool, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
            scale=self.scale, impl=meta.impl, scratch=meta.scratch,
        )
        return out.reshape(T, -1)
