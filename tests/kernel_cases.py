"""Decode-kernel cases for the emulator tests: inputs, the reference comparison, lane orders and the sweep."""

from __future__ import annotations

import itertools
import math
import os
import re

import mlx.core as mx
import numpy as np

import mlxpaged.metal_emu as emu
from mlxpaged.attention import metal
from mlxpaged.attention.reference import paged_attention_reference

MUTANT_CASE = dict(dtype="float32", head_dim=64, group=2, block_size=16, scattered=True, split=False)


ORDERS = ("forward", "reverse", "random:7")


def pairwise(factors: dict) -> list[dict]:
    """A small set of cases covering every pair of values of any two factors (greedy)."""
    names = list(factors)

    def pairs(c):
        return {((a, c[a]), (b, c[b])) for a, b in itertools.combinations(names, 2)}

    candidates = [dict(zip(names, vals)) for vals in itertools.product(*factors.values())]
    uncovered = set().union(*map(pairs, candidates))
    cases = []
    while uncovered:
        best = max(candidates, key=lambda c: len(pairs(c) & uncovered))
        uncovered -= pairs(best)
        cases.append(best)
    return cases


def sweep_cases() -> list[dict]:
    """Pairwise by default, the full product with MLXPAGED_FULL_SWEEP=1; each case then runs
    under every lane order."""
    if FULL_SWEEP:
        return [dict(zip(FACTORS, vals)) for vals in itertools.product(*FACTORS.values())]
    return pairwise(FACTORS)


