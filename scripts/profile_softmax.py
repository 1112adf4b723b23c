"""Where attention's time goes on MLX's CPU backend at a long context: one layer's
`mx.fast.scaled_dot_product_attention` for `n` new tokens over `c` keys at Qwen2.5-0.5B's shapes
(14 query heads, 2 KV heads, head dim 64, float32), with each mask the engines pass, and the
same computation as explicit ops split into its parts: QK^T, the `exp` over the scores, PV;
numpy's `exp` over the same scores is the reference for what a vectorized exp costs.

mlxpaged's CPU reference path (`attention/reference.py`) and mlx-lm both call this SDPA, so
this is the cost both engines pay per layer for a prefill over a cached prefix (the agent load
of `bench_http.py`: about 210 new tokens over 2,000 cached) and for a cold prompt (n = c).
Median of `--iters` timed calls after one warm-up, milliseconds.

    python scripts/profile_softmax.py --shapes 211x2211,2015x2015,1x2211
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlxpaged  # noqa: F401  (first: OpenBLAS must load before MLX, mlxpaged/_blas.py)

# isort: split
import mlx.core as mx
import numpy as np


def timed(f, iters: int) -> float:
    f()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        f()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def one(n: int, c: int, heads: int, kv_heads: int, dim: int, iters: int) -> dict[str, float]:
    q = mx.random.normal((1, heads, n, dim))
    k = mx.random.normal((1, kv_heads, c, dim))
    v = mx.random.normal((1, kv_heads, c, dim))
    allowed = mx.arange(c - n, c)[:, None] >= mx.arange(c)[None, :]  # [n, c] bool, as reference.py builds it
    additive = mx.where(allowed, 0.0, -mx.inf)
    g = heads // kv_heads
    qg = q.reshape(kv_heads, g * n, dim) * dim**-0.5  # [kv_heads, g*n, dim]: GQA as one matmul per KV head
    scores = qg @ k[0].swapaxes(-1, -2)  # [kv_heads, g*n, c]
    probs = mx.softmax(scores, axis=-1)
    mx.eval(q, k, v, allowed, additive, qg, scores, probs)
    s = dim**-0.5
    sdpa = mx.fast.scaled_dot_product_attention
    host = np.array(scores)
    return {
        "sdpa, bool mask": timed(lambda: mx.eval(sdpa(q, k, v, scale=s, mask=allowed)), iters),
        "sdpa, causal": timed(lambda: mx.eval(sdpa(q, k, v, scale=s, mask="causal")), iters),
        "sdpa, additive mask": timed(lambda: mx.eval(sdpa(q, k, v, scale=s, mask=additive)), iters),
        "QK^T": timed(lambda: mx.eval(qg @ k[0].swapaxes(-1, -2)), iters),
        "mx.exp(scores)": timed(lambda: mx.eval(mx.exp(scores)), iters),
        "mx.softmax(scores)": timed(lambda: mx.eval(mx.softmax(scores, axis=-1)), iters),
        "PV": timed(lambda: mx.eval(probs @ v[0]), iters),
        "np.exp(scores)": timed(lambda: np.exp(host), iters),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="211x2211,2015x2015,1x2211", help="NEWxCONTEXT pairs, comma-separated")
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    try:
        shapes = [tuple(int(x) for x in p.split("x")) for p in a.shapes.split(",") if p]
        if any(len(p) != 2 or not 1 <= p[0] <= p[1] for p in shapes):
            raise ValueError
    except ValueError:
        print(f"error: --shapes must be NEWxCONTEXT pairs with 1 <= NEW <= CONTEXT, got {a.shapes!r}", file=sys.stderr)
        return 1
    if a.heads % a.kv_heads:
        print(f"error: --heads {a.heads} is not a multiple of --kv-heads {a.kv_heads}", file=sys.stderr)
        return 1
    print(f"MLX {mx.__version__} on {mx.default_device()}, float32, {a.heads}/{a.kv_heads} heads, dim {a.head_dim}")
    for n, c in shapes:
        r = one(n, c, a.heads, a.kv_heads, a.head_dim, a.iters)
        cells = ", ".join(f"{k} {v:.1f}" for k, v in r.items())
        print(f"{n} new x {c} keys ({a.heads * n * c / 1e6:.1f} M scores), ms per layer: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
