"""The Metal paged-attention kernel: source loading, launch planning and the Python entry point.

Kernel bodies live in `metal/paged_attention.metal` (one `// @kernel NAME` section each) with
their shared header `metal/paged_attention.h`. Kernels run through `mx.fast.metal_kernel` on an
Apple GPU, or through the MSL emulator (`mlxpaged.metal_emu`) elsewhere.

Short contexts take one pass (`paged_attention`). When there are too few (sequence, kv head)
pairs to fill the GPU, each context is split into partitions handled by separate threadgroups
(`paged_attention_partitioned`) whose partial results a second pass merges
(`paged_attention_merge`), flash-decoding style.

Invariants:
  * A fixed set of compiled kernels: names depend only on (dtype, head_dim, block size, G);
    the partition size is derived in the kernel, and inputs are padded so none has fewer than
    8 elements (MLX would pass it in the constant address space, under another kernel name).
    The first call for a shape family builds and runs all three kernels (`check_family`).
  * Safe on an unseen Mac: that first run is checked against the reference; a compile or
    launch error or a mismatch gives one warning and the reference path for that family
    (`MLXPAGED_METAL=strict` or `=emulate`: an error instead, `KernelCheckError`).
  * Bad metadata: the kernels clamp context lengths to the table's width; `MLXPAGED_DEBUG=1`
    checks lengths and block ids against the table and the pool (ValueError).
  * Registers per lane bounded (REGISTER_BUDGET): the G query heads of a kv head are split
    over 2, 4 or 8 groups of simdgroups when one simdgroup holding all of them would exceed it
    (`head_splits`; the kernels derive the same split from G and head_dim, no new name).
    Queries stay in threadgroup memory; each lane holds lane_dims(head_dim) dims (8 for
    power-of-two head_dims) of one token's row and its heads' accumulators, so a simdgroup
    scores step_tokens(head_dim) tokens at once (4 at head_dim 64, 2 at 128).
  * Quantized KV cache (`kv_quant.QuantizedPool` for k_cache and v_cache): kernels
    `paged_attention[_partitioned]_quant`, the float bodies reading K/V through
    `PA_QUANT_VIEWS` (bits and group size are template values in the name); each lane
    dequantizes its dims in registers, so the bytes read are the quantized rows'.
  * Sliding windows and sinks: `window` is a runtime int32 scalar input of the single pass and
    the split pass (0: none; no new name per window), which start at the first block the
    window overlaps; `sinks` an input of the single pass and the merge, read under template
    flag HAS_SINKS (names end `_sk`), folded once into each head's merged sum. The start-up
    check covers HAS_SINKS = 0; an `_sk` kernel that fails later falls back as any kernel does.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import settings
from ..utils import cdiv
from .kv_quant import KV_BITS, KV_GROUP_SIZES, QuantizedPool, row_bytes

SUPPORTED_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
NUM_SIMDGROUPS = 8  # simdgroups per threadgroup: 256 threads, enough loads in flight per group

# Split planning (`plan_partition_tokens`). Threadgroups to keep in flight: this many per GPU
# core (256-thread threadgroups; a core holds several, so loads of one hide another's math).
THREADGROUPS_PER_CORE = 4
# GPU cores when the device cannot say (Linux, the emulator, an MLX without device_info): a base
# M-series chip.
DEFAULT_GPU_CORES = 10
# GPU cores of the largest configuration of each Apple chip (binned parts have a few fewer),
# keyed by (generation, tier) as `mx.metal.device_info()["device_name"]` ("Apple M3 Max") names it.
GPU_CORES = {
    ("M1", ""): 8,
    ("M1", "Pro"): 16,
    ("M1", "Max"): 32,
    ("M1", "Ultra"): 64,
    ("M2", ""): 10,
    ("M2", "Pro"): 19,
    ("M2", "Max"): 38,
    ("M2", "Ultra"): 76,
    ("M3", ""): 10,
    ("M3", "Pro"): 18,
    ("M3", "Max"): 40,
    ("M3", "Ultra"): 80,
    ("M4", ""): 10,
    ("M4", "Pro"): 20,
    ("M4", "Max"): 40,
}
# An unknown chip by the last letter of its architecture ("applegpu_g15s"), as MLX's own
# sdpa_vector planning reads it: p phone/tablet, g base, s Max, d Ultra (c: Pro, we assume).
ARCH_SUFFIX_CORES = {"p": 6, "g": 10, "c": 18, "s": 40, "d": 80}
# Partitions are never shorter than this (the merge and the queries each partition re-reads
# would cost more than the parallelism buys) ...
MIN_PARTITION_TOKENS = 128
# ... nor so short that the bytes only the split reads (the partition's queries, its fp32
# partial output, max and sum through the merge) exceed this fraction of the K/V bytes it
# summarizes: the split path stays within 1.05x the minimum bytes, quantized caches included.
PARTIAL_BYTES_FRACTION = 0.03
MAX_PARTITIONS = 128  # bounds the partials' size
# Whatever the batch, contexts longer than twice this are split into partitions of at most
# this many tokens, so one long sequence among short ones is not left to one threadgroup per
# kv head (the short ones' partitions past their end return at once).
LONG_PARTITION_TOKENS = 2048
# Simdgroups of the merge pass's threadgroup: each folds every MERGE_SIMDGROUPS-th partition.
MERGE_SIMDGROUPS = 4
# Register bound (paged_attention.h PA_REGISTER_BUDGET, pa_lane_registers): live 32-bit values
# per lane for GH query heads of lane_dims(head_dim) dims each (their accumulators; the queries
# stay in threadgroup memory); Apple GPUs spill beyond about 128. A group needing more is split
# over 2, 4 or 8 groups of simdgroups (`head_splits`).
REGISTER_BUDGET = 128
# MLX passes inputs of fewer elements in the constant address space (another kernel name).
MIN_DEVICE_ELEMENTS = 8


class KernelCheckError(RuntimeError):
    """A kernel variant failed its startup check (compile, launch or a wrong result)."""


# The attribute naming the kernel on an exception its build or launch raised (run_once_checked).
KERNEL_ATTR = "mlxpaged_kernel"


# Kernel kind (a `// @kernel` section of paged_attention.metal) -> (input names, output names).
KERNEL_IO = {
    "paged_attention": (
        ["q", "k_cache", "v_cache", "block_tables", "context_lens", "scale", "window", "sinks"],
        ["out"],
    ),
    "paged_attention_partitioned": (
        ["q", "k_cache", "v_cache", "block_tables", "context_lens", "scale", "window"],
        ["part_out", "part_max", "part_sum"],
    ),
    "paged_attention_merge": (["part_out", "part_max", "part_sum", "sinks"], ["out"]),
}
# The quantized-cache kinds: each float kind's body over PA_QUANT_VIEWS of these inputs.
QUANT_INPUTS = ["k_data", "k_scales", "k_biases", "v_data", "v_scales", "v_biases"]
QUANT_KERNEL_IO = {
    f"{kind}_quant": (["q", *QUANT_INPUTS, *inputs[3:]], outputs)
    for kind, (inputs, outputs) in KERNEL_IO.items()
    if kind != "paged_attention_merge"
}


def _read_source(filename: str) -> str:
    """Text of a file in `metal/`: the checkout's beside this package when there is one (an
    editable install maps `mlxpaged.metal` to the checkout it was installed from, which need
    not be this one), else the installed package data."""
    local = Path(__file__).resolve().parents[2] / "metal" / filename
    if local.is_file():
        return local.read_text()
    return resources.files("mlxpaged.metal").joinpath(filename).read_text()


@functools.cache
def kernel_sources() -> tuple[str, dict[str, str]]:
    """(header, {kernel kind: body}) parsed from the shipped Metal sources."""
    header = _read_source("paged_attention.h")
    text = _read_source("paged_attention.metal")
    parts = re.split(r"^// @kernel (\w+)\n", text, flags=re.M)
    bodies = {parts[i]: parts[i + 1].strip("\n") + "\n" for i in range(1, len(parts), 2)}
    missing = set(KERNEL_IO) - set(bodies)
    if missing:
        raise RuntimeError(f"paged_attention.metal lacks kernel sections {sorted(missing)}")
    return header, bodies


def _metal_kernel_factory():
    """`mx.fast.metal_kernel` on a Mac, the MSL emulator when asked for or without Metal."""
    try:
        from mlxpaged.metal_emu import get_metal_kernel
    except ImportError:
        return mx.fast.metal_kernel
    return get_metal_kernel()


def kernel_kwargs(kind: str, variant: str) -> dict:
    """Keyword arguments of `metal_kernel(...)` for one kernel kind and variant name suffix."""
    header, bodies = kernel_sources()
    if kind in QUANT_KERNEL_IO:
        inputs, outputs = QUANT_KERNEL_IO[kind]
        source = "PA_QUANT_VIEWS\n" + bodies[kind[: -len("_quant")]]
    else:
        inputs, outputs = KERNEL_IO[kind]
        source = bodies[kind]
    return dict(
        name=f"{kind}_{variant}",
        input_names=list(inputs),
        output_names=list(outputs),
        source=source,
        header=header,
    )


@functools.cache
def _kernel(factory, kind: str, variant: str):
    # Built once per variant (and per factory: native or emulated); template values are in the name.
    return factory(**kernel_kwargs(kind, variant))


@dataclass
class Launch:
    """One kernel launch: which kernel variant, and the arguments of its call."""

    kind: str  # a `// @kernel` section of paged_attention.metal
    variant: str  # template values, e.g. "hd128_bs16_g6_nsg8"
    call: dict  # inputs, template, grid, threadgroup, output shapes/dtypes

    @property
    def kernel_kwargs(self) -> dict:
        return kernel_kwargs(self.kind, self.variant)

    def run(self) -> list[mx.array]:
        factory = _metal_kernel_factory()
        return run_once_checked(
            lambda: _kernel(factory, self.kind, self.variant),
            (factory, self.kind, self.variant),
            self.call,
            f"{self.kind}_{self.variant}",
        )


def run_once_checked(build, key: tuple, call: dict, kernel_name: str) -> list[mx.array]:
    """`build()(**call)`; the first launch of each MLX kernel name is evaluated at once, so that
    a Metal library build error (raised at evaluation on a Mac) reaches the caller's fallback.

    Whatever the build or the launch raises (MLX's launch-configuration errors are ValueError,
    its library build errors RuntimeError) leaves with `kernel_name` in attribute KERNEL_ATTR:
    the callers' fallback takes exactly the exceptions a kernel raised, never bad input."""
    try:
        outs = build()(**call)
        name = key + tuple((x.dtype, x.ndim == 0, x.size < MIN_DEVICE_ELEMENTS) for x in call["inputs"])
        if name not in _evaluated:
            mx.eval(outs)
            _evaluated.add(name)
    except Exception as e:
        setattr(e, KERNEL_ATTR, kernel_name)
        raise
    return outs


