"""What one forward pass needs to know about the paged cache, passed explicitly to every layer."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass
class AttentionMetadata:
    """Positions, slots and block tables of one batch.

    Decode (`is_prefill=False`): `B` sequences, one new token each. Prefill: one sequence
    (`B == 1`), `L` new tokens that follow `prefix_len` tokens already in the cache.
    """

    is_prefill: bool
    slot_mapping: mx.array  # [B * L] int32: block_id * block_size + offset of each new token
    offsets: mx.array | int  # [B] int32 (decode) or int (prefill): position of each row's first new token
    block_tables: mx.array  # [B, max_blocks] int32
    context_lens: mx.array  # [B] int32: tokens in the cache after this step's writes
    prefix_len: int = 0  # prefill only: tokens cached before this chunk
    impl: str = "auto"  # paged-attention implementation for decode
