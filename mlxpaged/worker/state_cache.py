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
it), and `has` reads one back on a memory miss. A file is safetensors (read with `mx.load`, no
pickle) whose metadata holds this format's version, the block hash and a CRC-32 of the tensor
data; it is opened as the block files are (`prefix_store.read_own`: a regular file of this
user, never a symlink, FIFO or device) and written 0600 in a 0700 directory. A file whose
version, hash, checksum, array names, shapes or dtypes (every dimension, against `state_spec`)
are wrong is deleted with one warning and counts as a miss: the prefix is recomputed. The newest
`MAX_FILES` are kept.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import stat
import zlib
from collections import OrderedDict
from pathlib import Path

from ..core.sequence import Sequence
from ..models.recurrent import StepStates, own, state_nbytes
from .prefix_store import UnsafeFile, _atomic_write, private_dir, read_own

# Recurrent-state checkpoints kept for prefix hits: this many states, at most CHECKPOINT_BYTES.
CHECKPOINTS = 64
CHECKPOINT_BYTES = 1 << 30


def state_spec(model) -> list[tuple]:
    """One sequence's recurrent state as it must be: per recurrent layer (in layer order), the
    (shape, dtype) of each array of its ArraysCache (None: an array left unset). mlx-lm's own model
    and `make_prompt_cache` run 16 tokens, and its ArraysCaches are measured."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, CacheList, make_prompt_cache

    caches = make_prompt_cache(model)
    # only the graph: shapes need no evaluation; 16 tokens, so a state that grows with the first
    # tokens (an n-gram embedding's last tokens) has its steady shape
    model(mx.zeros((1, 16), dtype=mx.int32), cache=caches)
    entries = [x for c in caches for x in (c.caches if type(c) is CacheList else [c])]  # Falcon-H1: two a layer
    return [
        tuple(None if a is None else (tuple(a.shape), a.dtype) for a in c.cache)
        for c in entries
        if isinstance(c, ArraysCache)
    ]


def spec_nbytes(spec: list[tuple]) -> int:
    return sum(math.prod(s[0]) * s[1].size for layer in spec for s in layer if s is not None)


MAX_FILES = 256  # state checkpoint files kept on disk, newest first
STATE_FORMAT = "1"  # the `format` in a state file's metadata; a file without it is an older version's
_HEADER_MAX = 1 << 20  # a state file's safetensors header: its JSON, a few hundred bytes per array
log = logging.getLogger("mlxpaged.state_cache")


def _show(spec) -> str:
    return "nothing" if spec is None else f"shape {list(spec[0])} {str(spec[1]).rsplit('.', 1)[-1]}"


class StateLost(RuntimeError):
    """A sequence was scheduled from a point where no recurrent state is kept (a bug, not bad input)."""


class Checkpoints:
    """Recurrent states after full blocks, by block hash; oldest evicted beyond `cap_bytes`.

    Invariant: `nbytes` is the sum of the kept states' bytes, and at most `cap_bytes` after a `put`
    (a single state larger than the cap is not kept).
    """

    def __init__(self, cap_bytes: int, spec: list[tuple], block_size: int, disk: Path | None = None):
        self.cap_bytes = cap_bytes
        self.spec = spec  # `state_spec`: what a state read from disk must be, array by array
        self.num_layers = len(spec)
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
        if self.disk is None:
            return False
        path = self._path(block_hash)
        try:
            blob = read_own(path, spec_nbytes(self.spec) + _HEADER_MAX)
        except FileNotFoundError:
            return False
        except UnsafeFile as e:
            self._bad_file(path, str(e))
            return False
        except OSError as e:
            log.warning("cannot read state checkpoint %s (%s); the prefix is recomputed", path.name, e.strerror or e)
            return False
        try:
            state = self._decode(blob, block_hash)
        except Exception as e:  # any file that is not this model's state is a miss, never a failed request
            self._bad_file(path, str(e).splitlines()[0][:160] if str(e) else type(e).__name__)
            return False
        self.disk_reads += 1
        self.put(block_hash, state)
        return block_hash in self.states

    def _bad_file(self, path: Path, why: str) -> None:
        self.bad_files += 1
        log.warning("state checkpoint %s %s: deleted, the prefix is recomputed", path.name, why)
        try:
            os.unlink(path)
        except OSError:
            pass

    def _mismatch(self, state: list) -> str | None:
        """Why `state` is not one sequence's state of this model (`spec`), or None if it is."""
        if len(state) != len(self.spec):
            return f"has {len(state)} recurrent layers, not {len(self.spec)}"
        for k, (layer, want) in enumerate(zip(state, self.spec)):
            arrays = own(layer) if layer is not None else ()
            if len(arrays) != len(want):
                return f"has {len(arrays)} arrays in layer {k}, not {len(want)}"
            for j, (a, w) in enumerate(zip(arrays, want)):
                got = None if a is None else (tuple(a.shape), a.dtype)
                if got != w:
                    return f"has array {k}.{j} of {_show(got)}, not {_show(w)}"
        return None

    def _encode(self, block_hash: bytes, state: list) -> bytes:
        """The state as a safetensors file whose metadata holds the format, the block hash and the
        CRC-32 of the tensor data (mlx writes the data; the header is written again with the CRC)."""
        import mlx.core as mx

        arrays = {f"{k}.{j}": a for k, layer in enumerate(state) for j, a in enumerate(own(layer)) if a is not None}
        buf = io.BytesIO()
        mx.save_safetensors(buf, arrays, metadata={"format": STATE_FORMAT, "block_hash": block_hash.hex()})
        blob = buf.getvalue()
        n = int.from_bytes(blob[:8], "little")
        header, data = json.loads(blob[8 : 8 + n]), blob[8 + n :]
        header["__metadata__"]["crc32"] = f"{zlib.crc32(data):08x}"
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # safetensors pads its header to 8 bytes
        return len(head).to_bytes(8, "little") + head + data

    def _decode(self, blob: bytes, block_hash: bytes) -> list:
        """The state a file holds; ValueError naming what is wrong with it."""
        import mlx.core as mx

        n = int.from_bytes(blob[:8], "little") if len(blob) >= 8 else -1
        if n < 2 or n > min(_HEADER_MAX, len(blob) - 8):
            raise ValueError("is truncated or not safetensors")
        if len(blob) > spec_nbytes(self.spec) + 8 + n:
            raise ValueError("is larger than a state of this model")
        header = json.loads(blob[8 : 8 + n])
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        meta = meta if isinstance(meta, dict) else {}
        if meta.get("format") != STATE_FORMAT:
            raise ValueError("is not a state file of this version")
        if meta.get("block_hash") != block_hash.hex():
            raise ValueError("belongs to another block")
        if meta.get("crc32") != f"{zlib.crc32(blob[8 + n :]):08x}":
            raise ValueError("fails its checksum")
        arrays = mx.load(io.BytesIO(blob), format="safetensors")
        mx.eval(list(arrays.values()))
        state = [tuple(arrays.pop(f"{k}.{j}", None) for j in range(len(layer))) for k, layer in enumerate(self.spec)]
        if arrays:
            raise ValueError(f"holds arrays of no layer ({', '.join(sorted(arrays)[:3])})")
        why = self._mismatch(state)
        if why is not None:
            raise ValueError(why)
        return state

    def _stored(self, block_hash: bytes) -> bool:
        """Whether this user's regular file holds the block's state (anything else is replaced)."""
        try:
            st = os.lstat(self._path(block_hash))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()

    def _write(self, block_hash: bytes, state: list) -> None:
        if self._mismatch(state) is not None:
            return  # not the shape a read would accept (never expected): a miss later, not a bad file
        try:
            private_dir(self.disk)
            _atomic_write(self._path(block_hash), self._encode(block_hash, state))
            files = []
            for p in self.disk.glob("*.safetensors"):
                try:
                    files.append((os.lstat(p).st_mtime_ns, p))
                except OSError:
                    pass
            for _, old in sorted(files)[:-MAX_FILES]:
                old.unlink(missing_ok=True)
        except (OSError, UnsafeFile) as e:
            log.warning("cannot write a state checkpoint under %s (%s); serving goes on", self.disk, e)

    def get(self, block_hash: bytes) -> list | None:
        got = self.states.get(block_hash)
        if got is None:
            return None
        self.states.move_to_end(block_hash)
        self.hits += 1
        return got[0]

    def put(self, block_hash: bytes, state: list, to_disk: bool = False) -> None:
        if to_disk and self.disk is not None and not self._stored(block_hash):
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
