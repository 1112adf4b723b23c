"""The draft-model proposer (`speculative="draft"`): a smaller model with the target's tokenizer
proposes the K tokens of each speculating row, greedily, on its own paged pool.

The draft's pool has the target pool's block ids: block b holds the draft's K/V for the same
token slots as the target's block b. So one block table per sequence serves both models, the
slots the scheduler allocated for a row's K+1 tokens take the draft's writes too, and the pool
grows and trims both at once (the engine does).

What the draft has stored for a sequence is `Sequence.draft_computed` (its tokens
`token_ids[:draft_computed]`); the block manager resets it when the blocks are freed (finish,
preemption), cuts it at a rollback, and cuts it to a block's start when copy-on-write gives the
sequence a copy of that block (copies are made in the target's pool only). A proposal first
catches the draft up from there to the row's last known token (a new sequence's whole prompt,
or the tokens accepted last step), then runs K - 1 one-token passes. A sequence that hit the
prefix cache starts its draft at token 0: a cached block's draft rows are valid only if some
draft wrote them (and a draft of the same tokens writes the same rows).

Proposals are the draft's argmax: a point mass, so the acceptance rule of spec_decode.py is
Leviathan et al.'s speculative sampling exactly as for n-gram proposals (greedy and seeded
requests give the tokens they give without speculation). The draft's logits never reach a
sample. Every tensor-parallel rank runs the whole draft on the same tokens, so the ranks agree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx

from ..core.scheduler import SpecDecode
from ..core.sequence import BlockIds, Sequence
from ..errors import MlxPagedError
from ..worker.kv_cache import CacheShape, PagedKVCache
from ..worker.model_runner import ModelRunner
from .step import StepLayer

if TYPE_CHECKING:  # annotations only
    from ..loading.loader import LoadedModel

PROPOSED_LATER = -1  # a placeholder the scheduler reserves a slot for; `DraftProposer.propose` fills it


def draft_slots(token_ids: list[int], k: int) -> list[int]:
    """The scheduler's proposer for a draft model: always `k` proposals, filled in by the engine
    just before the step's forward pass (they need the device and the allocated slots)."""
    return [PROPOSED_LATER] * k


@dataclass(eq=False)
class _DraftRow:
    """What `ModelRunner.forward` reads of a sequence, seen from the draft: the same block table,
    its own stored count, and the proposals so far appended to the known tokens."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list = field(default_factory=list)
    ids: list[BlockIds] = field(default_factory=lambda: [BlockIds()])  # group 0's block ids (the draft's one group)
    pending: None = None


def load_draft(path: str, dtype: mx.Dtype) -> LoadedModel:
    """The draft model at `path`, in the target's `dtype` (`check_draft` checks its tokenizer)."""
    from ..loading.loader import DTYPES, load

    draft = load(path, next(name for name, d in DTYPES.items() if d == dtype))
    if draft.cache_spec.num_recurrent:
        raise MlxPagedError(
            f"a draft model with recurrent layers ({draft.config.get('model_type')!r}) is not supported: "
            "its own state cannot roll back rejected proposals yet; "
            "use an attention-only draft or --speculative ngram"
        )
    return draft


def check_draft(target, draft) -> None:
    """Refuse a draft whose tokens do not mean the target's: the same vocabulary, id for id."""
    tv, dv = target.tokenizer.vocab_size, draft.tokenizer.vocab_size
    if tv != dv or target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise MlxPagedError(
            f"the draft model's tokenizer ({draft.path.name}, {dv} tokens) is not the target's "
            f"({target.path.name}, {tv} tokens): a draft model must share the target's tokenizer"
        )


class DraftProposer(StepLayer):
    """Owns the draft model and its pool `[num_blocks, kv_heads, block_size, head_dim]` per layer,
    whose block ids are the target pool's (same `num_blocks` and `block_size` at all times: the
    pool follows every resize of the target's). As a step layer it fills the proposals of the
    step's speculating rows before the forward pass."""

    def __init__(self, draft, target, num_blocks: int, block_size: int, attention_impl: str = "auto"):
        check_draft(target, draft)
        self.loaded = draft
        self.kv_cache = PagedKVCache(CacheShape.of(draft), num_blocks, block_size, spec=draft.cache_spec)
        self.runner = ModelRunner(draft.model, self.kv_cache, attention_impl)
        # Ids past the tokenizer's vocabulary (padding rows of an embedding) are never proposed.
        self.vocab = min(target.model.args.vocab_size, draft.model.args.vocab_size)
        self.passes = 0  # draft forward passes run (one per proposal position)
        self.seconds = 0.0  # wall time in `propose` (the draft's share of the steps)

    def resize(self, num_blocks: int, copies: list[tuple[int, int]] = ()) -> None:
        self.kv_cache.resize(num_blocks, copies)

    def check_kernels(self) -> None:
        from ..attention.metal import check_pools

        check_pools(self.loaded.model.args.num_attention_heads, self.kv_cache.keys)

    def before_forward(self, out) -> None:
        if out.spec:
            self.propose(out.spec)  # fills the placeholders the scheduler reserved

    def propose(self, specs: list[SpecDecode]) -> None:
        """Fill each row's `proposal` (placeholders, `len` = K of that row) with the draft's greedy
        tokens; the row's sequence has every token known and K + 1 slots allocated past them."""
        t0 = time.perf_counter()
        rows: list[tuple[SpecDecode, _DraftRow]] = []
        batch: list[tuple[_DraftRow, int]] = []
        for d in specs:
            seq: Sequence = d.seq
            assert seq.pending is None and seq.num_uncomputed == 1, "a speculating row's tokens are known"
            start = min(seq.draft_computed, seq.num_computed_tokens)
            row = _DraftRow(list(seq.token_ids), start, seq.block_table, [seq.ids[0]])
            rows.append((d, row))
            batch.append((row, len(row.token_ids) - start))  # catch up to and through the last token
        while batch:
            logits = self.runner.forward(batch)  # [len(batch), V]: each row's last new token
            tokens = mx.argmax(logits[:, : self.vocab], axis=-1)
            mx.eval(tokens, self.kv_cache.arrays)
            self.passes += 1
            for (row, n), tok in zip(batch, tokens.tolist()):
                row.num_computed_tokens += n
                row.token_ids.append(tok)
            # A row drops out once it has its K; its last proposal is never fed back (that KV is
            # needed only if all K are accepted, and then the next catch-up stores it).
            batch = [(row, 1) for d, row in rows if len(row.token_ids) - len(d.seq.token_ids) < len(d.proposal)]
        for d, row in rows:
            known = len(d.seq.token_ids)
            d.proposal[:] = row.token_ids[known : known + len(d.proposal)]
            d.seq.draft_computed = row.num_computed_tokens
        self.seconds += time.perf_counter() - t0
