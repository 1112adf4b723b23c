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

With the disk tier on, a prompt block's checkpoint is also written beside the tier's block files
(`<namespace>/states/<hash>.safetensors`, the same chained hash, so a later process resumes from
it), and `has` reads one back on a memory miss; a file that does not parse as this model's state
is deleted and counts as a miss. The newest `MAX_FILES` are kept.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from pathlib import Path

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


MAX_FILES = 256  # state checkpoint files kept on disk, newest first
log = logging.getLogger("mlxpaged.state_cache")


class StateLost(RuntimeError):
    """A sequence was scheduled from a point where no recurrent state is kept (a bug, not bad input)."""


class Checkpoints:
    """Recurrent states after full blocks, by block hash; oldest evicted beyond `cap_bytes`.

    Invariant: `nbytes` is the sum of the kept states' bytes, and at most `cap_bytes` after a `put`
    (a single state larger than the cap is not kept).
    """

    def __init__(self, cap_bytes: int, num_layers: int, block_size: int, disk: Path | None = None):
        self.cap_bytes = cap_bytes
        self.num_layers = num_layers
        self.block_size = block_size
        self.disk = disk  # the disk tier's directory for state files, or None
        self.states: OrderedDict[bytes, tuple[list, int]] = OrderedDict()
        self.nbytes = 0
        self.pending: list[tuple[Sequence, int, list]] = []  # (sequence, block index, state) to name
        self.hits = 0
        self.evicted = 0
        self.disk_reads = 0
        self.bad_files = 0

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self.states or self._read(block_hash)

    # -- the disk tier ---------------------------------------------------------------------------
    def _path(self, block_hash: bytes) -> Path:
        return self.disk / (block_hash.hex() + ".safetensors")

    def _read(self, block_hash: bytes) -> bool:
        """Load a checkpoint file into memory; False if there is none or it is not this model's."""
        import mlx.core as mx

        if self.disk is None:
            return False
        path = self._path(block_hash)
        if not path.is_file():
            return False
        try:
            arrays, meta = mx.load(str(path), return_metadata=True)
            sizes = json.loads(meta["sizes"])
            if len(sizes) != self.num_layers:
                raise ValueError(f"{len(sizes)} layers, not {self.num_layers}")
            state = []
            for k, n in enumerate(sizes):
                layer = tuple(arrays.get(f"{k}.{j}") for j in range(n))
                if any(a is not None and (a.ndim < 1 or a.shape[0] != 1) for a in layer):
                    raise ValueError("not one sequence's state")
                state.append(layer)
        except Exception as e:  # any unreadable file is a miss, never a failed request
            self.bad_files += 1
            log.warning("state checkpoint %s is unreadable (%s): deleted", path.name, str(e).splitlines()[0][:80])
            try:
                os.unlink(path)
            except OSError:
                pass
            return False
        self.disk_reads += 1
        self.put(block_hash, state)
        return block_hash in self.states

    def _write(self, block_hash: bytes, state: list) -> None:
        import mlx.core as mx

        try:
            self.disk.mkdir(parents=True, exist_ok=True)
            arrays = {f"{k}.{j}": a for k, layer in enumerate(state) for j, a in enumerate(layer) if a is not None}
            sizes = json.dumps([len(layer) for layer in state])
            tmp = self.disk / f".{block_hash.hex()}.{os.getpid()}.tmp.safetensors"
            mx.save_safetensors(str(tmp), arrays, metadata={"sizes": sizes})
            os.replace(tmp, self._path(block_hash))
            files = sorted(self.disk.glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns)
            for old in files[:-MAX_FILES]:
                old.unlink(missing_ok=True)
        except OSError as e:
            log.warning("cannot write a state checkpoint under %s (%s); serving goes on", self.disk, e)

    def get(self, block_hash: bytes) -> list | None:
        got = self.states.get(block_hash)
        if got is None:
            return None
        self.states.move_to_end(block_hash)
        self.hits += 1
        return got[0]

    def put(self, block_hash: bytes, state: list, to_disk: bool = False) -> None:
        if to_disk and self.disk is not None and not self._path(block_hash).exists():
            self._write(block_hash, state)
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
                # the disk tier keeps prompt blocks only (worker/prefix_store.py): their checkpoints too
                self.put(seq.block_hashes[i], state, to_disk=(i + 1) * self.block_size <= seq.num_prompt_tokens)
            elif seq.block_table and seq.finish_reason is None:
                keep.append((seq, i, state))
        self.pending = keep


def states_for(
    batch: list[tuple[Sequence, int]],
    num_layers: int,
    block_size: int,
    checkpoints: Checkpoints | None,
    every: frozenset = frozenset(),
) -> StepStates:
    """The pass's `StepStates` for `batch` ((sequence, new tokens) entries): each entry resumes
    from its own state, a checkpoint (after a prefix hit), or nothing (its first tokens); with
    checkpoints on, each entry keeps the state at the last block boundary its tokens reach.
    `every`: the speculating entries, which keep their state after each token (`keep_states`)."""
    before, splits = [], []
    for e, (seq, n) in enumerate(batch):
        start = seq.num_computed_tokens
        held = seq.state
        if start == 0:
            state = [None] * num_layers
        elif held is not None and held[0] == start:
            state = held[1]
        elif held is not None and held[2] is not None and held[2][0] < start < held[0]:
            base, each = held[2]  # a speculated run, rolled back to its accepted tokens
            state = each[start - base - 1]
        else:
            state = None
            if checkpoints is not None and start % block_size == 0 and len(seq.block_hashes) >= start // block_size:
                state = checkpoints.get(seq.block_hashes[start // block_size - 1])
            if state is None:
                raise StateLost(f"no recurrent state for a sequence resuming at token {start}")
        before.append(state)
        end = start + n
        boundary = end - end % block_size
        # a speculating entry takes no checkpoint: its tokens past the first may be rejected
        keep = checkpoints is not None and boundary > start and e not in every
        splits.append(boundary - start if keep else None)
    return StepStates([n for _, n in batch], before, splits, every)


def keep_states(
    batch: list[tuple[Sequence, int]], states: StepStates, block_size: int, checkpoints: Checkpoints | None
) -> None:
    """After the pass is built: each sequence's new state, and its checkpoint to name later."""
    for (seq, n), after, at_split, split, each in zip(batch, states.after, states.at_split, states.splits, states.each):
        start = seq.num_computed_tokens
        seq.state = (start + n, after, None if each is None else (start, each))
        if checkpoints is not None and split:
            checkpoints.pending.append((seq, (seq.num_computed_tokens + split) // block_size - 1, at_split))
