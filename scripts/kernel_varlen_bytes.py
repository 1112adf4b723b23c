"""Bytes the varlen Metal kernel reads, and its cost-model counts, in the MSL emulator: one
chunk over a cached prefix at Qwen2.5 head shapes (float16, block size 16).

    python scripts/kernel_varlen_bytes.py 512 2048      # a 512-token chunk over 2,048 cached tokens (minutes)
    python scripts/kernel_varlen_bytes.py 512 2048 --model 0.5b   # Qwen2.5-0.5B heads (default 1.5b)
    python scripts/kernel_varlen_bytes.py 64 1024 --kv-bits 4 [--kv-group 32]   # a 4-bit KV cache
    python scripts/kernel_varlen_bytes.py 64 256 --path mma      # one kernel (default: both)

Float caches run both kernels on the same inputs: `mma` (8x8 simdgroup_matrix QK^T and PV, what
these shapes select) and `lanes` (lanes per query row, the fallback for other shapes). A
quantized cache has the lanes kernel only. The varlen bound is the decode kernel's minimum
(each K/V row once) times ceil(chunk / 16); for a quantized cache each row's minimum is its codes,
scales and biases. Cost counts (see mlxpaged/metal_emu/README.md) are SIMD-wide: shuffles,
reductions and simdgroup MMAs per simdgroup-wide call, exp calls per lane / 32; normalised per
query row (token x query head), and per score (query row x causally visible key).
"""

from __future__ import annotations

import sys
import time

import mlxpaged  # noqa: F401  (first: OpenBLAS must load before MLX, mlxpaged/_blas.py)

# isort: split
import mlx.core as mx
import numpy as np

from mlxpaged.attention import metal, metal_varlen
from mlxpaged.attention.kv_quant import QuantizedPool
from mlxpaged.attention.reference import paged_attention_varlen_reference
from mlxpaged.metal_emu import emulate
from mlxpaged.utils import cdiv

MODELS = {"0.5b": ("Qwen2.5-0.5B", 14, 2, 64), "1.5b": ("Qwen2.5-1.5B", 12, 2, 128)}


