"""Turns the step's sequences into one packed batch with attention metadata, and runs it."""

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

    def forward(self, batch: list[tuple[Sequence, int]]) -> mx.array:
        """One forward pass over `batch`: for each (sequence, n), its next n uncomputed tokens.

        Every token is packed along one axis, with its own position, slot and sequence. Returns
        the logits `[len(batch), V]` of each entry's last new token. The caller has allocated
        the slots; it advances `num_computed_tokens` afterwards.
        """
        bs = self.block_size
        num_seqs = len(batch)
        q_lens = np.array([n for _, n in batch], dtype=np.int32)
        starts = np.array([s.num_computed_tokens for s, _ in batch], dtype=np.int32)
        cu = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])
        max_blocks = max(len(s.block_table) for s, _ in batch)
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        for i, (s, _) in enumerate(batch):
            tables[i, : len(s.block_table)] = s.block_ids
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
        positions = (np.arange(cu[-1]) - cu[seq_of_token] + starts[seq_of_token]).astype(np.int32)
        # Token t goes to its own sequence's table: index the flattened tables past that row's start.
        slots = slot_mapping(tables.reshape(-1), seq_of_token * max_blocks * bs + positions, bs)
        tokens = [t for s, n in batch for t in s.token_ids[s.num_computed_tokens : s.num_computed_tokens + n]]
        meta = AttentionMetadata(
            slot_mapping=mx.array(slots),
            positions=mx.array(positions),
            block_tables=mx.array(tables),
            cu_seqlens_q=mx.array(cu),
            context_lens=mx.array(starts + q_lens),
            logits_indices=mx.array(cu[1:] - 1),
            impl=self.attention_impl,
        )
        logits = self.model(mx.array(tokens, dtype=mx.int32), self.kv_cache, meta)
        mx.eval(logits, self.kv_cache.arrays)  # every pool array (a QuantizedPool is not an array)
        return logits

    def prefill(self, seq: Sequence, num_tokens: int) -> mx.array:
        """The next `num_tokens` tokens of one sequence; returns the last one's logits `[V]`."""
        return self.forward([(seq, num_tokens)])[0]

    def decode(self, seqs: list[Sequence]) -> mx.array:
        """One new token for each sequence (its last); returns logits `[B, V]`."""
        return self.forward([(s, 1) for s in seqs])
