"""Cost of writing one decode step's keys and values into the paged pool, by pool size.

mlxpaged's write is an MLX scatter into a pool the cache alone references, so MLX updates it in
place: the cost should not depend on the pool's size, and memory should not grow per step. The
peer in the same run is the same scatter on a pool that something else still references (as a
functional update would be), which forces MLX to copy the whole pool each step.

    python scripts/bench_kv_write.py --batch 32 --steps 50
"""

from __future__ import annotations

import argparse
import time

import mlxpaged  # noqa: F401  (first: OpenBLAS must load before MLX, mlxpaged/_blas.py)

# isort: split
import mlx.core as mx

from mlxpaged.worker.kv_cache import CacheShape, PagedKVCache


def time_writes(cache: PagedKVCache, k: mx.array, steps: int, keep_alias: bool) -> tuple[float, int]:
    """Seconds per write and active-memory growth over `steps` writes."""
    slots = mx.arange(k.shape[0], dtype=mx.int32) * cache.block_size
    aliases = []
    mx.eval(k, slots)
    base, t0 = None, None
    for step in range(steps + 5):
        if step == 5:
            aliases.clear()
            mx.eval(cache.keys, cache.values)
            base, t0 = mx.get_active_memory(), time.perf_counter()
        if keep_alias:
            # A view sharing the pool's buffer: the scatter may no longer update it in place.
            aliases[:] = [cache.keys[0].reshape(-1)]
            mx.eval(aliases)
        cache.write(0, k, k, slots + step % cache.block_size)
        mx.eval(cache.keys[0], cache.values[0])
    aliases.clear()
    return (time.perf_counter() - t0) / steps, mx.get_active_memory() - base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32, help="sequences writing one token each")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args()
    shape = CacheShape(1, args.kv_heads, args.head_dim, mx.float32)
    k = mx.random.normal((args.batch, args.kv_heads, args.head_dim))
    print(
        f"one layer, {args.kv_heads} KV heads x {args.head_dim}, float32, {args.batch} tokens per write, "
        f"device {mx.default_device()}"
    )
    print(
        f"{'pool slots':>10} | {'pool MB':>8} | {'in place us':>11} | {'growth B/step':>13} | "
        f"{'copying us':>10} | {'copy / in place':>15}"
    )
    for slots in [1 << 10, 1 << 13, 1 << 16, 1 << 18]:
        cache = PagedKVCache(shape, slots // 16, 16)
        t_in, grow = time_writes(cache, k, args.steps, keep_alias=False)
        t_copy, _ = time_writes(cache, k, max(5, args.steps // 5), keep_alias=True)
        print(
            f"{slots:>10} | {cache.nbytes / 2**20:8.1f} | {t_in * 1e6:11.1f} | {grow / args.steps:13.0f} | "
            f"{t_copy * 1e6:10.1f} | {t_copy / t_in:15.1f}"
        )


if __name__ == "__main__":
    main()
