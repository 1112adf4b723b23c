"""Turns scheduled sequences into model inputs and attention metadata, and runs the forward pass."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .attention.metadata import AttentionMetadata
from .kv_cache import PagedKVCache, slot_mapping
from .sequence import Sequence


class ModelRunner:
    """Owns the model and its paged KV cache; knows nothing about scheduling."""

    def __init__(self, model: nn.Module, kv_cache: PagedKVCache, attention_impl: str = "auto"):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.attention_impl = attention_impl

    def prefill(self, seq: Sequence, num_tokens: int) -> mx.array:
        """Compute the KV of the next `num_tokens` tokens of `seq`; returns the last one's logits `[V]`.

        The caller has reserved the blocks; it advances `num_computed_tokens` afterwards.
        """
        start = seq.num_computed_tokens
        stop = start + num_tokens
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=mx.array(slot_mapping(np.asarray(seq.block_ids, dtype=np.int64), np.arange(start, stop), self.block_size)),
            offsets=start,
            block_tables=mx.array([seq.block_ids], dtype=mx.int32),
            context_lens=mx.array([stop], dtype=mx.int32),
            prefix_len=start,
            impl=self.attention_impl,
        )
        tokens = mx.array([seq.token_ids[start:stop]], dtype=mx.int32)
        logits = self.model(tokens, self.kv_cache, meta)[0]
        mx.eval(logits, self.kv_cache.keys, self.kv_cache.values)
        return logits

    def decode(self, seqs: list[Sequence]) -> mx.array:
        """One new token for each sequence (its last), in one batch; returns logits `[B, V]`."""
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_ids
        pos = np.array([s.num_computed_tokens for s in seqs], dtype=np.int32)
        # Each row's new token goes to its own table at its own position.
        slots = slot_mapping(tables.reshape(-1), np.arange(len(seqs)) * max_blocks * self.block_size + pos, self.block_size)
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=mx.array(slots),
            offsets=mx.array(pos),
            block_tables=mx.array(tables),
            context_lens=mx.array(pos + 1),
            impl=self.attention_impl,
        )
        tokens = mx.array([[s.token_ids[-1]] for s in seqs], dtype=mx.int32)
        logits = self.model(tokens, self.kv_cache, meta)
        mx.eval(logits, self.kv_cache.keys, self.kv_cache.values)
        return logits
