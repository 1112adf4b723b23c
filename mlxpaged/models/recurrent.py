"""Recurrent layers (gated DeltaNet, Mamba-2, short convolutions) of hybrid models in the packed step.

mlx-lm's hybrid families (qwen3_next, qwen3_5, qwen3_5_moe, lfm2, granitemoehybrid) keep each
recurrent layer's state in an `ArraysCache` (a convolution window, and for DeltaNet and Mamba a
recurrent state, one batch row per sequence) beside the attention layers' KV caches. The paged
step feeds T packed tokens as T rows of one token, which a recurrent layer would read as T
sequences without history. So for one pass each recurrent decoder layer is replaced (the
adapter's `_swapped`) by a `SegmentedLayer` that runs mlx-lm's own layer on each sequence's run:

- the entries decoding one token from a known state go in one call, `[B, 1, D]`, with their
  states stacked into one `ArraysCache` (the usual decode step: one call per layer);
- each other entry (a prefill chunk) is one call `[1, L, D]` from its state (None: a fresh
  sequence, which mlx-lm's layer starts from zeros); a chunk that crosses a block boundary where
  the state is wanted (`StepStates.splits`, prefix caching) is two calls, the state between them kept.

mlx-lm's layer does the work (its Metal kernel and pure-ops fallback: `gated_delta.py`,
`ssm.py`); this module only cuts and reassembles rows. A state is a tuple of arrays per
recurrent layer; arrays are immutable, so two sequences share one state until either runs
(forks copy a reference, nothing is copied on the device).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

# A sequence's state: per recurrent layer (in layer order), the arrays of its ArraysCache, each
# with a leading batch axis of 1 (mlx-lm's layout). None for a layer: not yet run (zeros).
LayerState = tuple


@dataclass
class StepStates:
    """The recurrent states one pass reads and writes, per entry of the step's batch.

    Invariant: `before[e]` is entry e's state after its first `start` tokens (None: no tokens
    yet); after the pass `after[e]` is its state after all its q_lens[e] tokens, and `at_split[e]`
    its state after its first `splits[e]` new tokens (when a split was asked). For an entry in
    `every` (a speculating one: rejected proposals roll back), `each[e][t]` is its state after its
    first t + 1 new tokens.
    """

    q_lens: list[int]  # [S] new tokens of each entry
    before: list[list | None]  # [S] per entry: per recurrent layer, a LayerState or None
    splits: list[int | None]  # [S] per entry: new tokens after which to keep the state, or None
    every: frozenset = frozenset()  # entries that keep their state after every token
    after: list[list] = field(default_factory=list)  # filled by the pass
    at_split: list[list | None] = field(default_factory=list)
    each: list[list | None] = field(default_factory=list)

    def __post_init__(self):
        n = len(self.q_lens)
        self.after = [[] for _ in range(n)]
        self.at_split = [[] if s else None for s in self.splits]
        self.each = [[[] for _ in range(self.q_lens[e])] if e in self.every else None for e in range(n)]

    @classmethod
    def fresh(cls, q_lens: list[int], num_layers: int) -> StepStates:
        """Every entry starts empty and keeps nothing (a one-off pass, e.g. key calibration)."""
        return cls(q_lens, [[None] * num_layers for _ in q_lens], [None] * len(q_lens))


class Row:
    """Row `i` of one decode call's batched state (`arrays`, each `[B, ...]`): the next decode of
    the same sequences, in the same order, takes the batched arrays as they are (no copy)."""

    __slots__ = ("arrays", "i")

    def __init__(self, arrays: tuple, i: int):
        self.arrays, self.i = arrays, i

    def own(self) -> tuple:
        return tuple(a[self.i : self.i + 1] for a in self.arrays)


def own(state) -> tuple | None:
    """A LayerState as its own arrays (a `Row` sliced out of its batch)."""
    return state.own() if isinstance(state, Row) else state


def _stacked(states: list) -> list:
    """One decode call's batched state from its entries' states: a whole earlier batch in order
    is reused as it is; anything else is concatenated row by row."""
    first = states[0]
    if (
        isinstance(first, Row)
        and first.arrays[0].shape[0] == len(states)
        and all(isinstance(r, Row) and r.arrays is first.arrays and r.i == i for i, r in enumerate(states))
    ):
        return list(first.arrays)
    return [mx.concatenate(a) for a in zip(*(own(r) for r in states))]


def _cache(size: int, arrays, layer: nn.Module) -> object:
    """The layer's state as the cache class its library's layers read (mlx-vlm's has more)."""
    if type(layer).__module__.startswith("mlx_vlm."):
        from mlx_vlm.models.cache import ArraysCache
    else:
        from mlx_lm.models.cache import ArraysCache

    c = ArraysCache(size)
    if arrays is not None:
        c.cache = list(arrays)
    return c


class SegmentedLayer:
    """One pass's stand-in for recurrent decoder layer `k` (the k-th recurrent layer): a plain
    callable, with the wrapped layer's attributes (`is_linear`, `layer_type`) for the model's loop.

    The model's loop calls it as it calls the layer (`layer(h, mask=m, cache=c)`, mamba's
    `layer(h, c)`, rwkv7's `layer(h, v_first, c)`): the argument named `cache` in the layer's
    signature becomes the entry's `ArraysCache`, one named `mask` becomes None (a run is one
    sequence, causal by construction), and every array with a row per packed token (`h`,
    rwkv7's `v_first`) is cut into the entries' runs as `h` is; an array result (or each array of a
    tuple result) is put back into packed rows.
    """

    __slots__ = ("layer", "k", "size", "states", "params")

    def __init__(self, layer: nn.Module, k: int, size: int, states: StepStates):
        self.layer, self.k, self.size, self.states = layer, k, size, states
        self.params = call_params(type(layer))

    def __getattr__(self, name):
        return getattr(self.layer, name)

    def _bind(self, args: tuple, kwargs: dict) -> tuple[list, dict, int]:
        """The call's arguments by name, the names of those with a row per packed token, and T."""
        named = dict(zip(self.params, args), **kwargs)
        T = named[self.params[0]].shape[0]  # the hidden rows: the first argument (Falcon-H1's by name)
        # per-row: the hidden rows `[T, 1, ...]`, and an `offset` of one position per row (bailing's
        # linear attention rotates by the attention cache's offset: a run gets its first position)
        rows = [
            n
            for n, v in named.items()
            if isinstance(v, mx.array)
            and n != "mask"
            and (v.shape[:2] == (T, 1) or (n == "offset" and v.shape == (T,)))
        ]
        return rows, named, T

    def _run(self, named: dict, rows: list, pick, state) -> tuple[object, tuple]:
        """mlx-lm's layer on the rows `pick(a)` of each per-row argument, from `state` (a
        LayerState or None) -> (its result, new state)."""
        c = _cache(self.size, state, self.layer)
        call = {n: (pick(v) if n in rows else v) for n, v in named.items()}
        call["cache"] = c
        if "mask" in call:
            call["mask"] = None
        return self.layer(**call), tuple(c.cache)

    def __call__(self, *args, **kwargs):
        st, k = self.states, self.k
        q = st.q_lens
        rows, named, T = self._bind(args, kwargs)
        # one token from a known state (a split there is the state after it: no second call)
        decodes = [e for e, n in enumerate(q) if n == 1 and st.before[e][k] is not None and e not in st.every]
        if decodes:  # batched only with states of one shape (a young n-gram context is shorter): others one by one
            first = _shapes(st.before[decodes[0]][k])
            decodes = [e for e in decodes if _shapes(st.before[e][k]) == first]
        pieces, index = [], []  # results, each with its rows' leading axis, and the packed row of each row
        starts = [0]
        for n in q:
            starts.append(starts[-1] + n)
        if decodes:
            if len(decodes) == len(q):
                pick = lambda a: a  # noqa: E731 - every entry: the rows as they are, [B, 1, D]
            else:
                at = mx.array([starts[e] for e in decodes])
                pick = lambda a: a[at]  # noqa: E731
            y, new = self._run(named, rows, pick, _stacked([st.before[e][k] for e in decodes]))
            for i, e in enumerate(decodes):
                st.after[e].append(Row(new, i))
                if st.splits[e]:
                    # a copy: a view would keep the whole batch's buffer alive in the checkpoints
                    st.at_split[e].append(tuple(a[i : i + 1] + 0 for a in new))
            if len(decodes) == len(q):
                return y
            pieces.append(_map(y, lambda a: a[:, 0]))
            index += [starts[e] for e in decodes]
        self._every_token(named, rows, starts, pieces, index)
        taken = set(decodes) | st.every
        for e, n in enumerate(q):
            if e in taken:
                continue
            a0 = starts[e]
            state = own(st.before[e][k])
            s = st.splits[e]
            if s and 0 < s < n:
                y1, state = self._run(named, rows, _run_of(a0, a0 + s), state)
                st.at_split[e].append(state)
                y2, state = self._run(named, rows, _run_of(a0 + s, a0 + n), state)
                y = _map2(y1, y2, lambda u, v: mx.concatenate([u, v], axis=1))
            else:
                y, state = self._run(named, rows, _run_of(a0, a0 + n), state)
                if s:  # the split falls at the chunk's end: the state after it
                    st.at_split[e].append(state)
            st.after[e].append(state)
            pieces.append(_map(y, lambda a: a[0]))
            index += range(a0, a0 + n)
        perm = None
        if index != list(range(len(index))):
            perm = [0] * len(index)
            for j, row in enumerate(index):
                perm[row] = j
            perm = mx.array(perm)

        def packed(*parts):  # [T, ...] in `index` order -> packed order, [T, 1, ...]
            out = mx.concatenate(parts) if len(parts) > 1 else parts[0]
            return (out if perm is None else out[perm])[:, None]

        return _mapn(pieces, packed)

    def _every_token(self, named: dict, rows: list, starts: list, pieces: list, index: list) -> None:
        """The `every` entries one position at a time, all of them in one call per position,
        keeping each one's state after each token (`StepStates.each`)."""
        st, k = self.states, self.k
        cur = {e: st.before[e][k] for e in st.every}
        assert all(s is not None for s in cur.values()), "a speculating sequence has a state"
        for t in range(max((st.q_lens[e] for e in st.every), default=0)):
            members = [e for e in sorted(st.every) if st.q_lens[e] > t]
            at = [starts[e] + t for e in members]
            sel = mx.array(at)
            y, new = self._run(named, rows, lambda a, sel=sel: a[sel], _stacked([cur[e] for e in members]))
            for i, e in enumerate(members):
                cur[e] = Row(new, i)
                st.each[e][t].append(cur[e])
            pieces.append(_map(y, lambda a: a[:, 0]))
            index += at
        for e in st.every:
            st.after[e].append(cur[e])


def _shapes(state) -> tuple:
    """A LayerState's arrays' shapes without their batch axis."""
    arrays = state.arrays if isinstance(state, Row) else state
    return tuple(None if a is None else a.shape[1:] for a in arrays)


def _run_of(a: int, b: int):
    """The rows a..b of a per-row argument `[T, 1, ...]` as one sequence's run `[1, b - a, ...]`
    (of a per-row position `[T]`: the run's first)."""
    return lambda x: x[a:b].swapaxes(0, 1) if x.ndim > 1 else x[a]


def _map(y, f):
    """`f` on an array result, or on each array of a tuple result (None stays None)."""
    if isinstance(y, tuple):
        return tuple(None if a is None else f(a) for a in y)
    return f(y)


def _map2(y1, y2, f):
    if isinstance(y1, tuple):
        return tuple(None if a is None else f(a, b) for a, b in zip(y1, y2))
    return f(y1, y2)


def _mapn(pieces: list, f):
    """`f` over the same position of every piece (arrays, or tuples of arrays)."""
    if isinstance(pieces[0], tuple):
        return tuple(None if parts[0] is None else f(*parts) for parts in zip(*pieces))
    return f(*pieces)


_signatures: dict = {}


def call_params(cls) -> list[str]:
    """The names of `cls.__call__`'s parameters, without self, read once per class."""
    if cls not in _signatures:
        import inspect

        _signatures[cls] = list(inspect.signature(cls.__call__).parameters)[1:]
    return _signatures[cls]


def state_nbytes(state: list) -> int:
    """Bytes of one sequence's recurrent state (every layer)."""
    return sum(a.nbytes for layer in state if layer is not None for a in own(layer) if a is not None)