def failed_kernel(e: BaseException) -> str | None:
    """The kernel whose build or launch raised `e` (`run_once_checked`), None for other errors."""
    return getattr(e, KERNEL_ATTR, None)


@functools.lru_cache(maxsize=1)
def device_info() -> dict:
    """`mx.metal.device_info()` on a Mac (cached), {} where Metal is not available."""
    try:
        if not mx.metal.is_available():
            return {}
        info = getattr(mx.metal, "device_info", None)  # newer MLX: mx.device_info(mx.gpu)
        return dict(info() if info else mx.device_info(mx.gpu))
    except Exception:  # an MLX without device_info: plan with the defaults
        return {}


def gpu_cores(info: dict) -> int:
    """GPU cores of the device `info` (`device_info()`'s dict) describes: an explicit core
    count if MLX gives one, else by chip name (`GPU_CORES`), else by the architecture string's
    last letter (`ARCH_SUFFIX_CORES`), else DEFAULT_GPU_CORES."""
    for key in ("gpu_core_count", "num_gpu_cores", "gpu_cores"):
        if isinstance(info.get(key), int) and info[key] > 0:
            return info[key]
    m = re.search(r"\b(M\d+)(?: (Pro|Max|Ultra))?\b", str(info.get("device_name", "")))
    if m and (m[1], m[2] or "") in GPU_CORES:
        return GPU_CORES[(m[1], m[2] or "")]
    arch = str(info.get("architecture", ""))
    if arch[-1:] in ARCH_SUFFIX_CORES:
        return ARCH_SUFFIX_CORES[arch[-1]]
    return DEFAULT_GPU_CORES


