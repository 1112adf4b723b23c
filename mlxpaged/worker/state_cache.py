"""A hybrid model's recurrent states beside the paged KV: per-sequence states and prefix checkpoints.

A sequence's state (every recurrent layer's `ArraysCache` arrays after its first n tokens) lives
on the sequence (`Sequence.state`), like its block table: the block manager copies it with a
fork and drops it with the blocks; the runner replaces it after each pass (`states_for`,
`keep_states`). States are immutable MLX arrays, so a fork shares its parent's until either runs.

Prefix caching needs the state where a hit ends: `Checkpoints` keeps the state after a full
block, under that block's chained hash (vLLM's "align" mode, vllm-metal's per-block state). The
runner asks for one per pass at the last block boundary each prefill chunk or decode crosses;
it is taken when the block is named (hashing waits for token values), and the block manager
takes a hit only up to a block whose checkpoint is kept. Checkpoints are evicted oldest first
beyond `cap_bytes`: an evicted one only shortens later hits.
"""

from __future__ import annotations

from collections import OrderedDict

from ..core.sequence import Sequence
from ..models.recurrent import StepStates, state_nbytes

# Recurrent-state checkpoints kept for prefix hits: this many states, at most CHECKPOINT_BYTES.
CHECKPOINTS = 64
CHECKPOINT_BYTES = 1 << 30


def state_bytes_per_sequence(model) -> int:
    """Bytes of one sequence's recurrent state, every layer: mlx-lm's own model and
    `make_prompt_cache` run one token, and its ArraysCaches are measured."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    caches = make_prompt_cache(model)
    model(mx.array([[0]], dtype=mx.int32), cache=caches)  # only the graph: shapes need no evaluation
    return sum(a.nbytes for c in caches if isinstance(c, ArraysCache) for a in c.cache if a is not None)


class StateLost(RuntimeError):
    """A sequence was scheduled from a point where no recurrent state is kept (a bug, not bad input)."""


class Checkpoints:
    """Recurrent states after full blocks, by block hash; oldest evicted beyond `cap_bytes`.

    Invariant: `nbytes` is the sum of the kept states' bytes, and at most `cap_bytes` after a `put`
    (a single state larger than the cap is not kept).
    """

    def __init__(self, cap_bytes: int):
        self.cap_bytes = cap_bytes
        self.states: OrderedDict[bytes, tuple[list, int]] = OrderedDict()
        self.nbytes = 0
        self.pending: list[tuple[Sequence, int, list]] = []  # (sequence, block index, state) to name
        self.hits = 0
        self.evicted = 0

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self.states

    def get(self, block_hash: bytes) -> list | None:
        got = self.states.get(block_hash)
        if got is None:
            return None
        self.states.move_to_end(block_hash)
        self.hits += 1
        return got[0]

    def put(self, block_hash: bytes, state: list) -> None:
        if block_hash in self.states:
            self.states.move_to_end(block_hash)
            return
        n = state_nbytes(state)
        if n > self.cap_bytes:
            return
        self.states[block_hash] = (state, n)
        self.nbytes += n
        while self.nbytes > self.cap_bytes:
            _, (_, m) = self.states.popitem(last=False)
            self.nbytes -= m
            self.evicted += 1

    def resolve(self) -> None:
        """Name the pending states whose blocks got their hash; drop those of freed sequences."""
        keep = []
        for seq, i, state in self.pending:
            if len(seq.block_hashes) > i:
                self.put(seq.block_hashes[i], state)
            elif seq.block_table and seq.finish_reason is None:
                keep.append((seq, i, state))
        self.pending = keep


def states_for(
    batch: list[tuple[Sequence, int]], num_layers: int, block_size: int, checkpoints: Checkpoints | None
) -> StepStates:
    """The pass's `StepStates` for `batch` ((sequence, new tokens) entries): each entry resumes
    from its own state, a checkpoint (after a prefix hit), or nothing (its first tokens); with
    checkpoints on, each entry keeps the state at the last block boundary its tokens reach."""
    before, splits = [], []
    for seq, n in batch:
        start = seq.num_computed_tokens
        if start == 0:
            state = [None] * num_layers
        elif seq.state is not None and seq.state[0] == start:
            state = seq.state[1]
        else:
            state = None
            if checkpoints is not None and start % block_size == 0 and len(seq.block_hashes) >= start // block_size:
                state = checkpoints.get(seq.block_hashes[start // block_size - 1])
            if state is None:
                raise StateLost(f"no recurrent state for a sequence resuming at token {start}")
        before.append(state)
        end = start + n
        boundary = end - end % block_size
        splits.append(boundary - start if checkpoints is not None and boundary > start else None)
    return StepStates([n for _, n in batch], before, splits)


def keep_states(
    batch: list[tuple[Sequence, int]], states: StepStates, block_size: int, checkpoints: Checkpoints | None
) -> None:
    """After the pass is built: each sequence's new state, and its checkpoint to name later."""
    for (seq, n), after, at_split, split in zip(batch, states.after, states.at_split, states.splits):
        seq.state = (seq.num_computed_tokens + n, after)
        if checkpoints is not None and split:
            checkpoints.pending.append((seq, (seq.num_computed_tokens + split) // block_size - 1, at_split))
