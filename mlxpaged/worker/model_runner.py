"""Turns the step's sequences into one packed batch with attention metadata, and runs it."""

from __future__ import annotations

import operator
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..attention.metadata import AttentionMetadata
from ..core.sequence import BlockIds, Sequence
from .kv_cache import PagedKVCache, slot_mapping
from .state_cache import Checkpoints, keep_states, states_for


def gather_rows(refs: list) -> mx.array:
    """Stack `refs` into one array; each is an array or `(array, row)`, a row of an earlier
    step's (maybe still lazy) output. Rows of one array in order cost one gather, or nothing."""
    first = refs[0]
    if isinstance(first, tuple) and all(isinstance(r, tuple) and r[0] is first[0] for r in refs):
        rows = [r[1] for r in refs]
        if rows == list(range(first[0].shape[0])):
            return first[0]
        return first[0][mx.array(rows)]
    return mx.stack([r[0][r[1]] if isinstance(r, tuple) else r for r in refs])


LONG_TABLE = 64  # blocks: a longer table's row is copied from its buffer, a shorter one's from its list


def _rows(tables: list[BlockIds]) -> np.ndarray | list[list[int]]:
    """`[len(tables), the longest]` int32 block ids, row i table i's, zero-padded (a padded entry
    is never read: each row's context length ends before it); for `mx.array`. Short tables as
    nested lists (cheapest to convert when small), long ones as a numpy array filled from the
    buffers (no Python work per block)."""
    width = max(len(t.list) for t in tables)
    if width <= LONG_TABLE:
        return [t.list if len(t.list) == width else t.list + [0] * (width - len(t.list)) for t in tables]
    out = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        n = len(t.list)
        out[i, :n] = t.buf[:n]
    return out


class DecodeTables:
    """One group's block tables of the last decode step, as a matrix kept between steps.

    A decode step's sequences are usually the last one's, in order, and few of their tables
    changed since (one sequence in `block_size` takes a new block each step): only those rows are
    copied again, from their ids' buffers; any other batch rebuilds the matrix (`_rows`).
    Invariant: for each row i, `rows[i, :lens[i]]` are `tables[i]`'s ids as of `versions[i]`
    (`BlockIds.version`); its later entries are zero or stale, never read (each row's context
    length ends before them); `rows` has `max(lens)` columns; `mx_rows`, unless None, is `rows` as
    an MLX array (the step's `block_tables`: a step with no table changed reuses the last one's).
    """

    def __init__(self):
        self.tables: list[BlockIds] = []
        self.versions: list[int] = []
        self.lens: list[int] = []
        self.rows = np.zeros((0, 0), dtype=np.int32)  # [S, max(lens)] int32
        self.mx_rows: mx.array | None = None  # [S, max(lens)] int32

    def array(self, tables: list[BlockIds]) -> mx.array:
        """`[len(tables), the longest]` int32, row i table i's ids (`_rows`' matrix), as an MLX
        array (arrays are immutable: steps may share one)."""
        versions = [t.version for t in tables]
        old = self.tables
        if len(tables) != len(old) or not all(map(operator.is_, tables, old)):
            self.rows = np.asarray(_rows(tables), dtype=np.int32)
            self.tables, self.versions, self.lens = tables, versions, [len(t.list) for t in tables]
            self.mx_rows = None
        elif versions != self.versions:
            self.mx_rows = None
            for i in [i for i, (v, w) in enumerate(zip(versions, self.versions)) if v != w]:
                t = tables[i]
                n = self.lens[i] = len(t.list)
                if n > self.rows.shape[1]:
                    wider = np.zeros((len(tables), n), dtype=np.int32)
                    wider[:, : self.rows.shape[1]] = self.rows
                    self.rows = wider
                self.rows[i, :n] = t.buf[:n]
            self.versions = versions
            width = max(self.lens)
            if width < self.rows.shape[1]:  # tables shrank (speculation's rollback)
                self.rows = np.ascontiguousarray(self.rows[:, :width])
        if self.mx_rows is None:
            self.mx_rows = mx.array(self.rows)
        return self.mx_rows


