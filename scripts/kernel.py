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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing

import mlx.core as mx  # noqa: E402

from mlxpaged.attention import metal, metal_native  # noqa: E402
from mlxpaged.attention.reference import paged_attention_reference  # noqa: E402

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


def median_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
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
            kc, vc = (c[bt].transpose(0, 2, 1, 3, 4).reshape(seqs, KV_HEADS, -1, HEAD_DIM)
                      [:, :, :tokens] for c in (k, v))
            mx.eval(kc, vc)
            paged = median_ms(lambda: metal.paged_attention_metal(q, k, v, bt, cl, scale=scale))
            sdpa = median_ms(lambda: mx.fast.scaled_dot_product_attention(
                q[:, :, None, :], kc, vc, scale=scale))
            gbs = metal.minimum_bytes(q, k, cl) / paged / 1e6
            rows.append(dict(block_size=bs, scattered=scattered, paged_ms=paged, sdpa_ms=sdpa,
                             paged_over_sdpa=paged / sdpa, paged_gb_s=gbs, max_error=err))
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
                _, single = metal.run_with_launches(q, k, v, bt, cl, scale=scale,
                                                    partition_tokens=0)
                single_read = metal.bytes_read(single)
                rows.append(dict(block_size=bs, scattered=scattered,
                                 kernels="+".join(l.kind for l in launches), bytes_read=read,
                                 minimum_bytes=least, ratio=read / least,
                                 single_pass_ratio=single_read / least, max_error=err,
                                 emulator_s=seconds))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, help="sequences (default 16 on a GPU, 4 emulated)")
    ap.add_argument("--tokens", type=int, help="tokens each (default 4096 on a GPU, 1024 emulated)")
    ap.add_argument("--max-block", type=int, default=256)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    sizes = [bs for bs in BLOCK_SIZES if bs <= args.max_block]
    gpu = metal_native() and os.environ.get("MLXPAGED_METAL") != "emulate"
    seqs = args.seqs or (16 if gpu else 4)
    tokens = args.tokens or (4096 if gpu else 1024)
    rows = gpu_rows(seqs, tokens, sizes) if gpu else emulator_rows(seqs, tokens, sizes)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{seqs} sequences x {tokens} tokens, {HEADS} heads / {KV_HEADS} kv heads, "
          f"head_dim {HEAD_DIM}, fp16")
    if gpu:
        print(f"{'block':>5} {'layout':>9} {'paged ms':>9} {'sdpa ms':>8} {'ratio':>6} "
              f"{'GB/s':>6} {'max err':>8}")
        for r in rows:
            print(f"{r['block_size']:>5} {'scattered' if r['scattered'] else 'in order':>9} "
                  f"{r['paged_ms']:>9.3f} {r['sdpa_ms']:>8.3f} {r['paged_over_sdpa']:>6.2f} "
                  f"{r['paged_gb_s']:>6.0f} {r['max_error']:>8.2g}")
        return 0
    print("No Apple GPU: bytes read by the emulated kernel; timings need an Apple GPU.")
    print("ratio: bytes read / minimum for the path the planner chose; single: the one-pass "
          "kernel on the same inputs.")
    print(f"{'block':>5} {'layout':>9} {'kernels':>12} {'bytes read':>11} {'minimum':>11} "
          f"{'ratio':>7} {'single':>7} {'max err':>8}")
    for r in rows:
        kernels = "split+merge" if "merge" in r["kernels"] else "single pass"
        print(f"{r['block_size']:>5} {'scattered' if r['scattered'] else 'in order':>9} "
              f"{kernels:>12} {r['bytes_read']:>11,} {r['minimum_bytes']:>11,} "
              f"{r['ratio']:>7.4f} {r['single_pass_ratio']:>7.4f} {r['max_error']:>8.2g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