def option(name: str, default, cast=int):
    """The value after `name` on the command line, else `default`."""
    return cast(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def run(path: str, args, scale: float):
    """(output, launch) of the varlen kernel `path` ("mma" or "lanes") on `args`."""
    real = metal_varlen.mma_fits
    if path == "lanes":
        metal_varlen.mma_fits = lambda head_dim, group: False
    try:
        with emulate():
            out, (launch,) = metal_varlen.run_with_launches(*args, scale=scale)
            mx.eval(out)
    finally:
        metal_varlen.mma_fits = real
    return out, launch


def main() -> None:
    pos = [a for i, a in enumerate(sys.argv[1:], 1) if not a.startswith("--") and not sys.argv[i - 1].startswith("--")]
    chunk, prefix = (int(a) for a in pos[:2]) if len(pos) >= 2 else (512, 2048)
    bits, group = option("--kv-bits", None), option("--kv-group", 32)
    model = option("--model", "1.5b", str)
    path_opt = option("--path", "both", str)
    if model not in MODELS or path_opt not in ("both", "mma", "lanes"):
        sys.exit("--model is 0.5b or 1.5b; --path is both, mma or lanes")
    if bits and path_opt == "mma":
        sys.exit("a quantized cache runs the lanes kernel only")
    paths = ["lanes"] if bits else (["mma", "lanes"] if path_opt == "both" else [path_opt])
    name, heads, kvh, hd = MODELS[model]
    rng = np.random.default_rng(0)
    bs = 16
    ctx = chunk + prefix
    nb = cdiv(ctx, bs)
    table = rng.permutation(nb + 3)[:nb].astype(np.int32)[None]
    kc, vc = (mx.array(rng.normal(size=(nb + 3, kvh, bs, hd)), dtype=mx.float16) for _ in range(2))
    if bits:
        kc, vc = (QuantizedPool.quantize(c, bits, group) for c in (kc, vc))
    q = mx.array(rng.normal(size=(chunk, heads, hd)), dtype=mx.float16)
    cu, lens = mx.array(np.array([0, chunk], np.int32)), mx.array(np.array([ctx], np.int32))
    args = (q, kc, vc, mx.array(table), cu, lens)
    # Quantized: the values the kernel stages (fp32 dequantization rounded once to float16).
    kf, vf = (metal.dequantized(c).astype(mx.float16) for c in (kc, vc))
    ref = paged_attention_varlen_reference(q, kf, vf, mx.array(table), cu, lens, hd**-0.5)
    rows = chunk * heads  # query rows: (token, query head)
    scores = heads * sum(prefix + j + 1 for j in range(chunk))  # causally visible (row, key) pairs
    minimum, tiles = metal.minimum_bytes(q, kc, lens), cdiv(chunk, 16)
    print(
        f"{name} heads: {heads} query heads, {kvh} kv heads, head_dim {hd}; a {chunk}-token "
        f"chunk over {prefix} cached tokens, float16{f', {bits}-bit KV' if bits else ''}"
    )
    costs = {}
    for path in paths:
        t = time.time()
        out, launch = run(path, args, hd**-0.5)
        stats, st = launch.kernel.last_stats, launch.kernel.last_launch
        err = float(mx.max(mx.abs(out.astype(mx.float32) - ref.astype(mx.float32))))
        total = sum(stats.values())
        print(
            f"\n[{path}] kernel {launch.kind}_{launch.variant}, emulated in {time.time() - t:.0f} s, "
            f"max |error| {err:.2e}"
        )
        print("| input | bytes read |\n| --- | --- |")
        for k, v in stats.items():
            print(f"| {k} | {v:,} |")
        print(f"| total | {total:,} |")
        print(
            f"bound = minimum {minimum:,} x ceil({chunk}/16) = {minimum * tiles:,}; "
            f"read / bound = {total / (minimum * tiles):.3f}"
        )
        costs[path] = dict(
            shuffles=st.simd_shuffles,
            reductions=st.simd_reductions,
            exp=(st.exp_calls + st.exp2_calls) / 32,
            precise=st.exp_calls / 32,
            mma=st.simdgroup_mma,
            matrix_loads=st.simdgroup_matrix_loads,
            barriers=st.barriers,
            registers=st.registers,
            tg_bytes=st.threadgroup_memory_bytes,
            threads=st.threads_per_threadgroup,
            regfile=st.threadgroup_register_bytes,
        )
    # exp / row counts exp and fast::exp2 together; "precise" is the share that is a precise
    # exp (MLX compiles custom kernels without fast math). Register file: threads x registers x
    # 4 bytes per threadgroup, against 208 KB (metal_varlen.REGISTER_FILE_BYTES).
    print(
        "\n| kernel | shuffles / row | reductions / row | exp / row | precise exp / row "
        "| MMA / row | shuffles / score | exp / score | MMA / score | matrix loads / row "
        "| threads | registers | register file KB | threadgroup bytes |"
    )
    print("| --- " * 14 + "|")
    for path, c in costs.items():
        print(
            f"| {path} | {c['shuffles'] / rows:.2f} | {c['reductions'] / rows:.2f} "
            f"| {c['exp'] / rows:.2f} | {c['precise'] / rows:.2f} | {c['mma'] / rows:.2f} "
            f"| {c['shuffles'] / scores:.4f} "
            f"| {c['exp'] / scores:.4f} | {c['mma'] / scores:.4f} "
            f"| {c['matrix_loads'] / rows:.2f} | {c['threads']} | {c['registers']} "
            f"| {c['regfile'] / 1024:.0f} | {c['tg_bytes']:,} |"
        )
    if len(costs) == 2:
        a, b = costs["lanes"], costs["mma"]
        print(
            f"lanes / mma: shuffles {a['shuffles'] / max(b['shuffles'], 1):.1f}x, "
            f"exp {a['exp'] / max(b['exp'], 1e-9):.2f}x"
        )


if __name__ == "__main__":
    main()