def min_partition_tokens(group: int, head_dim: int, kv_row_bytes: int, q_bytes: int) -> int:
    """Shortest partition whose split-only bytes stay within PARTIAL_BYTES_FRACTION of its K/V
    bytes (and at least MIN_PARTITION_TOKENS). Per partition and kv head the split reads the G
    queries again (`q_bytes` each element), the merge reads G fp32 partial rows plus a max and
    a sum, and each simdgroup its uniform length and scale; the partition's K and V rows are
    2 * kv_row_bytes per token."""
    extra = group * (head_dim * (q_bytes + 4) + 8) + 8 * NUM_SIMDGROUPS
    return max(MIN_PARTITION_TOKENS, math.ceil(extra / (PARTIAL_BYTES_FRACTION * 2 * kv_row_bytes)))


def plan_partition_tokens(
    num_seqs: int,
    num_kv_heads: int,
    max_blocks: int,
    block_size: int,
    *,
    group: int = 1,
    head_dim: int = 128,
    kv_row_bytes: int | None = None,
    q_bytes: int = 2,
    device: dict | None = None,
) -> int:
    """Tokens per partition for the split path, or 0 for the single pass.

    The context bound is the block table's width, i.e. the longest context in the batch
    (reading `context_lens` would force a sync). The split aims at THREADGROUPS_PER_CORE
    threadgroups per GPU core of `device` (a `device_info()` dict; None: this machine's), and
    a context over 2 x LONG_PARTITION_TOKENS is split into partitions of at most that many
    tokens however many sequences there are. Partitions are never shorter than
    `min_partition_tokens` (the split's extra bytes within PARTIAL_BYTES_FRACTION of the K/V
    bytes: longer for many query heads per kv head or a quantized cache's small rows) and are
    whole blocks, so each starts on a block boundary. `kv_row_bytes` is one K (or V) row's bytes
    (default: head_dim float16 values), `q_bytes` a query element's.
    """
    ctx = max_blocks * block_size
    groups = num_seqs * num_kv_heads
    row = kv_row_bytes if kv_row_bytes is not None else 2 * head_dim
    shortest = min_partition_tokens(group, head_dim, row, q_bytes)
    target = gpu_cores(device_info() if device is None else device) * THREADGROUPS_PER_CORE
    fill = cdiv(target, groups)  # partitions per (sequence, kv head) to reach the target
    longest = max(LONG_PARTITION_TOKENS, shortest)
    long_parts = cdiv(ctx, longest) if ctx > 2 * longest else 1
    want = min(max(fill, long_parts), MAX_PARTITIONS, ctx // shortest)
    if want < 2:
        return 0
    part = cdiv(cdiv(ctx, want), block_size) * block_size
    return part if cdiv(ctx, part) >= 2 else 0


def quant_params(cache) -> tuple[int, int] | None:
    """(bits, group size) of a quantized pool, None for a float one."""
    return (cache.bits, cache.group_size) if isinstance(cache, QuantizedPool) else None


def _variant(head_dim: int, block_size: int, group: int, quant=None, sinks: bool = False, window: bool = False) -> str:
    name = f"hd{head_dim}_bs{block_size}_g{group}_nsg{NUM_SIMDGROUPS}"
    return name + (f"_q{quant[0]}_gs{quant[1]}" if quant else "") + ("_w" if window else "") + ("_sk" if sinks else "")


def _kind(kind: str, k_cache) -> str:
    return f"{kind}_quant" if quant_params(k_cache) else kind


def _cache_inputs(k_cache, v_cache) -> list[mx.array]:
    """The kernel inputs holding K and V: the pools, or each one's (data, scales, biases)."""
    if quant_params(k_cache):
        return [*k_cache.arrays, *v_cache.arrays]
    return [k_cache, v_cache]


def _template(q, k_cache, head_dim, block_size, group) -> list[tuple]:
    quant = quant_params(k_cache)
    return [("T", q.dtype), ("HD", head_dim), ("BS", block_size), ("G", group), ("NSG", NUM_SIMDGROUPS)] + (
        [("BITS", quant[0]), ("GS", quant[1])] if quant else []
    )


def window_input(window: int | None) -> mx.array:
    """The kernels' runtime `window` scalar (int32; 0: no window)."""
    return mx.array(window or 0, dtype=mx.int32)


def sinks_input(sinks: mx.array | None, num_heads: int) -> mx.array:
    """The kernels' `sinks` input: `[>= num_heads]` float32 logits, padded to MIN_DEVICE_ELEMENTS
    (a device buffer in every case, one kernel name); zeros, never read, without sinks."""
    if sinks is None:
        return mx.zeros((max(num_heads, MIN_DEVICE_ELEMENTS),), dtype=mx.float32)
    return _pad_to(sinks.astype(mx.float32).reshape(-1), 0, MIN_DEVICE_ELEMENTS)


def single_pass_launch(q, k_cache, v_cache, block_tables, context_lens, scale, window=None, sinks=None) -> Launch:
    """Launch of the one-pass kernel: one threadgroup per (kv head, sequence). `window` is the
    int32 scalar of `window_input`; `sinks` None (no sinks) or a `[>= num_heads]` float32 array."""
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    threads = 32 * NUM_SIMDGROUPS
    has_sinks = sinks is not None
    has_window = window is not None  # HAS_WINDOW: the scalar is read (a kernel without a window reads it never)
    variant = _variant(head_dim, block_size, group, quant_params(k_cache), has_sinks, has_window)
    window = window_input(None) if window is None else window
    sinks_arr = sinks if has_sinks else sinks_input(None, num_heads)
    return Launch(
        _kind("paged_attention", k_cache),
        variant,
        dict(
            inputs=[q, *_cache_inputs(k_cache, v_cache), block_tables, context_lens, scale, window, sinks_arr],
            template=_template(q, k_cache, head_dim, block_size, group)
            + [("HAS_WINDOW", int(has_window)), ("HAS_SINKS", int(has_sinks))],
            grid=(threads, num_kv_heads, num_seqs),
            threadgroup=(threads, 1, 1),
            output_shapes=[q.shape],
            output_dtypes=[q.dtype],
        ),
    )


def partitioned_launch(q, k_cache, v_cache, block_tables, context_lens, scale, part: int, window=None) -> Launch:
    """Launch of the split path's first pass: one threadgroup per (partition, kv head, sequence).
    `window`: the int32 scalar of `window_input` (partitions wholly before it write empty partials)."""
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_parts = cdiv(block_tables.shape[1] * block_size, part)
    if num_parts > MAX_PARTITIONS or part % block_size:
        raise ValueError(f"bad partition size {part} for block size {block_size}")
    threads = 32 * NUM_SIMDGROUPS
    variant = _variant(head_dim, block_size, group, quant_params(k_cache), window=window is not None)
    # The max and sum arrays get spare (never written, never read) sequence rows if they would
    # hold under 8 elements: the merge kernel's name must not change with the partition count.
    stat_seqs = max(num_seqs, cdiv(MIN_DEVICE_ELEMENTS, num_heads * num_parts))
    return Launch(
        _kind("paged_attention_partitioned", k_cache),
        variant,
        dict(
            inputs=[
                q,
                *_cache_inputs(k_cache, v_cache),
                block_tables,
                context_lens,
                scale,
                window_input(None) if window is None else window,
            ],
            template=_template(q, k_cache, head_dim, block_size, group) + [("HAS_WINDOW", int(window is not None))],
            grid=(threads * num_parts, num_kv_heads, num_seqs),
            threadgroup=(threads, 1, 1),
            output_shapes=[
                (num_seqs, num_heads, num_parts, head_dim),
                (stat_seqs, num_heads, num_parts),
                (stat_seqs, num_heads, num_parts),
            ],
            output_dtypes=[mx.float32, mx.float32, mx.float32],
        ),
    )


def merge_launch(part_out, part_max, part_sum, dtype, sinks=None) -> Launch:
    """Launch of the split path's second pass: one threadgroup of MERGE_SIMDGROUPS simdgroups
    per (head, sequence). `sinks`: None, or `sinks_input`'s `[>= num_heads]` float32 logits,
    folded once into each head's merged sum."""
    num_seqs, num_heads, _, head_dim = part_out.shape
    threads = 32 * MERGE_SIMDGROUPS
    has_sinks = sinks is not None
    return Launch(
        "paged_attention_merge",
        f"hd{head_dim}_nsg{MERGE_SIMDGROUPS}" + ("_sk" if has_sinks else ""),
        dict(
            inputs=[part_out, part_max, part_sum, sinks if has_sinks else sinks_input(None, num_heads)],
            template=[("T", dtype), ("HD", head_dim), ("NSG", MERGE_SIMDGROUPS), ("HAS_SINKS", int(has_sinks))],
            grid=(threads, num_heads, num_seqs),
            threadgroup=(threads, 1, 1),
            output_shapes=[(num_seqs, num_heads, head_dim)],
            output_dtypes=[dtype],
        ),
    )


def token_lanes(head_dim: int) -> int:
    """Lanes that score one token (paged_attention.h pa_token_lanes): head_dim / 8 rounded up to
    a power of two, so a lane holds lane_dims(head_dim) <= 8 dims of the row."""
    n = cdiv(head_dim, 8)
    return 1 << (n - 1).bit_length()


def lane_dims(head_dim: int) -> int:
    """Dims of a K/V row per lane (pa_lane_dims): 8 for power-of-two head_dims."""
    return head_dim // token_lanes(head_dim)


def step_tokens(head_dim: int) -> int:
    """Tokens a simdgroup scores per step, one per sub-group of token_lanes lanes."""
    return 32 // token_lanes(head_dim)


def lane_registers(heads: int, head_dim: int) -> int:
    """Live 32-bit values per lane of the attention loop for `heads` query heads per simdgroup
    (mirrors pa_lane_registers: max, sum, D accumulators and a score per head; a K and a V
    row's D dims; the queries stay in threadgroup memory)."""
    d = lane_dims(head_dim)
    return heads * (d + 3) + 2 * d


def head_splits(group: int, head_dim: int) -> int:
    """Groups of simdgroups the G query heads of a kv head are split over (1, 2, 4 or 8) so a
    lane stays within REGISTER_BUDGET (mirrors pa_head_splits); 8 may still exceed it."""
    for hs in (1, 2, 4):
        if lane_registers(cdiv(group, hs), head_dim) <= REGISTER_BUDGET:
            return hs
    return 8


def threadgroup_bytes(head_dim: int, block_size: int, group: int) -> int:
    """Threadgroup memory of the attention kernels (mirrors their `threadgroup` arrays)."""
    chunk_blocks = max(1, 256 // block_size)  # PA_CHUNK_BLOCKS in paged_attention.h
    nsg = NUM_SIMDGROUPS
    heads = cdiv(group, head_splits(group, head_dim))  # per simdgroup
    states = nsg * step_tokens(head_dim)  # online-softmax states: one per sub-group
    # 4-byte elements: queries then the states' outputs (double-buffered) in one array, block
    # ids (double-buffered), stats
    arrays = (max(group, 2 * states) * head_dim, 2 * chunk_blocks, 2 * states * heads)
    return sum(cdiv(4 * n, 16) * 16 for n in arrays)  # each array 16-byte aligned


def kv_row_bytes(k_cache) -> int:
    """Bytes of one K (or V) row of the pool: head_dim values, or a quantized row's codes,
    scales and biases."""
    hd = k_cache.shape[-1]
    quant = quant_params(k_cache)
    return row_bytes(hd, quant[0] if quant else None, quant[1] if quant else 0, k_cache.dtype)


def minimum_bytes(q, k_cache, context_lens) -> int:
    """The least any decode kernel must read: each K and V row in context once (for a quantized
    pool its codes, scales and biases), the queries, the block-table entries in use and the
    context lengths."""
    _, kvh, bs, hd = k_cache.shape
    lens = [int(n) for n in context_lens.tolist()]
    blocks = sum(cdiv(n, bs) for n in lens)
    return 2 * sum(lens) * kvh * kv_row_bytes(k_cache) + q.nbytes + 4 * blocks + context_lens.nbytes


def check_metadata(k_cache, block_tables, context_lens) -> None:
    """`MLXPAGED_DEBUG=1`: every context length fits its table row and every block id in use
    names a block of the pool; else ValueError naming the sequence (costs a device sync)."""
    num_blocks, _, bs, _ = k_cache.shape
    width = block_tables.shape[1]
    lens = [int(n) for n in context_lens.tolist()]
    rows = block_tables.tolist()
    for s, n in enumerate(lens):
        if n < 0 or n > width * bs:
            raise ValueError(
                f"paged_attention_metal: context length {n} of sequence {s} is "
                f"outside 0..{width * bs} (block table width {width} x block size {bs})"
            )
        for j, b in enumerate(rows[s][: cdiv(n, bs)]):
            if not 0 <= b < num_blocks:
                raise ValueError(
                    f"paged_attention_metal: block id {b} at block_tables[{s}, {j}] "
                    f"is outside the pool of {num_blocks} blocks"
                )


# Shape family (dtype, head_dim, block size, G) -> True (kernels built, checked) or False
# (fall back to the reference), per factory.
_families: dict[tuple, bool] = {}
# Shape family -> the error that failed it: the compiler's (or emulator's) message, first lines
# (`mlxpaged doctor` prints it; the warning gives its first line).
_family_errors: dict[tuple, str] = {}
ERROR_LINES = 12  # lines of a compiler message kept for the report
# Kernel launches (kind, variant, inputs' dtype/rank/size class: what MLX names a kernel by)
# already evaluated once in this process: a new one is evaluated at once, inside the caller's
# fallback, so a Metal build error surfaces there and not in the engine's step.
_evaluated: set[tuple] = set()
# (atol, rtol) of the startup check per dtype: results are rounded to the dtype.
CHECK_TOLERANCE = {mx.float16: (2e-3, 8e-3), mx.bfloat16: (1.6e-2, 4e-2), mx.float32: (1e-4, 1e-3)}


def reset_kernels() -> None:
    """Forget built kernels and family checks (tests that swap the kernel source or factory)."""
    _kernel.cache_clear()
    _families.clear()
    _family_errors.clear()
    _evaluated.clear()


def dequantized(cache) -> mx.array:
    """A pool as float rows: a quantized one dequantized in float32 (scale * code + bias, as the
    kernels compute it: unrounded, unlike `dequantize()` in a half dtype), a float one as it is."""
    if not quant_params(cache):
        return cache
    return mx.dequantize(
        cache.data,
        cache.scales.astype(mx.float32),
        cache.biases.astype(mx.float32),
        group_size=cache.group_size,
        bits=cache.bits,
    )


def check_pools(num_heads: int, k_pools: list) -> None:
    """`check_family` once for each distinct shape among a model's key pools (Gemma 4's full
    layers have wider rows and fewer KV heads than its sliding ones; an MLA pool has one KV head)."""
    shapes = {}
    for pool in k_pools:
        shapes.setdefault((tuple(pool.shape[1:]), quant_params(pool)), pool)
    for pool in shapes.values():
        check_family(num_heads // pool.shape[1], pool)


def check_family(group: int, k_cache) -> bool:
    """Build all three kernels of this shape family and check them, once per process: a small
    random case through the single pass and the split path against the reference (for a
    quantized pool, the quantized kernels against the reference on the dequantized pools).

    False (after one warning) means the reference path must be used. With
    `MLXPAGED_METAL=strict` or `=emulate` a failure raises `KernelCheckError` instead.
    """
    _, _, bs, hd = k_cache.shape
    quant = quant_params(k_cache)
    key = family_key(group, k_cache)
    if key in _families:
        return _families[key]
    from .reference import paged_attention_reference

    rng = np.random.default_rng(12)
    nblocks = 3
    lens = [2 * bs + 1, bs]  # two sequences; the first spans 3 blocks
    q = mx.array(rng.standard_normal((2, group, hd)), dtype=k_cache.dtype)
    pool = [mx.array(rng.standard_normal((2 * nblocks, 1, bs, hd)), dtype=k_cache.dtype) for _ in range(2)]
    if quant:
        pool = [QuantizedPool.quantize(p, *quant) for p in pool]
    tables = mx.array(np.array([[4, 1, 5], [2, 0, 3]], np.int32))
    cl = mx.array(np.array(lens, np.int32))
    ref = paged_attention_reference(q, *map(dequantized, pool), tables, cl, 0.3)
    problem = ""
    for path, part in (("single pass", 0), ("split", bs)):
        variant = f"{path} {_variant(hd, bs, group, quant)} {k_cache.dtype}"
        problem = compare_to_reference(variant, lambda: _run(q, *pool, tables, cl, 0.3, part)[0], ref, k_cache.dtype)
        if problem:
            break
    ok = settle_check(problem)
    _families[key] = ok
    if problem:
        _family_errors[key] = problem
    return ok


def family_key(group: int, k_cache, varlen: bool = False) -> tuple:
    """The registry key of a shape family (decode kernels, or the varlen kernel)."""
    _, _, bs, hd = k_cache.shape
    key = (_metal_kernel_factory(), k_cache.dtype, hd, bs, group, quant_params(k_cache))
    return ("varlen", *key) if varlen else key


def family_error(group: int, k_cache, varlen: bool = False) -> str | None:
    """The error that failed this family's check or call (compiler text, first lines), if any."""
    return _family_errors.get(family_key(group, k_cache, varlen))


def kernel_failed(group: int, k_cache, error: BaseException) -> bool:
    """A kernel failed mid-serving (a build or launch the start-up check did not cover): one
    warning, and this shape's decode and varlen families take the reference path from now on.
    False under `MLXPAGED_METAL=strict` or `=emulate` (the caller re-raises)."""
    if settings.metal_strict():
        return False
    text = error_text(error)
    for varlen in (False, True):
        key = family_key(group, k_cache, varlen)
        _families[key] = False
        _family_errors[key] = text
    warnings.warn(
        f"Metal paged-attention kernel {failed_kernel(error) or '?'} failed, using the reference path for "
        f"this shape: {text.splitlines()[0]}",
        RuntimeWarning,
        stacklevel=3,
    )
    return True


def error_text(e: BaseException) -> str:
    """`[kernel NAME] Type: message`, the message's first ERROR_LINES lines (a compiler's
    diagnostics); the kernel when a build or launch raised it."""
    lines = str(e).splitlines() or [""]
    name = failed_kernel(e)
    where = f"kernel {name}: " if name else ""
    return f"{where}{type(e).__name__}: " + "\n".join(ln[:300] for ln in lines[:ERROR_LINES])


def compare_to_reference(variant: str, run, ref: mx.array, dtype) -> str:
    """ "" when `run()` matches `ref` within CHECK_TOLERANCE[dtype], else what went wrong (a
    compile or launch error, or how far off the result is). Under `MLXPAGED_METAL=strict` or
    `=emulate` an error raises as it is: the compiler's or the emulator's report names it best."""
    atol, rtol = CHECK_TOLERANCE[dtype]
    ref = ref.astype(mx.float32)
    try:
        out = run().astype(mx.float32)
        err = float(mx.max(mx.abs(out - ref) / (atol + rtol * mx.abs(ref))).item())
    except Exception as e:  # compile or launch error: the reference path takes over
        if settings.metal_strict():
            raise
        return f"{variant}: {error_text(e)}"
    if not err <= 1.0:  # NaN fails too
        return f"{variant}: result differs from the reference (error {err:.3g} x tolerance)"
    return ""


def settle_check(problem: str) -> bool:
    """A family check's verdict: True when nothing went wrong; else one warning and False (the
    reference path takes that shape), or `KernelCheckError` under `strict` / `emulate`."""
    if not problem:
        return True
    if settings.metal_strict():
        raise KernelCheckError(f"Metal paged-attention kernel check failed: {problem}")
    # One line: `mlxpaged doctor` prints the compiler's message in full (first lines).
    warnings.warn(
        f"Metal paged-attention kernel check failed, using the reference path for "
        f"this shape: {problem.splitlines()[0]}",
        RuntimeWarning,
        stacklevel=4,
    )
    return False


def bytes_read(launches: list[Launch]) -> int:
    """Bytes the launches' kernels read from their inputs on their last run (emulator only:
    its kernels count every load)."""
    factory = _metal_kernel_factory()
    return sum(sum(_kernel(factory, launch.kind, launch.variant).last_stats.values()) for launch in launches)


def last_launch_stats(launch: Launch):
    """The emulator's `LaunchStats` of this launch's kernel on its last run (emulator only)."""
    return _kernel(_metal_kernel_factory(), launch.kind, launch.variant).last_launch


def shape_problem(head_dim: int, block_size: int, group: int) -> str:
    """Why the kernels cannot take this (head_dim, block size, G), or "" when they can."""
    if head_dim % 32 or head_dim > 32 * NUM_SIMDGROUPS:
        return f"paged_attention_metal: head_dim {head_dim} is not a multiple of 32 up to {32 * NUM_SIMDGROUPS}"
    if threadgroup_bytes(head_dim, block_size, group) > 32768:  # Apple GPUs' limit
        return (
            f"paged_attention_metal: {group} query heads per kv head of "
            f"head_dim {head_dim} need more than 32 KiB of threadgroup memory"
        )
    heads = cdiv(group, head_splits(group, head_dim))
    if lane_registers(heads, head_dim) > REGISTER_BUDGET:
        return (
            f"paged_attention_metal: {group} query heads per kv head of head_dim "
            f"{head_dim} need {lane_registers(heads, head_dim)} registers per lane "
            f"even split over 8 simdgroups, over the bound {REGISTER_BUDGET}"
        )
    return ""


def shape_supported(head_dim: int, block_size: int, group: int) -> bool:
    return not shape_problem(head_dim, block_size, group)


def quant_problem(head_dim: int, bits: int, gs: int) -> str:
    """Why the kernels cannot read a cache quantized to (bits, group size), or ""."""
    if bits not in KV_BITS or gs not in KV_GROUP_SIZES or head_dim % gs:
        return f"paged_attention_metal: unsupported quantized cache: {bits} bits, group size {gs}, head_dim {head_dim}"
    d = lane_dims(head_dim)
    if d & (d - 1) or d * bits < 8:
        return (
            f"paged_attention_metal: head_dim {head_dim} at {bits} bits: a lane's "
            f"{d} values are not whole bytes of one group (head_dim 32, 64, 128 or 256)"
        )
    return ""


def quant_supported(head_dim: int, bits: int, gs: int) -> bool:
    return not quant_problem(head_dim, bits, gs)


def _check(q, k_cache, v_cache=None):
    if k_cache.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"paged_attention_metal: unsupported cache dtype {k_cache.dtype}")
    head_dim = q.shape[-1]
    if quant_params(k_cache) or (v_cache is not None and quant_params(v_cache)):
        _check_quant(head_dim, k_cache, k_cache if v_cache is None else v_cache)
    problem = shape_problem(head_dim, k_cache.shape[2], q.shape[1] // k_cache.shape[1])
    if problem:
        raise ValueError(problem)


def _check_quant(head_dim: int, k_cache, v_cache) -> None:
    """A quantized cache the kernels read: K and V alike, and each lane's lane_dims(head_dim)
    codes whole bytes of one scale group (power-of-two head_dims: 8 codes per lane)."""
    quant = quant_params(k_cache)
    if quant is None or quant != quant_params(v_cache) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            "paged_attention_metal: k_cache and v_cache must be quantized alike "
            f"(got {quant} and {quant_params(v_cache)})"
        )
    problem = quant_problem(head_dim, *quant)
    if problem:
        raise ValueError(problem)


def supports(q: mx.array, k_cache) -> bool:
    """Whether the kernel handles these shapes and dtypes (else `_check` says why not)."""
    try:
        _check(q, k_cache)
    except (TypeError, ValueError):
        return False
    return True


def paged_attention_metal(
    q: mx.array,  # [num_seqs, num_heads, head_dim]
    k_cache,  # [num_blocks, num_kv_heads, block_size, head_dim]: mx.array or QuantizedPool
    v_cache,  # [num_blocks, num_kv_heads, block_size, head_dim]: like k_cache
    block_tables: mx.array,  # [num_seqs, max_blocks] int32
    context_lens: mx.array,  # [num_seqs] int32
    *,
    scale: float,
    partition_tokens: int | None = None,
    window: int | None = None,
    sinks: mx.array | None = None,  # [num_heads]
) -> mx.array:  # [num_seqs, num_heads, head_dim], q's dtype
    """Paged decode attention with the Metal kernel (see `mlxpaged.attention.paged_attention`).

    `partition_tokens` overrides the split planning (0: single pass). `window` (None or >= 1)
    and `sinks` as in `paged_attention`.
    """
    return run_with_launches(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale=scale,
        partition_tokens=partition_tokens,
        window=window,
        sinks=sinks,
    )[0]


def run_with_launches(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    *,
    scale: float,
    partition_tokens: int | None = None,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> tuple[mx.array, list[Launch]]:
    """`paged_attention_metal`, also returning the launches it ran (for tests and tables).

    A shape family whose startup check failed runs the reference instead (no launches)."""
    _check(q, k_cache, v_cache)
    if settings.debug():
        check_metadata(k_cache, block_tables, context_lens)
    if not check_family(q.shape[1] // k_cache.shape[1], k_cache):
        from .reference import paged_attention_reference

        # (quantized pools: the reference gathers and dequantizes only the rows in use)
        ref = paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale, None, window, sinks)
        return ref.astype(q.dtype), []
    return _run(q, k_cache, v_cache, block_tables, context_lens, scale, partition_tokens, window, sinks)


def _pad_to(x: mx.array, axis: int, n: int) -> mx.array:
    """`x` zero-padded at the end of `axis` to at least `n` entries."""
    if x.shape[axis] >= n:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n - x.shape[axis])
    return mx.pad(x, widths)


def pad_table(block_tables: mx.array) -> mx.array:
    """An int32 block table of at least MIN_DEVICE_ELEMENTS entries: spare rows (never read)
    are added, never columns, so `block_tables_shape[1]` stays the real width the kernels clamp
    context lengths to (a padded column would hold block 0, another sequence's)."""
    bt = block_tables.astype(mx.int32)
    if bt.shape[1] == 0:
        bt = _pad_to(bt, 1, 1)  # no column at all: every context length is then clamped to BS
    return _pad_to(bt, 0, cdiv(MIN_DEVICE_ELEMENTS, bt.shape[1]))


def _device_pool(cache):
    """A quantized pool whose arrays all hold >= 8 elements (spare zero blocks, never read, on
    tiny pools), so MLX passes each in the device address space the views need."""
    if not quant_params(cache) or min(a.size for a in cache.arrays) >= MIN_DEVICE_ELEMENTS:
        return cache
    blocks = cache.data.shape[0] + MIN_DEVICE_ELEMENTS  # >= 8 rows per array
    return QuantizedPool(*(_pad_to(a, 0, blocks) for a in cache.arrays), cache.bits, cache.group_size)


def _run(q, k_cache, v_cache, block_tables, context_lens, scale, partition_tokens, window=None, sinks=None):
    out_dtype = q.dtype
    q = q.astype(k_cache.dtype)  # one element type T for q, caches and output
    # Padding (unused zeros) keeps every input in the device address space: one kernel name.
    # Table columns: only entries within each (clamped) context are read.
    block_tables = pad_table(block_tables)
    context_lens = _pad_to(context_lens.astype(mx.int32), 0, MIN_DEVICE_ELEMENTS)
    k_cache, v_cache = _device_pool(k_cache), _device_pool(v_cache)
    scale_arr = mx.array(scale, dtype=mx.float32)
    _, num_kv_heads, block_size, _ = k_cache.shape
    part = partition_tokens
    if part is None:
        part = plan_partition_tokens(
            q.shape[0],
            num_kv_heads,
            block_tables.shape[1],
            block_size,
            group=q.shape[1] // num_kv_heads,
            head_dim=q.shape[2],
            kv_row_bytes=kv_row_bytes(k_cache),
            q_bytes=q.dtype.size,
        )
    args = (q, k_cache, v_cache, block_tables, context_lens, scale_arr)
    win = window_input(window) if window else None
    sk = None if sinks is None else sinks_input(sinks, q.shape[1])
    if not part:
        launches = [single_pass_launch(*args, win, sk)]
        out = launches[0].run()[0]
    else:
        launches = [partitioned_launch(*args, part, win)]
        launches.append(merge_launch(*launches[0].run(), q.dtype, sk))
        out = launches[1].run()[0]
    return out.astype(out_dtype), launches
