"""What one forward pass needs to know about the paged cache, passed explicitly to every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx


@dataclass
class AttentionMetadata:
    """Where the new tokens of one step go and what each attends to.

    The step's T new tokens belong to S sequences and are packed along one axis with no
    padding: sequence s owns tokens `cu_seqlens_q[s]:cu_seqlens_q[s + 1]`. A decode is a
    sequence with one new token; a prefill chunk has any number. The arrays are built on the
    host from numpy, so reading them back (`tolist`) forces no computation.
    """

    slot_mapping: mx.array  # [T] int32: block_id * block_size + offset of each new token
    positions: mx.array  # [T] int32: each new token's position in its sequence (RoPE)
    block_tables: mx.array  # [S, max_blocks] int32
    cu_seqlens_q: mx.array  # [S + 1] int32: offsets of each sequence's new tokens
    context_lens: mx.array  # [S] int32: tokens in the cache after this step's writes
    logits_indices: mx.array  # [S] int32: each sequence's last new token, the one whose logits are sampled
    impl: str = "auto"  # paged-attention implementation
    # A hybrid model's recurrent states for this pass (models/recurrent.py `StepStates`), per entry;
    # None: none (a model without recurrent layers, or every entry starts empty).
    states: object = None
    # The pass's LoRA adapters (models/lora.py `StepAdapters`: each packed row's adapter); None
    # when every row runs the base model.
    lora: object = None
    # Each KV cache group's view of the same pass (core/kv_groups.py), group 0's this one: its own
    # slot_mapping and block_tables, the other fields these; empty for a one-group model. A layer
    # reads its group's.
    groups: list[AttentionMetadata] = field(default_factory=list, repr=False, compare=False)
    # Arrays derived from the tables (gather rows, masks), built by the first layer that needs
    # them and reused by the others: one pass's memo, never shared between passes.
    scratch: dict = field(default_factory=dict, repr=False, compare=False)
    # Set by the pass: the final norm's output at `logits_indices` (the rows the output layer reads),
    # lazily; what pooled requests take (engine/pooling.py).
    hidden: mx.array | None = field(default=None, repr=False, compare=False)