class ModelRunner:
    """Owns the model and its paged KV cache; knows nothing about scheduling."""

    def __init__(
        self,
        model: nn.Module,
        kv_cache: PagedKVCache,
        attention_impl: str = "auto",
        checkpoints: Checkpoints | None = None,
        adapters=None,
    ):
        self.model = model
        self.adapters = adapters  # the LoRA adapters the sequences may name (models/lora.py `AdapterSet`), or None
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.attention_impl = attention_impl
        # a hybrid model's recurrent layers (state_cache.py); 0 for an attention-only model
        self.num_recurrent = kv_cache.spec.num_recurrent
        self.multimodal = getattr(model, "multimodal", False)
        self.checkpoints = checkpoints  # recurrent-state checkpoints for prefix hits, or None
        self.num_groups = len(kv_cache.group_blocks)  # each group's layers read their own tables
        self._aranges: dict[int, tuple[mx.array, mx.array]] = {}  # `_steps`, by batch size
        self._tables = [DecodeTables() for _ in range(self.num_groups)]  # the decode steps' tables, by group
        # The last decode step's context lengths, as a list and as the array that the next step's
        # positions may reuse (`_decode`).
        self._last_lens: tuple[list[int], mx.array | None] = ([], None)
        # The last pass's final hidden states, one row per logits row (`AttentionMetadata.hidden`), lazily
        self.hidden: mx.array | None = None

    def forward(
        self,
        batch: list[tuple[Sequence, int]],
        spec_tokens: dict[int, list[int]] | None = None,
        all_rows: list[int] = (),
    ) -> mx.array:
        """One forward pass over `batch`: for each (sequence, n), its next n uncomputed tokens.

        Every token is packed along one axis, with its own position, slot and sequence. Returns
        the logits `[len(batch), V]` of each entry's last new token, lazily: nothing is evaluated
        here, so the caller can launch the pass with `mx.async_eval` and build the next one
        meanwhile. A sequence's pending token (sampled by a step still on the device) is
        gathered from that step's token array. The caller has allocated the slots; it advances
        `num_computed_tokens` afterwards.

        `spec_tokens[i]` (speculative decoding) are proposals that follow entry i's one stored-to-be
        token (n = 1 + len(proposals)); such an entry returns the logits of all its n positions, in
        place of one row: logits rows follow the entries, each entry contributing 1 or n rows.
        `all_rows`: entries whose every position's logits come after all of those, in order (prompt
        logprobs); only these rows pass through the output layer.
        """
        spec_tokens = spec_tokens or {}
        if not spec_tokens and not all_rows and {n for _, n in batch} == {1}:
            return self._decode(batch)
        bs = self.block_size
        num_seqs = len(batch)
        q_lens = np.array([n for _, n in batch], dtype=np.int32)
        starts = np.array([s.num_computed_tokens for s, _ in batch], dtype=np.int32)
        cu = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])
        tables = np.asarray(_rows([s.ids[0] for s, _ in batch]), dtype=np.int32)
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
        positions = (np.arange(cu[-1]) - cu[seq_of_token] + starts[seq_of_token]).astype(np.int32)
        # Token t goes to its own sequence's table: index the flattened tables past that row's start.
        slots = slot_mapping(tables.reshape(-1), seq_of_token * tables.shape[1] * bs + positions, bs)
        meta = AttentionMetadata(
            slot_mapping=mx.array(slots),
            positions=mx.array(positions),
            block_tables=mx.array(tables),
            cu_seqlens_q=mx.array(cu),
            context_lens=mx.array(starts + q_lens),
            logits_indices=mx.array(self._logits_indices(cu, spec_tokens, all_rows)),
            impl=self.attention_impl,
        )
        if self.num_groups > 1:
            meta.groups = [meta]
            for g in range(1, self.num_groups):  # as long as group 0's tables (a sequence invariant)
                gt = np.asarray(_rows([s.ids[g] for s, _ in batch]), dtype=np.int32)
                gslots = slot_mapping(gt.reshape(-1), seq_of_token * gt.shape[1] * bs + positions, bs)
                meta.groups.append(
                    replace(meta, slot_mapping=mx.array(gslots), block_tables=mx.array(gt), groups=[], scratch={})
                )
        meta.lora = self._lora(batch, q_lens)
        return self._run(batch, self._input_ids(batch, int(cu[-1]), spec_tokens), meta, frozenset(spec_tokens))

    def _lora(self, batch: list[tuple[Sequence, int]], q_lens=None):
        """The pass's adapters (each packed row's: its sequence's), or None when no row has one."""
        if self.adapters is None:
            return None
        slots = [s.adapter.slot if s.adapter is not None else 0 for s, _ in batch]
        if not any(slots):
            return None
        return self.adapters.step(slots if q_lens is None else np.repeat(slots, q_lens))

    def _run(
        self, batch: list[tuple[Sequence, int]], ids: mx.array, meta: AttentionMetadata, every: frozenset = frozenset()
    ) -> mx.array:
        """The model on the pass; a hybrid model's recurrent layers read each entry's state and
        leave its next one on the sequence (state_cache.py), a speculating entry's after each token."""
        # a vision model's pass also takes its image rows and positions (models/vision.py)
        extra = (self.model.pass_rows(batch, meta),) if self.multimodal else ()
        if self.num_recurrent:
            meta.states = states_for(batch, self.num_recurrent, self.block_size, self.checkpoints, every)
        logits = self.model(ids, self.kv_cache, meta, *extra)
        self.hidden = meta.hidden
        if self.num_recurrent:
            keep_states(batch, meta.states, self.block_size, self.checkpoints)
        return logits

    def _decode(self, batch: list[tuple[Sequence, int]]) -> mx.array:
        """`forward` when every entry is one token (the decode steps): the same arrays from one
        pass over the batch, the block tables kept between steps (`DecodeTables`: no Python work
        per block), the rest from lists (cheaper than numpy's operations at these sizes). The input
        ids are every row's known next token, or every row's pending one (then usually the last
        step's token array itself); a mix takes `_input_ids` (the scheduler decodes a sequence only
        with one token uncomputed: a pending token is the last). Positions equal to the last decode
        step's context lengths (each row one token further: the usual step) reuse that array."""
        bs = self.block_size
        ids, slots, starts, ctx, tables, pending = [], [], [], [], [], []
        for s, _ in batch:
            p = s.num_computed_tokens
            t = s.ids[0]
            starts.append(p)
            ctx.append(p + 1)
            tables.append(t)
            slots.append(t.list[p // bs] * bs + p % bs)  # the token's block is always in the table
            if s.pending is None:
                ids.append(s.token_ids[p])
            else:
                pending.append(s.pending)
        if not pending:
            input_ids = mx.array(ids, dtype=mx.int32)
        elif len(pending) == len(batch):
            input_ids = gather_rows([(q.tokens, q.row) for q in pending]).astype(mx.int32)
        else:
            input_ids = self._input_ids(batch, len(batch), {})
        last_ctx, last_lens = self._last_lens
        context_lens = mx.array(ctx, dtype=mx.int32)
        self._last_lens = (ctx, context_lens)
        cu, last = self._steps(len(batch))
        meta = AttentionMetadata(
            slot_mapping=mx.array(slots, dtype=mx.int32),
            positions=last_lens if starts == last_ctx else mx.array(starts, dtype=mx.int32),
            block_tables=self._tables[0].array(tables),
            cu_seqlens_q=cu,
            context_lens=context_lens,  # (from a list: cheaper than an op)
            logits_indices=last,
            impl=self.attention_impl,
        )
        if self.num_groups > 1:  # a released block reads as block 0: the group's mask hides it
            meta.groups = [meta]
            for g in range(1, self.num_groups):
                gids = [s.ids[g] for s, _ in batch]
                meta.groups.append(
                    replace(
                        meta,
                        slot_mapping=mx.array(
                            [t.list[p // bs] * bs + p % bs for t, p in zip(gids, starts)], dtype=mx.int32
                        ),
                        block_tables=self._tables[g].array(gids),
                        groups=[],
                        scratch={},
                    )
                )
        meta.lora = self._lora(batch)
        return self._run(batch, input_ids, meta)

    def _steps(self, n: int) -> tuple[mx.array, mx.array]:
        """`(arange(n + 1), arange(n))` int32: a decode step's cu_seqlens_q and logits indices,
        made once per batch size (arrays are immutable: sharing them between steps is safe)."""
        got = self._aranges.get(n)
        if got is None:
            got = self._aranges[n] = (mx.arange(n + 1, dtype=mx.int32), mx.arange(n, dtype=mx.int32))
        return got

    @staticmethod
    def _logits_indices(cu: np.ndarray, spec_tokens: dict[int, list[int]], all_rows: list[int] = ()) -> np.ndarray:
        """Each entry's last token, or every token of a speculating entry; then every token of the
        `all_rows` entries."""
        last = cu[1:] - 1
        if spec_tokens:
            last = np.concatenate(
                [np.arange(cu[i], cu[i + 1]) if i in spec_tokens else last[i : i + 1] for i in range(len(last))]
            )
        if all_rows:
            last = np.concatenate([last] + [np.arange(cu[i], cu[i + 1]) for i in all_rows])
        return last.astype(np.int32)

    @staticmethod
    def _input_ids(batch: list[tuple[Sequence, int]], total: int, spec_tokens: dict[int, list[int]]) -> mx.array:
        """The packed input ids: known ones from `token_ids`, pending ones gathered on the device,
        proposals after their row's one known token."""
        tokens: list[int] = []
        pending: list[tuple[int, object]] = []  # (position in the pass, the sequence's PendingToken)
        for i, (s, n) in enumerate(batch):
            start = s.num_computed_tokens
            if i in spec_tokens:
                assert s.pending is None and n == 1 + len(spec_tokens[i]) and s.num_uncomputed == 1
                tokens += s.token_ids[start : start + 1] + spec_tokens[i]
                continue
            known = s.token_ids[start : start + n]
            tokens += known
            if len(known) < n:  # only the last token can be pending
                assert s.pending is not None and len(known) == n - 1, "a scheduled token is neither known nor pending"
                pending.append((len(tokens), s.pending))
                tokens.append(0)
        assert len(tokens) == total
        ids = mx.array(tokens, dtype=mx.int32)
        if not pending:
            return ids
        # Usually every row of one earlier step's token array, in order: no copy at all.
        vals = gather_rows([(p.tokens, p.row) for _, p in pending]).astype(mx.int32)
        if len(pending) == total:
            return vals
        ids[mx.array([pos for pos, _ in pending])] = vals
        return ids

    def prefill(self, seq: Sequence, num_tokens: int) -> mx.array:
        """The next `num_tokens` tokens of one sequence; returns the last one's logits `[V]` (evaluated)."""
        return self._evaluated(self.forward([(seq, num_tokens)]))[0]

    def decode(self, seqs: list[Sequence]) -> mx.array:
        """One new token for each sequence (its last); returns logits `[B, V]` (evaluated)."""
        return self._evaluated(self.forward([(s, 1) for s in seqs]))

    def _evaluated(self, logits: mx.array) -> mx.array:
        mx.eval(logits, self.kv_cache.arrays)  # every pool array (a QuantizedPool is not an array)
        return logits
