"""Bytes the varlen Metal kernel reads, in the MSL emulator, at Qwen2.5-1.5B head shapes
(12 heads, 2 KV heads, head_dim 128, float16, block size 16): one chunk over a cached prefix.

    python scripts/kernel_varlen_bytes.py 512 2048      # a 512-token chunk over 2,048 cached tokens (minutes)
    python scripts/kernel_varlen_bytes.py 64 1024 --kv-bits 4 [--kv-group 32]   # a 4-bit KV cache

The bound of issue 11 is the decode kernel's minimum (each K/V row once) times ceil(chunk / 16);
for a quantized cache each row's minimum is its codes, scales and biases.
"""

from __future__ import annotations

import sys
import time

import mlxpaged  # noqa: F401  (first: system BLAS on Linux)
import mlx.core as mx
import numpy as np

from mlxpaged.attention import metal
from mlxpaged.attention import metal_varlen
from mlxpaged.attention.reference import paged_attention_varlen_reference
from mlxpaged.kv_quant import QuantizedPool
from mlxpaged.metal_emu import emulate
from mlxpaged.utils import cdiv


def option(name: str, default):
    """The value after `name` on the command line, else `default`."""
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def main() -> None:
    pos = [a for i, a in enumerate(sys.argv[1:], 1) if not a.startswith("--")
           and not sys.argv[i - 1].startswith("--")]
    chunk, prefix = (int(a) for a in pos[:2]) if len(pos) >= 2 else (512, 2048)
    bits, group = option("--kv-bits", None), option("--kv-group", 32)
    rng = np.random.default_rng(0)
    bs, kvh, hd, heads = 16, 2, 128, 12
    ctx = chunk + prefix
    nb = cdiv(ctx, bs)
    table = rng.permutation(nb + 3)[:nb].astype(np.int32)[None]
    kc, vc = (mx.array(rng.normal(size=(nb + 3, kvh, bs, hd)), dtype=mx.float16) for _ in range(2))
    if bits:
        kc, vc = (QuantizedPool.quantize(c, bits, group) for c in (kc, vc))
    q = mx.array(rng.normal(size=(chunk, heads, hd)), dtype=mx.float16)
    cu, lens = mx.array(np.array([0, chunk], np.int32)), mx.array(np.array([ctx], np.int32))
    t = time.time()
    with emulate():
        out, (launch,) = metal_varlen.run_with_launches(q, kc, vc, mx.array(table), cu, lens, scale=hd**-0.5)
        mx.eval(out)
        stats = launch.kernel.last_stats
    # Quantized: the values the kernel stages (fp32 dequantization rounded once to float16).
    kf, vf = (metal.dequantized(c).astype(mx.float16) for c in (kc, vc))
    ref = paged_attention_varlen_reference(q, kf, vf, mx.array(table), cu, lens, hd**-0.5)
    err = float(mx.max(mx.abs(out.astype(mx.float32) - ref.astype(mx.float32))))
    total, minimum, tiles = sum(stats.values()), metal.minimum_bytes(q, kc, lens), cdiv(chunk, 16)
    print(f"kernel {launch.kind}_{launch.variant}, emulated in {time.time() - t:.0f} s, max |error| {err:.2e}")
    print("| input | bytes read |\n| --- | --- |")
    for k, v in stats.items():
        print(f"| {k} | {v:,} |")
    print(f"| total | {total:,} |")
    print(f"bound = minimum {minimum:,} x ceil({chunk}/16) = {minimum * tiles:,}; read / bound = {total / (minimum * tiles):.3f}")


if __name__ == "__main__":
    main()