def make_inputs(rng, *, dtype, head_dim, group, block_size, scattered, context_lens, num_kv_heads=2):
    """Random q and pool, and block tables in order or scattered over a larger pool.

    Table entries past each sequence's last block hold random block ids the kernel must ignore.
    """
    nblocks = [-(-n // block_size) for n in context_lens]
    max_blocks = max(nblocks) + 1
    pool = sum(nblocks) + 3
    ids = rng.permutation(pool) if scattered else np.arange(pool)
    tables = rng.integers(0, pool, size=(len(context_lens), max_blocks)).astype(np.int32)
    start = 0
    for i, n in enumerate(nblocks):
        tables[i, :n] = ids[start : start + n]
        start += n
    shape = (pool, num_kv_heads, block_size, head_dim)
    dt = DTYPES[dtype]
    return (
        mx.array(1.5 * rng.standard_normal((len(context_lens), num_kv_heads * group, head_dim)), dtype=dt),
        mx.array(rng.standard_normal(shape), dtype=dt),
        mx.array(rng.standard_normal(shape), dtype=dt),
        mx.array(tables),
        mx.array(np.array(context_lens, dtype=np.int32)),
    )


def mismatch(out: mx.array, ref: mx.array, dtype: str) -> float:
    """Largest |out - ref| / (atol + rtol |ref|): at most 1 passes; NaN never does."""
    atol, rtol = TOLERANCE[dtype]
    o, r = out.astype(mx.float32), ref.astype(mx.float32)
    return float(mx.max(mx.abs(o - r) / (atol + rtol * mx.abs(r))).item())


def run_case(c: dict, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    lens = context_lens_for(c)
    args = make_inputs(
        rng,
        dtype=c["dtype"],
        head_dim=c["head_dim"],
        group=c["group"],
        block_size=c["block_size"],
        scattered=c["scattered"],
        context_lens=lens,
    )
    if c.get("overlong"):  # the last sequence's length runs past its table row (and the buffer)
        args, ref_args = overlong(args, c["block_size"])
    else:
        ref_args = args
    scale = 1.0 / math.sqrt(c["head_dim"])
    if c["split"]:  # the planner's own choice must split this context
        part = metal.plan_partition_tokens(
            len(lens),
            args[1].shape[1],
            args[3].shape[1],
            c["block_size"],
            group=c["group"],
            head_dim=c["head_dim"],
            kv_row_bytes=metal.kv_row_bytes(args[1]),
            q_bytes=args[0].dtype.size,
        )
        assert part > 0, "planner did not split the long context"
    # single-pass cases force one pass; split ones take the planner's or the case's partitions
    part = c.get("partition_tokens") if c["split"] else 0
    out = metal.paged_attention_metal(*args, scale=scale, partition_tokens=part)
    ref = paged_attention_reference(*ref_args, scale)
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    return mismatch(out, ref, c["dtype"])


# Context lengths past the table's width (bad metadata): the kernel must clamp them.
CLAMP_CASE = dict(MUTANT_CASE, overlong=True)


def check_reads_only(launches: list[metal.Launch]):
    """The kernels wrote none of their inputs and hit no barrier after threads returned."""
    for launch in launches:
        kernel = metal._kernel(metal._metal_kernel_factory(), launch.kind, launch.variant)
        written = kernel.last_launch.bytes_written
        assert not any(written[n] for n in kernel.last_stats), written
        assert kernel.last_launch.barriers_with_exited_threads == 0


class FaultyFactory:
    """The emulator, except that kernel kind `kind` fails to build or returns wrong values."""

    def __init__(self, kind: str, how: str):
        self.kind, self.how = kind, how

    def __call__(self, **kernel_kwargs):
        real = emu.metal_kernel(**kernel_kwargs)
        if not kernel_kwargs["name"].startswith(self.kind + "_"):
            return real
        if self.how == "compile":
            raise emu.CompileError(
                "kernel.metal:12:3: error: simulated compiler failure\n"
                "kernel.metal:13:1: note: second line of the diagnostics"
            )

        def wrong(**call):
            outs = real(**call)
            return [outs[0] + 1.0] + outs[1:]

        return wrong


class Recording:
    """The emulator, recording the name MLX gives each kernel it runs (template values, input
    address spaces): a name not built at start-up would be built mid-serving on a Mac."""

    def __init__(self, refuse: str | None = None, after: int = 0, error: Exception | None = None):
        self.names: list[str] = []
        self.refuse, self.after, self.calls = refuse, after, 0
        self.error = error  # what a refused call raises (default: a Metal library build error)

    def __call__(self, **kernel_kwargs):
        k = emu.metal_kernel(**kernel_kwargs)

        def call(**c):
            if self.refuse and kernel_kwargs["name"].startswith(self.refuse):
                self.calls += 1
                if self.calls > self.after:
                    if self.error is not None:
                        raise self.error
                    raise RuntimeError(
                        "[metal::Device] Unable to build metal library from source\n"
                        "program_source:120:5: error: simulated Metal compiler error"
                    )
            outs = k(**c)
            self.names.append(re.search(r"\[\[kernel\]\] void (custom_kernel_\w+)\(", k.last_source).group(1))
            return outs

        return call


DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


# (atol, rtol) per dtype: the kernel and the reference both round an fp32 result to the dtype.
TOLERANCE = {"float16": (1e-3, 4e-3), "bfloat16": (8e-3, 2e-2), "float32": (1e-5, 1e-4)}


FULL_SWEEP = os.environ.get("MLXPAGED_FULL_SWEEP") == "1"


FACTORS = {
    "dtype": tuple(DTYPES),
    "head_dim": (64, 128),
    "group": (1, 2, 6, 7),
    "block_size": (1, 2, 16, 64, 256),
    "scattered": (False, True),
    "split": (False, True),
}


def context_lens_for(c: dict) -> list[int]:
    """Ragged lengths: a single token, an exact block multiple, one a little past a block edge,
    and with `split` a long one that makes the planner partition the context (or a given
    `length`)."""
    bs = c["block_size"]
    lens = [1, 2 * bs, bs + 3]
    if c["split"]:
        size = DTYPES[c["dtype"]].size
        lens.append(c.get("length") or split_length(c["group"], c["head_dim"], bs, c["head_dim"] * size, size))
    return lens


def overlong(args, block_size: int):
    """The same inputs with each context length raised to past its table row: the kernel must
    clamp them to the row (whose blocks make_inputs fills), matching the reference on the
    clamped lengths, i.e. on every block of the row."""
    q, k, v, bt, cl = args
    full = bt.shape[1] * block_size
    bad = (q, k, v, bt, mx.full(cl.shape, full + 3 * block_size + 5, dtype=mx.int32))
    return bad, (q, k, v, bt, mx.full(cl.shape, full, dtype=mx.int32))


# Each mutant: (description, file, exact text in the real source, replacement, occurrence
# (None: the text must occur once), case).


def split_length(group: int, head_dim: int, block_size: int, kv_row_bytes: int, q_bytes: int) -> int:
    """A context the planner splits at this shape: two of its shortest partitions and then some."""
    return 2 * metal.min_partition_tokens(group, head_dim, kv_row_bytes, q_bytes) + 3 * block_size + 5
