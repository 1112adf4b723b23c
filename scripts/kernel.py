"""Print the paged-attention kernel table at Qwen2.5-1.5B decode shapes.

Shapes: 12 query heads, 2 kv heads, head_dim 128, fp16; block sizes 1, 2, 4, ..., 256 with each
sequence's blocks in order or scattered over the pool.

- On an Apple GPU: time of the paged kernel against contiguous
  `mx.fast.scaled_dot_product_attention` on the same K/V, and the kernel's max error against
  the pure-MLX reference (default 16 sequences x 4,096 tokens).
- Elsewhere: the kernel runs in the MSL emulator, which counts the bytes it reads; the table
  gives them as a multiple of the minimum (each K/V row once, the queries, the block-table
  entries in use, the context lengths). Timings need an Apple GPU. The emulator is slow, so the
  default there is smaller (4 sequences x 1,024 tokens); the ratio barely depends on it.

Usage::

    python scripts/kernel.py                           # GPU table on a Mac, else bytes read
    python scripts/kernel.py --seqs 16 --tokens 4096   # full shape in the emulator (~5 min)
    MLXPAGED_METAL=emulate python scripts/kernel.py    # bytes-read table on a Mac too
    python scripts/kernel.py --cost                    # emulator cost model, Qwen2.5-0.5B/7B shapes
    python scripts/kernel.py --kv-bytes                # bytes per token, 16/8/4-bit KV (emulator)
    python scripts/kernel.py --kv-bytes --planned --tokens 4096  # the same on the planner's split path
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing

from mlxpaged.attention import metal_native  # noqa: E402
from mlxpaged.bench.kernel import (  # noqa: E402
    BLOCK_SIZES,
    COST_SHAPES,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    cost_model,
    emulator_rows,
    gpu_rows,
    kv_bytes_rows,
    launch_limit_rows,
)
from mlxpaged.bench.report import provenance  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, help="sequences (default 16 on a GPU, 4 emulated)")
    ap.add_argument("--tokens", type=int, help="tokens each (default 4096 on a GPU, 1024 emulated)")
    ap.add_argument("--max-block", type=int, default=256)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument(
        "--cost", action="store_true", help="the emulator's cost model at Qwen2.5-0.5B and -7B head shapes instead"
    )
    ap.add_argument(
        "--kv-bytes", action="store_true", help="bytes read per token for 16/8/4-bit KV caches (emulator) instead"
    )
    ap.add_argument("--kv-group", type=int, default=32, help="quantization group size (--kv-bytes, --kv-bits)")
    ap.add_argument(
        "--planned",
        action="store_true",
        help="with --kv-bytes: the planner's path (split + merge for long contexts), not the single pass",
    )
    ap.add_argument(
        "--kv-bits", type=int, choices=(4, 8), help="with --cost: over a KV cache quantized to this many bits"
    )
    args = ap.parse_args(argv)
    if args.cost:
        return print_cost(args.seqs or 2, args.tokens or 1000, args.json, args.kv_bits, args.kv_group)
    if args.kv_bytes:
        return print_kv_bytes(args.seqs or 2, args.tokens or 1000, args.kv_group, args.json, args.planned)
    sizes = [bs for bs in BLOCK_SIZES if bs <= args.max_block]
    gpu = metal_native() and os.environ.get("MLXPAGED_METAL") != "emulate"
    seqs = args.seqs or (16 if gpu else 4)
    tokens = args.tokens or (4096 if gpu else 1024)
    rows = gpu_rows(seqs, tokens, sizes) if gpu else emulator_rows(seqs, tokens, sizes)
    if args.json:
        print(json.dumps({"seqs": seqs, "tokens": tokens, "provenance": provenance(), "rows": rows}, indent=1))
        return 0
    print(f"{seqs} sequences x {tokens} tokens, {HEADS} heads / {KV_HEADS} kv heads, head_dim {HEAD_DIM}, fp16")
    if gpu:
        print(f"{'block':>5} {'layout':>9} {'paged ms':>9} {'sdpa ms':>8} {'ratio':>6} {'GB/s':>6} {'max err':>8}")
        for r in rows:
            print(
                f"{r['block_size']:>5} {'scattered' if r['scattered'] else 'in order':>9} "
                f"{r['paged_ms']:>9.3f} {r['sdpa_ms']:>8.3f} {r['paged_over_sdpa']:>6.2f} "
                f"{r['paged_gb_s']:>6.0f} {r['max_error']:>8.2g}"
            )
        return 0
    print("No Apple GPU: bytes read by the emulated kernel; timings need an Apple GPU.")
    print("ratio: bytes read / minimum for the path the planner chose; single: the one-pass kernel on the same inputs.")
    print(
        f"{'block':>5} {'layout':>9} {'kernels':>12} {'bytes read':>11} {'minimum':>11} "
        f"{'ratio':>7} {'single':>7} {'max err':>8}"
    )
    for r in rows:
        kernels = "split+merge" if "merge" in r["kernels"] else "single pass"
        print(
            f"{r['block_size']:>5} {'scattered' if r['scattered'] else 'in order':>9} "
            f"{kernels:>12} {r['bytes_read']:>11,} {r['minimum_bytes']:>11,} "
            f"{r['ratio']:>7.4f} {r['single_pass_ratio']:>7.4f} {r['max_error']:>8.2g}"
        )
    return 0


def print_limits() -> None:
    """Threads, registers per thread and threadgroup memory per kernel variant (planning)."""
    from mlxpaged.attention.metal_varlen import REGISTER_FILE_BYTES

    print(
        f"Launch limits, block 16: threads per threadgroup x registers per thread (the "
        f"emulator's estimate) x 4 bytes must fit one GPU core's register file "
        f"({REGISTER_FILE_BYTES // 1024} KB, Apple7/8); threadgroup memory within 32 KB."
    )
    print(f"{'shape':>13} {'KV':>8} {'kernel':>30} {'threads':>7} {'regs':>5} {'reg KB':>6} {'tg bytes':>8}  variant")
    for r in launch_limit_rows():
        print(
            f"{r['shape']:>13} {r['kv']:>8} {r['kernel']:>30} {r['threads']:>7} "
            f"{r['registers']:>5} {r['register_file_bytes'] / 1024:>6.0f} "
            f"{r['threadgroup_bytes']:>8,}  {r['variant']}"
        )
    print()


def print_cost(seqs: int, tokens: int, as_json: bool, kv_bits: int | None = None, kv_group: int = 32) -> int:
    """Launch limits per variant, then operation counts of the emulated kernel per K/V token
    row and per (token, query head)."""
    if not as_json:
        print_limits()
    rows = [
        dict(model=m, **cost_model(g, hd, seqs=seqs, tokens=tokens, kv_bits=kv_bits, kv_group=kv_group))
        for m, g, hd in COST_SHAPES
    ]
    if as_json:
        print(
            json.dumps(
                {
                    "seqs": seqs,
                    "tokens": tokens,
                    "provenance": provenance(),
                    "rows": rows,
                    "launch_limits": launch_limit_rows(),
                },
                indent=1,
            )
        )
        return 0
    kv = f"{kv_bits}-bit KV (group {kv_group})" if kv_bits else "fp16 KV"
    print(
        f"Emulator cost model: {seqs} sequences x {tokens} tokens, 2 kv heads, block 16, {kv}, "
        "single pass. Per K/V token row (one token, one kv head) unless noted; exp counts are "
        "SIMD-wide (lane calls / 32); steps/tok: shuffle steps, a simd_sum/max counting 5."
    )
    print(
        f"{'model':>13} {'G':>2} {'hd':>4} {'red/tok':>8} {'red/tok/head':>12} {'shfl/tok':>8} "
        f"{'steps/tok':>9} "
        f"{'exp/tok/head':>12} {'bar/256tok':>10} {'loop bar/256':>12} {'regs':>5}  loads/tok by width"
    )
    for r in rows:
        loads = " ".join(f"{w}B:{n:.2f}" for w, n in r["device_loads_per_token"].items())
        print(
            f"{r['model']:>13} {r['group']:>2} {r['head_dim']:>4} "
            f"{r['simd_reductions_per_token']:>8.3f} {r['simd_reductions_per_token_head']:>12.3f} "
            f"{r['simd_shuffles_per_token']:>8.3f} "
            f"{5 * r['simd_reductions_per_token'] + r['simd_shuffles_per_token']:>9.2f} "
            f"{r['exp_per_token_head']:>12.3f} "
            f"{r['barriers_per_256_tokens']:>10.3f} {r['loop_barriers_per_256_tokens']:>12.3f} "
            f"{r['registers']:>5}  {loads}"
        )
    return 0


def print_kv_bytes(seqs: int, tokens: int, group_size: int, as_json: bool, planned: bool = False) -> int:
    """Bytes the emulated decode kernel reads per context token for 16/8/4-bit KV caches."""
    rows = kv_bytes_rows(seqs=seqs, tokens=tokens, group_size=group_size, partition_tokens=None if planned else 0)
    if as_json:
        print(json.dumps({"seqs": seqs, "tokens": tokens, "provenance": provenance(), "rows": rows}, indent=1))
        return 0
    path = "the planner's path" if planned else "single pass"
    print(
        f"Emulated decode kernel, {path}: {seqs} sequences x {tokens} tokens, block 16, "
        f"fp16 queries/scales, quantization group {group_size}. Bytes per token: all bytes read "
        "/ context tokens (one layer: K and V of every kv head, plus queries, tables, lengths)."
    )
    print(
        f"{'model':>13} {'heads':>9} {'hd':>4} {'KV bits':>7} {'bytes/token':>11} "
        f"{'minimum':>8} {'ratio':>6} {'vs 16-bit':>9} {'max err':>8}  kernels"
    )
    for r in rows:
        print(
            f"{r['model']:>13} {r['heads']:>4}/{r['kv_heads']:<4} {r['head_dim']:>4} "
            f"{r['kv_bits']:>7} {r['bytes_per_token']:>11.1f} {r['minimum_per_token']:>8.1f} "
            f"{r['ratio']:>6.3f} {r['vs_16bit']:>9.3f} {r['max_error']:>8.2g}  {r['kernels']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
