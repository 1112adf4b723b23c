"""The paged-attention kernel table at Qwen2.5-1.5B decode shapes (used by `scripts/kernel.py` and
`mlxpaged bench kernel`).

On an Apple GPU: the kernel's time against contiguous `mx.fast.scaled_dot_product_attention` on
the same keys and values, and its max error against the reference. Elsewhere: the bytes the
emulated kernel reads, as a multiple of the minimum (each K/V row once, the queries, the
block-table entries in use, the context lengths). `cost_model`: the emulator's operation
counts (SIMD reductions and shuffles, exp/exp2, barriers, device loads by width) per K/V token
and per query head, the proxy for ALU cost without a Mac.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ..attention import metal
from ..attention.reference import paged_attention_reference

HEADS, KV_HEADS, HEAD_DIM = 12, 2, 128  # Qwen2.5-1.5B
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def make_inputs(seqs: int, tokens: int, block_size: int, scattered: bool, seed: int = 0):
    """Queries, a pool holding every sequence's `tokens` tokens, block tables and lengths."""
    rng = np.random.default_rng(seed)
    per_seq = -(-tokens // block_size)
    pool = seqs * per_seq
    ids = rng.permutation(pool) if scattered else np.arange(pool)
    shape = (pool, KV_HEADS, block_size, HEAD_DIM)
    return (
        mx.array(rng.standard_normal((seqs, HEADS, HEAD_DIM)), dtype=mx.float16),
        mx.array(rng.standard_normal(shape), dtype=mx.float16),
        mx.array(rng.standard_normal(shape), dtype=mx.float16),
        mx.array(ids.reshape(seqs, per_seq).astype(np.int32)),
        mx.full((seqs,), tokens, dtype=mx.int32),
    )


def max_error(out: mx.array, ref: mx.array) -> float:
    return float(mx.max(mx.abs(out.astype(mx.float32) - ref.astype(mx.float32))).item())


def median_ms(fn, repeats: int = 20, per_eval: int = 16) -> float:
    """Median milliseconds per call of `fn`, timing `per_eval` calls queued under one
    `mx.eval` (one eval per call would time dispatch latency, not the kernel)."""
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(per_eval)])
        times.append((time.perf_counter() - t0) / per_eval)
    return 1e3 * float(np.median(times))


def gpu_rows(seqs: int, tokens: int, sizes: Sequence[int]) -> list[dict]:
    """Timings of the paged kernel and contiguous SDPA, and the kernel's error."""
    scale = 1.0 / math.sqrt(HEAD_DIM)
    rows = []
    for bs in sizes:
        for scattered in (False, True):
            q, k, v, bt, cl = make_inputs(seqs, tokens, bs, scattered)
            out = metal.paged_attention_metal(q, k, v, bt, cl, scale=scale)
            err = max_error(out, paged_attention_reference(q, k, v, bt, cl, scale))
            # The same keys and values laid out contiguously: [seqs, kv_heads, tokens, head_dim].
            kc, vc = (
                c[bt].transpose(0, 2, 1, 3, 4).reshape(seqs, KV_HEADS, -1, HEAD_DIM)[:, :, :tokens] for c in (k, v)
            )
            mx.eval(kc, vc)
            paged = median_ms(lambda: metal.paged_attention_metal(q, k, v, bt, cl, scale=scale))
            sdpa = median_ms(lambda: mx.fast.scaled_dot_product_attention(q[:, :, None, :], kc, vc, scale=scale))
            gbs = metal.minimum_bytes(q, k, cl) / paged / 1e6
            rows.append(
                dict(
                    block_size=bs,
                    scattered=scattered,
                    paged_ms=paged,
                    sdpa_ms=sdpa,
                    paged_over_sdpa=paged / sdpa,
                    paged_gb_s=gbs,
                    max_error=err,
                )
            )
    return rows


def emulator_rows(seqs: int, tokens: int, sizes: Sequence[int]) -> list[dict]:
    """Bytes the emulated kernel reads, as a multiple of the minimum."""
    from mlxpaged.metal_emu import emulate

    scale = 1.0 / math.sqrt(HEAD_DIM)
    rows = []
    with emulate():
        for bs in sizes:
            for scattered in (False, True):
                q, k, v, bt, cl = make_inputs(seqs, tokens, bs, scattered)
                t0 = time.perf_counter()
                out, launches = metal.run_with_launches(q, k, v, bt, cl, scale=scale)
                mx.eval(out)
                seconds = time.perf_counter() - t0
                err = max_error(out, paged_attention_reference(q, k, v, bt, cl, scale))
                read, least = metal.bytes_read(launches), metal.minimum_bytes(q, k, cl)
                # The single-pass kernel on the same inputs, for comparison with the split.
                _, single = metal.run_with_launches(q, k, v, bt, cl, scale=scale, partition_tokens=0)
                single_read = metal.bytes_read(single)
                rows.append(
                    dict(
                        block_size=bs,
                        scattered=scattered,
                        kernels="+".join(launch.kind for launch in launches),
                        bytes_read=read,
                        minimum_bytes=least,
                        ratio=read / least,
                        single_pass_ratio=single_read / least,
                        max_error=err,
                        emulator_s=seconds,
                    )
                )
    return rows


