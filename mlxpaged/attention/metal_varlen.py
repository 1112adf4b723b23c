"""The varlen (prefill) Metal kernel `metal/paged_attention_varlen.metal`: launch planning and
the Python entry point.

Sequences with more than one new token are cut into tiles of TILE_TOKENS tokens; one
threadgroup runs per (tile, kv head). The tile -> (sequence, first token) map is built here on
the host from `cu_seqlens_q` (built from numpy by the model runner, so `tolist()` costs no
device sync). One-token sequences go to the decode kernel (`metal.py`), whose output rows are
scattered into the varlen kernel's output. Invariant: every output row is written by exactly
one of the two kernels.

Safe on an unseen Mac, as the decode kernels are: the first call of a shape family that has a
multi-token sequence checks the varlen kernel on a small case against the reference
(`check_varlen`, once per process); one that fails to build or run, or differs, gives one
warning and sends that family's calls to the reference (an error under `MLXPAGED_METAL=strict`
or `=emulate`). Decode-only calls never need it.

A sliding `window` or attention `sinks` are the decode kernels' inputs here too:
`window` the runtime int32 scalar of `metal.window_input` read under HAS_WINDOW (names end `_w`),
`sinks` the `[>= num_heads]` logits of `metal.sinks_input` read under HAS_SINKS (`_sk`); a tile
walks its keys from the first block its first query's window overlaps. A call with either checks
that flags' variant on its first use too (`check_varlen(..., window=, sinks=)`).

A quantized cache (`kv_quant.QuantizedPool` for k_cache and v_cache) runs kernel
`paged_attention_varlen_quant`: the same body over `PAV_QUANT_VIEWS` of its (data, scales,
biases) inputs, bits and group size in the name; each group is dequantized as it is staged.

On a float cache, shapes the 8x8 simdgroup_matrix path covers (`mma_fits`: head_dim <= 128)
run `paged_attention_varlen_mma` instead: the kernel is a function of the shape and cache type
alone, never of the context lengths. A quantized cache keeps the lanes-per-row kernel (the .metal
header already stages its groups as float for an MMA variant).

Launch limits: every plan runs at most MAX_THREADS = 256 threads per threadgroup (MLX
refuses a launch over the compiled pipeline's maxTotalThreadsPerThreadgroup, which can be under
1024), its registers (the emulator's estimate, scalars included) fit one core's register file
and its arrays the spill budget (`fits`); past that the G query heads are split over HS
threadgroups, each reading the tile's K/V rows once more.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .. import settings
from ..utils import cdiv
from . import metal
from .kv_quant import QuantizedPool

KERNEL = "paged_attention_varlen"
QUANT_KERNEL = f"{KERNEL}_quant"
MMA_KERNEL = f"{KERNEL}_mma"
INPUTS = [
    "q",
    "k_cache",
    "v_cache",
    "block_tables",
    "cu_seqlens_q",
    "context_lens",
    "tiles",
    "scale",
    "window",
    "sinks",
]
QUANT_INPUTS = ["q", *metal.QUANT_INPUTS, *INPUTS[3:]]
OUTPUTS = ["out"]
TILE_TOKENS = 16  # query tokens per threadgroup: each K/V row is read ceil(q_len / 16) times
MIN_THREADS = 32  # lanes per tile at least: more lanes per row cost log2(SP) shuffles per key
# Threads per threadgroup, at most. Metal allows 1024, but MLX refuses a launch over the compiled
# pipeline's maxTotalThreadsPerThreadgroup, which Apple's compiler lowers for register-heavy
# kernels (896 on an M2 Ultra, mlx-vlm#1799); 256 is within every pipeline's (MLX's steel
# attention runs 128). Past it the planner splits query heads over more threadgroups.
MAX_THREADS = 256
STAGE_BYTES = 8192  # threadgroup bytes for each of the staged K and V chunks
MAX_CHUNK_KEYS = 32  # bounds the per-row score registers
# MMA path: q and the output accumulator cost head_dim / 2 fp32 registers per lane, 64 at 128.
MMA_MAX_HEAD_DIM = 128
MMA_MIN_CHUNK_KEYS = 8  # whole 8-key fragments
MMA_ROW_PAD = 4  # floats of padding per staged MMA tile row (LD = HD + 4 in the kernel)
# A threadgroup's live registers must fit one GPU core's register file: about 208 KB on
# Apple7/8 GPUs (the smallest, so the bound holds on every Apple GPU). Threads x the
# emulator's register estimate (`registers`, 32-bit values per thread) x 4 bytes stays within
# it; a plan over it splits the G query heads over HS threadgroups (`head_splits`).
REGISTER_FILE_BYTES = 208 * 1024
# Thread-private arrays beyond this many 32-bit values per thread spill (the emulator's
# RegisterBudgetWarning); the planner splits heads rather than give a lane more query rows.
ARRAY_REGISTER_BUDGET = 128
MAX_HEAD_SPLITS = 64
# Thread-private scalars of each kernel (indices, positions, a 64-bit offset takes 2), as the
# emulator counts them (metal_emu/lower.py item 7: each declaration once): the lanes body 39,
# the quantized staging 7 more, the MMA body 48 (the window and the sink's denominator included,
# whatever the flags: the declarations are reached either way).
SCALAR_REGISTERS = {"paged_attention_varlen": 39, "paged_attention_varlen_quant": 46, "paged_attention_varlen_mma": 48}


@functools.cache
def kernel_sources(name: str = KERNEL) -> tuple[str, str]:
    """(header, body of section `name`) of the shipped `paged_attention_varlen.metal`."""
    text = metal._read_source("paged_attention_varlen.metal")
    parts = re.split(r"^// @kernel (\w+)\n", text, flags=re.M)
    sections = dict(zip(parts[1::2], parts[2::2]))
    if parts[1::2] != [KERNEL, MMA_KERNEL]:
        raise RuntimeError(
            f"paged_attention_varlen.metal must hold the sections `// @kernel "
            f"{KERNEL}` and `// @kernel {MMA_KERNEL}`, in that order"
        )
    return parts[0], sections[name].strip("\n") + "\n"


@dataclass(frozen=True)
class Plan:
    """Template values of one kernel variant (see the .metal file's header comment)."""

    head_dim: int
    block_size: int
    group: int
    chunk_keys: int  # KC
    simdgroups: int  # NSG
    lanes_per_row: int  # SP
    rows_per_group: int  # RPT

    quant: tuple[int, int] | None = None  # (BITS, GS) of a quantized cache
    mma: bool = False  # the simdgroup_matrix kernel (lanes_per_row, rows_per_group unused: 0)
    head_splits: int = 1  # HS: threadgroups the G query heads are split over
    window: bool = False  # HAS_WINDOW: the `window` scalar is read (the value is not in the name)
    sinks: bool = False  # HAS_SINKS: the `sinks` logits are read

    @property
    def variant(self) -> str:
        lanes = "" if self.mma else f"_sp{self.lanes_per_row}_rpt{self.rows_per_group}"
        return (
            f"hd{self.head_dim}_bs{self.block_size}_g{self.group}_tq{TILE_TOKENS}"
            f"_kc{self.chunk_keys}_nsg{self.simdgroups}_hs{self.head_splits}{lanes}"
            + (f"_q{self.quant[0]}_gs{self.quant[1]}" if self.quant else "")
            + ("_w" if self.window else "")
            + ("_sk" if self.sinks else "")
        )

    @property
    def threads(self) -> int:
        return 32 * self.simdgroups

    @property
    def array_registers(self) -> int:
        """32-bit values per thread in thread-private arrays, as the emulator counts them. MMA:
        the strip's q and output fragments (HD / 8 each), the chunk's score fragments (KC / 8)
        and a K and a V fragment, 2 values per lane each. Lanes: per query row of the lane its q
        and accumulator dims (2 * HD / SP), max, sum, position and a 64-bit offset; and the
        chunk's KC scores."""
        if self.mma:
            return 2 * (2 * (self.head_dim // 8) + self.chunk_keys // 8)
        dpt = self.head_dim // self.lanes_per_row
        return self.rows_per_group * (2 * dpt + 5) + self.chunk_keys

    @property
    def registers(self) -> int:
        """Live 32-bit values per thread as the emulator estimates them (`LaunchStats.registers`):
        the arrays and the kernel's scalars."""
        return self.array_registers + SCALAR_REGISTERS[self.kind]

    @property
    def register_file_bytes(self) -> int:
        """Bytes of registers a threadgroup holds: threads x registers x 4."""
        return 4 * self.threads * self.registers

    @property
    def kind(self) -> str:
        """The kernel (section and inputs) this plan runs."""
        if self.mma:
            return MMA_KERNEL  # a quantized cache never takes the MMA plan (varlen_launch)
        return QUANT_KERNEL if self.quant else KERNEL

    @property
    def staged_itemsize(self) -> int | None:
        """Bytes per staged K/V element: float for the MMA kernel, else None (the cache's T)."""
        return 4 if self.mma else None


def mma_fits(head_dim: int, group: int) -> bool:
    """Whether the simdgroup_matrix kernel covers this shape: whole 8x8 fragments, registers
    for q and the accumulator, one simdgroup per 8 tokens of each query head within MAX_THREADS
    once the heads are split over at most MAX_HEAD_SPLITS threadgroups. A function of the shape only."""
    heads = cdiv(group, MAX_HEAD_SPLITS)
    return head_dim % 8 == 0 and head_dim <= MMA_MAX_HEAD_DIM and heads * TILE_TOKENS // 8 * 32 <= MAX_THREADS


def fits(p: Plan) -> bool:
    """Whether a plan's threadgroup launches on every Mac: at most MAX_THREADS threads, its
    registers within REGISTER_FILE_BYTES, its arrays within ARRAY_REGISTER_BUDGET."""
    return (
        p.threads <= MAX_THREADS
        and p.register_file_bytes <= REGISTER_FILE_BYTES
        and p.array_registers <= ARRAY_REGISTER_BUDGET
    )


def plan(
    head_dim: int,
    block_size: int,
    group: int,
    itemsize: int,
    mma: bool | None = None,
    quant: tuple[int, int] | None = None,
) -> Plan:
    """`plan_split` with the fewest head splits (1, 2, 4, ...) that `fits`; `quant`: the
    (bits, group size) of a quantized cache, whose staging holds more scalars."""
    for hs in (1 << i for i in range(MAX_HEAD_SPLITS.bit_length())):
        p = dataclasses.replace(plan_split(head_dim, block_size, group, itemsize, mma, hs), quant=quant)
        if fits(p) or hs >= min(group, MAX_HEAD_SPLITS):
            return p
    return p


def plan_split(
    head_dim: int, block_size: int, group: int, itemsize: int, mma: bool | None = None, head_splits: int = 1
) -> Plan:
    """The plan of a threadgroup that takes GH = ceil(G / head_splits) query heads.

    The MMA kernel's plan where `mma_fits`: GH * TQ / 8 simdgroups, float staging, KC a power
    of two in [8, 32] whose float K (and V) rows fit in STAGE_BYTES.

    Otherwise lanes per query row (SP, a power of two <= 32): at least head_dim / 32, so a lane
    holds at most 32 dims of its row's query and accumulator (registers), and more while the
    tile has under MIN_THREADS lanes. Rows past MAX_THREADS / SP share lanes (RPT rows per lane group).
    Keys per chunk (KC): a power of two whose K (and V) rows fit in STAGE_BYTES. `mma=False`
    forces the lanes-per-row kernel (the quantized cache's path, and tests of it)."""
    if mma is None:
        mma = mma_fits(head_dim, group)
    gh = cdiv(group, head_splits)
    if mma:
        kc = MAX_CHUNK_KEYS
        while kc > MMA_MIN_CHUNK_KEYS and kc * head_dim * 4 > STAGE_BYTES:
            kc //= 2
        return Plan(head_dim, block_size, group, kc, gh * TILE_TOKENS // 8, 0, 0, mma=True, head_splits=head_splits)
    rows = TILE_TOKENS * gh
    sp = 1 << (cdiv(head_dim, 32) - 1).bit_length()  # head_dim is a multiple of 32: SP divides it
    while sp < 32 and rows * sp * 2 <= MIN_THREADS:
        sp *= 2
    rpt = cdiv(rows * sp, MAX_THREADS)
    nsg = cdiv(cdiv(rows, rpt) * sp, 32)
    kc = MAX_CHUNK_KEYS
    while kc > 1 and kc * head_dim * itemsize > STAGE_BYTES:
        kc //= 2
    return Plan(head_dim, block_size, group, kc, nsg, sp, rpt, head_splits=head_splits)


def threadgroup_bytes(p: Plan, itemsize: int) -> int:
    """Threadgroup memory of the kernel (mirrors its `threadgroup` arrays, 16-byte aligned)."""
    blocks = (p.chunk_keys + p.block_size - 2) // p.block_size + 1  # PAV_CHUNK_BLOCKS
    staged = p.staged_itemsize or itemsize
    row = p.head_dim + (MMA_ROW_PAD if p.mma else 0)
    sizes = (p.chunk_keys * row * staged,) * 2 + (4 * blocks,)
    return sum(cdiv(n, 16) * 16 for n in sizes)


def tile_map(cu: list[int]) -> list[tuple[int, int]]:
    """(sequence, first new token) of every tile: sequences with q_len > 1, TILE_TOKENS at a time."""
    return [
        (s, i) for s in range(len(cu) - 1) if cu[s + 1] - cu[s] > 1 for i in range(0, cu[s + 1] - cu[s], TILE_TOKENS)
    ]


@dataclass
class Launch:
    """One launch of the varlen kernel: its variant and the arguments of its call."""

    variant: str
    call: dict
    kind: str = KERNEL  # or QUANT_KERNEL

    @property
    def kernel_kwargs(self) -> dict:
        header, body = kernel_sources(MMA_KERNEL) if self.kind.startswith(MMA_KERNEL) else kernel_sources()
        quant = self.kind.endswith("_quant")
        return dict(
            name=f"{self.kind}_{self.variant}",
            input_names=list(QUANT_INPUTS if quant else INPUTS),
            output_names=list(OUTPUTS),
            source=("PAV_QUANT_VIEWS\n" + body) if quant else body,
            header=header,
        )

    @property
    def kernel(self):
        return _kernel(metal._metal_kernel_factory(), self.variant, self.kind)

    def run(self) -> mx.array:
        factory = metal._metal_kernel_factory()
        return metal.run_once_checked(
            lambda: _kernel(factory, self.variant, self.kind),
            (factory, self.kind, self.variant),
            self.call,
            f"{self.kind}_{self.variant}",
        )[0]


@functools.cache
def _kernel(factory, variant: str, kind: str = KERNEL):
    # Built once per variant and factory (native or emulated); template values are in the name.
    return factory(**Launch(variant, {}, kind).kernel_kwargs)


def launch_plan(
    head_dim: int,
    block_size: int,
    group: int,
    itemsize: int,
    quant: tuple[int, int] | None = None,
    window: bool = False,
    sinks: bool = False,
) -> Plan:
    """The plan a call with these shapes runs (`plan`, with the cache's quantization); `window`
    and `sinks`: the flags of a call with either (the flags change no size, only the name)."""
    # A quantized cache keeps the lanes-per-row kernel (its MMA variant is not tested yet); it
    # is staged as T all the same, so threadgroup memory is the float plan's.
    p = plan(head_dim, block_size, group, itemsize, mma=None if not quant else False, quant=quant)
    return dataclasses.replace(p, window=window, sinks=sinks)


def template(p: Plan, dtype) -> list[tuple]:
    """The kernel's template values for plan `p` and element type `dtype`."""
    lanes = [] if p.mma else [("SP", p.lanes_per_row), ("RPT", p.rows_per_group)]
    return (
        [
            ("T", dtype),
            ("HD", p.head_dim),
            ("BS", p.block_size),
            ("G", p.group),
            ("TQ", TILE_TOKENS),
            ("KC", p.chunk_keys),
            ("NSG", p.simdgroups),
            ("HS", p.head_splits),
        ]
        + lanes
        + [("HAS_WINDOW", int(p.window)), ("HAS_SINKS", int(p.sinks))]
        + ([("BITS", p.quant[0]), ("GS", p.quant[1])] if p.quant else [])
    )


def varlen_launch(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, tiles, scale: float, window=None, sinks=None
) -> Launch:
    """The launch covering `tiles` ([(sequence, first token)], non-empty); q in the cache dtype.
    `window`: None or a positive int; `sinks`: None or `[num_heads]` logits (as the decode
    kernels take them: `metal.window_input`, `metal.sinks_input`)."""
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    quant = metal.quant_params(k_cache)
    p = launch_plan(head_dim, block_size, group, k_cache.dtype.size, quant, bool(window), sinks is not None)
    threads = p.threads
    # Padding (never read) keeps every small input in the device address space, so the kernel
    # name, the one checked at start-up, is the same for any number of sequences and tiles.
    pad = metal.MIN_DEVICE_ELEMENTS
    tile_arr = metal._pad_to(mx.array(tiles, dtype=mx.int32), 0, cdiv(pad, 2))
    return Launch(
        p.variant,
        dict(
            inputs=[
                q,
                *metal._cache_inputs(k_cache, v_cache),
                metal.pad_table(block_tables),
                metal._pad_to(cu_seqlens_q.astype(mx.int32), 0, pad),
                metal._pad_to(context_lens.astype(mx.int32), 0, pad),
                tile_arr,
                mx.array(scale, dtype=mx.float32),
                metal.window_input(window),  # [] int32, read under HAS_WINDOW only
                metal.sinks_input(sinks, q.shape[1]),  # [>= num_heads] float32, under HAS_SINKS only
            ],
            template=template(p, q.dtype),
            grid=(threads * p.head_splits, num_kv_heads, len(tiles)),
            threadgroup=(threads, 1, 1),
            output_shapes=[q.shape],
            output_dtypes=[q.dtype],
            # Rows no tile writes (a sequence whose context is shorter than its new tokens, bad
            # metadata that only MLXPAGED_DEBUG=1 reports) read 0, never stale memory.
            init_value=0,
        ),
        p.kind,
    )


def paged_attention_varlen_metal(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, *, scale: float, window=None, sinks=None
) -> mx.array:
    """`mlxpaged.paged_attention_varlen` on the Metal kernels: [T, num_heads, head_dim], q's dtype.
    `window` (None or >= 1) and `sinks` (`[num_heads]`) as in `paged_attention`."""
    return run_with_launches(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=scale, window=window, sinks=sinks
    )[0]


def run_with_launches(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, *, scale: float, window=None, sinks=None
) -> tuple[mx.array, list]:
    """`paged_attention_varlen_metal`, also returning its launches: the varlen kernel's
    (`Launch`) and the decode kernel's (`metal.Launch`), both with the window and the sinks."""
    metal._check(q, k_cache, v_cache)
    cu = [int(x) for x in cu_seqlens_q.tolist()]
    if settings.debug():
        check_metadata(k_cache, block_tables, cu, context_lens, q.shape[0])
    k_cache, v_cache = metal._device_pool(k_cache), metal._device_pool(v_cache)
    out_dtype = q.dtype
    decode = [s for s in range(len(cu) - 1) if cu[s + 1] - cu[s] == 1]
    tiles = tile_map(cu)
    launches: list = []
    if len(decode) == len(cu) - 1:  # all decodes: q's rows are the sequences
        out, launches = metal.run_with_launches(
            q, k_cache, v_cache, block_tables, context_lens, scale=scale, window=window, sinks=sinks
        )
        return out, launches
    qc = q.astype(k_cache.dtype)  # one element type T for q, caches and output
    out = None
    if tiles:
        launches.append(
            varlen_launch(qc, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, tiles, scale, window, sinks)
        )
        out = launches[0].run()
    if decode:
        rows = mx.array([cu[s] for s in decode], dtype=mx.int32)
        seqs = mx.array(decode, dtype=mx.int32)
        dec, dec_launches = metal.run_with_launches(
            qc[rows], k_cache, v_cache, block_tables[seqs], context_lens[seqs], scale=scale, window=window, sinks=sinks
        )
        launches += dec_launches
        out = mx.zeros_like(qc) if out is None else out
        out[rows] = dec
    if out is None:  # no sequence has a new token
        out = mx.zeros_like(qc)
    return out.astype(out_dtype), launches


def check_metadata(k_cache, block_tables, cu: list[int], context_lens, num_rows: int) -> None:
    """`MLXPAGED_DEBUG=1`: the query offsets rise from 0 to the query's rows, every sequence's
    context holds its new tokens and fits its table row, and every block id in use names a
    block of the pool; else ValueError naming the first bad sequence (costs a device sync)."""
    num_blocks, _, bs, _ = k_cache.shape
    width = block_tables.shape[1]
    lens = [int(n) for n in context_lens.tolist()]
    rows = block_tables.tolist()
    if cu[0] != 0 or cu[-1] != num_rows:
        raise ValueError(
            f"paged_attention_varlen_metal: cu_seqlens_q runs from {cu[0]} to {cu[-1]}, not from 0 to "
            f"the query's {num_rows} rows"
        )
    for s, n in enumerate(lens):
        q_len = cu[s + 1] - cu[s]
        if q_len < 0:
            raise ValueError(f"paged_attention_varlen_metal: cu_seqlens_q falls at sequence {s}: {cu[s]} > {cu[s + 1]}")
        if n < q_len:
            raise ValueError(
                f"paged_attention_varlen_metal: context length {n} of sequence {s} is less than its {q_len} "
                f"new tokens (query rows {cu[s]}..{cu[s + 1] - 1})"
            )
        if n > width * bs:
            raise ValueError(
                f"paged_attention_varlen_metal: context length {n} of sequence {s} is over its block table "
                f"row's {width * bs} tokens ({width} blocks of {bs})"
            )
        for j, b in enumerate(rows[s][: cdiv(n, bs)]):
            if not 0 <= b < num_blocks:
                raise ValueError(
                    f"paged_attention_varlen_metal: block id {b} at block_tables[{s}, {j}] "
                    f"is outside the pool of {num_blocks} blocks"
                )


def check_varlen(group: int, k_cache, window: bool = False, sinks: bool = False) -> bool:
    """Check the varlen kernel of this shape family once per process: two prefill chunks (17 new
    tokens over 5 cached, so two tiles and a prefix; 3 over none) in a shuffled block table,
    against the reference (on the dequantized pools for a quantized cache). Verdicts are kept
    with the decode families' (`metal.reset_kernels` forgets both); see `metal.settle_check`.
    `window`, `sinks`: check the variant with those flags instead (window 3, inside a block of
    4 or more and across blocks of 1 or 2; random sinks), a verdict of its own."""
    from .reference import paged_attention_varlen_reference

    _, _, bs, hd = k_cache.shape
    quant = metal.quant_params(k_cache)
    flags = ("window",) * window + ("sinks",) * sinks
    key = metal.family_key(group, k_cache, varlen=True) + flags
    if key in metal._families:
        return metal._families[key]
    rng = np.random.default_rng(13)
    q_lens, prefixes = [17, 3], [5, 0]
    ctx = [n + p for n, p in zip(q_lens, prefixes)]
    widths = [cdiv(c, bs) for c in ctx]
    order = rng.permutation(sum(widths)).astype(np.int32)  # sequence 0's blocks, then sequence 1's
    tables = np.zeros((2, max(widths)), np.int32)
    tables[0, : widths[0]], tables[1, : widths[1]] = order[: widths[0]], order[widths[0] :]
    q = mx.array(rng.standard_normal((sum(q_lens), group, hd)), dtype=k_cache.dtype)
    pool = [mx.array(rng.standard_normal((sum(widths), 1, bs, hd)), dtype=k_cache.dtype) for _ in range(2)]
    if quant:
        pool = [QuantizedPool.quantize(p, *quant) for p in pool]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = (mx.array(tables), mx.array(cu), mx.array(np.array(ctx, np.int32)))
    win = 3 if window else None
    snk = mx.array(rng.normal(1.0, 1.5, group).astype(np.float32)) if sinks else None
    f32 = [metal.dequantized(p).astype(mx.float32) for p in pool]
    ref = paged_attention_varlen_reference(q.astype(mx.float32), *f32, *args, 0.3, None, win, snk)
    name = f"varlen {launch_plan(hd, bs, group, k_cache.dtype.size, quant, window, sinks).variant} {k_cache.dtype}"
    problem = metal.compare_to_reference(
        name,
        lambda: paged_attention_varlen_metal(q, *pool, *args, scale=0.3, window=win, sinks=snk),
        ref,
        k_cache.dtype,
    )
    metal._families[key] = ok = metal.settle_check(problem)
    if problem:
        metal._family_errors[key] = problem
    return ok


def varlen_usable(q, k_cache, cu_seqlens_q, window: int | None = None, sinks=None) -> bool:
    """Whether the Metal path may take this call: always when every sequence is a decode (the
    decode kernels, checked at engine start), else when this family's varlen kernel passed
    `check_varlen`, and so did its variant with the call's window and sinks flags, if any (a
    family that failed mid-serving fails for every flag: its plain check is False)."""
    cu = cu_seqlens_q.tolist()
    if all(b - a <= 1 for a, b in zip(cu, cu[1:])):
        return True
    group = q.shape[1] // k_cache.shape[1]
    if not check_varlen(group, k_cache):
        return False
    flags = dict(window=window is not None, sinks=sinks is not None)
    return not any(flags.values()) or check_varlen(group, k_cache, **flags)