# Cost model (emulator): per launch, the operations that bound a compute-bound decode kernel.
COST_SHAPES = (("Qwen2.5-0.5B", 7, 64), ("Qwen2.5-7B", 7, 128))  # (model, G, head_dim)


def _emulated_stats(
    group, head_dim, seqs, tokens, kv_heads, block_size, partition_tokens, dtype, kv_bits=None, kv_group=32
):
    """(output, reference, launches' LaunchStats) of one emulated decode call (over a cache
    quantized to `kv_bits` in groups of `kv_group`, when given)."""
    from mlxpaged.metal_emu import emulate

    from ..attention.kv_quant import QuantizedPool

    rng = np.random.default_rng(0)
    per_seq = -(-tokens // block_size)
    pool = seqs * per_seq
    shape = (pool, kv_heads, block_size, head_dim)
    q = mx.array(rng.standard_normal((seqs, kv_heads * group, head_dim)), dtype=dtype)
    k = mx.array(rng.standard_normal(shape), dtype=dtype)
    v = mx.array(rng.standard_normal(shape), dtype=dtype)
    bt = mx.array(rng.permutation(pool).reshape(seqs, per_seq).astype(np.int32))
    cl = mx.full((seqs,), tokens, dtype=mx.int32)
    if kv_bits:
        k, v = (QuantizedPool.quantize(c, kv_bits, kv_group) for c in (k, v))
    with emulate():
        out, launches = metal.run_with_launches(
            q, k, v, bt, cl, scale=head_dim**-0.5, partition_tokens=partition_tokens
        )
        stats = [metal.last_launch_stats(launch) for launch in launches]
    ref = paged_attention_reference(q, metal.dequantized(k), metal.dequantized(v), bt, cl, head_dim**-0.5)
    return out, ref, launches, stats


def cost_model(
    group: int,
    head_dim: int,
    *,
    seqs: int = 2,
    tokens: int = 1000,
    kv_heads: int = 2,
    block_size: int = 16,
    partition_tokens: int | None = 0,
    dtype=mx.float16,
    kv_bits: int | None = None,
    kv_group: int = 32,
) -> dict:
    """Counts of the emulated kernels' operations, per K/V token row (one token of one kv head)
    and per (token, query head). SIMD-level counts: exp calls are per lane, so divided by 32;
    shuffles and reductions are per simdgroup-wide call; loads are per lane, by width in bytes.
    `loop_barriers_per_256_tokens` is the marginal rate: against the same call at 1 token."""
    args = (group, head_dim, seqs, tokens, kv_heads, block_size, partition_tokens, dtype)
    out, ref, launches, stats = _emulated_stats(*args, kv_bits, kv_group)
    *_, stats1 = _emulated_stats(
        group, head_dim, seqs, 1, kv_heads, block_size, partition_tokens, dtype, kv_bits, kv_group
    )
    rows = seqs * tokens * kv_heads
    heads = rows * group
    total = lambda f, ss=stats: sum(f(s) for s in ss)  # noqa: E731
    loads = {w: total(lambda s: s.device_loads[w]) for w in (1, 2, 4, 8, 16)}
    barriers = total(lambda s: s.barriers)
    return dict(
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=str(dtype),
        kv_bits=kv_bits or 16,
        kernels="+".join(launch.kind for launch in launches),
        max_error=max_error(out, ref),
        simd_reductions_per_token=total(lambda s: s.simd_reductions) / rows,
        simd_reductions_per_token_head=total(lambda s: s.simd_reductions) / heads,
        simd_shuffles_per_token=total(lambda s: s.simd_shuffles) / rows,
        exp_per_token_head=total(lambda s: s.exp_calls + s.exp2_calls) / 32 / heads,
        barriers_per_256_tokens=256 * barriers / rows,
        loop_barriers_per_256_tokens=256 * (barriers - total(lambda s: s.barriers, stats1)) / (rows - seqs * kv_heads),
        device_loads_per_token={w: n / rows for w, n in loads.items() if n},
        registers=max(s.registers for s in stats),
    )


# Bytes per token for 16/8/4-bit KV (emulator): (model, query heads, kv heads, head_dim).
KV_BYTES_SHAPES = (("Qwen2.5-0.5B", 14, 2, 64), ("Qwen2.5-7B", 28, 4, 128))
KV_BITS_ROWS = (None, 8, 4)  # None: the float16 cache


def kv_bytes_rows(
    *, seqs: int = 2, tokens: int = 1000, block_size: int = 16, group_size: int = 32, partition_tokens: int | None = 0
) -> list[dict]:
    """Bytes the emulated decode kernels read per context token (one layer: K and V of every kv
    head), for a float16 cache and 8- and 4-bit caches of the same rows, with the quantized (or
    float) minimum and the max error against the reference on the (dequantized) pools."""
    from mlxpaged.metal_emu import emulate

    from ..attention.kv_quant import QuantizedPool

    rows = []
    for model, heads, kv_heads, head_dim in KV_BYTES_SHAPES:
        rng = np.random.default_rng(0)
        per_seq = -(-tokens // block_size)
        shape = (seqs * per_seq, kv_heads, block_size, head_dim)
        q = mx.array(rng.standard_normal((seqs, heads, head_dim)), dtype=mx.float16)
        k16, v16 = (mx.array(rng.standard_normal(shape), dtype=mx.float16) for _ in range(2))
        bt = mx.array(rng.permutation(seqs * per_seq).reshape(seqs, per_seq).astype(np.int32))
        cl = mx.full((seqs,), tokens, dtype=mx.int32)
        scale = head_dim**-0.5
        for bits in KV_BITS_ROWS:
            k, v = (k16, v16) if bits is None else (QuantizedPool.quantize(c, bits, group_size) for c in (k16, v16))
            with emulate():
                out, launches = metal.run_with_launches(q, k, v, bt, cl, scale=scale, partition_tokens=partition_tokens)
                read = metal.bytes_read(launches)
            ref = paged_attention_reference(q, metal.dequantized(k), metal.dequantized(v), bt, cl, scale)
            least = metal.minimum_bytes(q, k, cl)
            rows.append(
                dict(
                    model=model,
                    heads=heads,
                    kv_heads=kv_heads,
                    head_dim=head_dim,
                    kv_bits=bits or 16,
                    group_size=group_size if bits else None,
                    kernels="+".join(launch.kind for launch in launches),
                    bytes_per_token=read / (seqs * tokens),
                    minimum_per_token=least / (seqs * tokens),
                    ratio=read / least,
                    max_error=max_error(out, ref),
                )
            )
        base = rows[-len(KV_BITS_ROWS)]["bytes_per_token"]
        for r in rows[-len(KV_BITS_ROWS) :]:
            r["vs_16bit"] = r["bytes_per_token"] / base
    return rows


# Launch limits (planning only, no emulation): threads, registers per thread (the emulator's
# estimate) and threadgroup memory per kernel variant, at Qwen2.5 head shapes and the shapes
# that need head splits. (label, G, head_dim)
LIMIT_SHAPES = (
    ("Qwen2.5-0.5B", 7, 64),
    ("Qwen2.5-1.5B", 6, 128),
    ("Qwen2.5-7B", 7, 128),
    ("G16 hd128", 16, 128),
    ("G8 hd256", 8, 256),
    ("G16 hd256", 16, 256),
)


def launch_limit_rows(block_size: int = 16, dtype=mx.float16) -> list[dict]:
    """One row per kernel variant the engine builds at LIMIT_SHAPES (float, 8- and 4-bit KV):
    threads per threadgroup, registers per thread, the threadgroup's register bytes against
    the register file, and threadgroup memory."""
    from mlxpaged.attention import metal_varlen as mv
    from mlxpaged.utils import cdiv

    rows = []
    for label, g, hd in LIMIT_SHAPES:
        for quant in (None, (8, 32), (4, 32)):
            tag = f"{quant[0]}-bit" if quant else str(dtype).split(".")[-1]
            if metal.shape_supported(hd, block_size, g):
                heads = cdiv(g, metal.head_splits(g, hd))
                regs = metal.lane_registers(heads, hd)
                threads = 32 * metal.NUM_SIMDGROUPS
                rows.append(
                    dict(
                        shape=label,
                        kv=tag,
                        kernel="paged_attention" + ("_quant" if quant else ""),
                        variant=metal._variant(hd, block_size, g, quant),
                        threads=threads,
                        registers=regs,
                        register_file_bytes=4 * threads * regs,
                        threadgroup_bytes=metal.threadgroup_bytes(hd, block_size, g),
                    )
                )
            p = mv.launch_plan(hd, block_size, g, dtype.size, quant)
            rows.append(
                dict(
                    shape=label,
                    kv=tag,
                    kernel=p.kind,
                    variant=p.variant,
                    threads=p.threads,
                    registers=p.registers,
                    register_file_bytes=p.register_file_bytes,
                    threadgroup_bytes=mv.threadgroup_bytes(p, dtype.size),
                )
            )
    return rows
