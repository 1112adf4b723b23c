"""Perplexity of the float KV cache against 8-bit and 4-bit K/V, and tokens per GB of pool.

Texts: the repo's Python snippet (tests/data/perplexity_snippet.py, the weights perplexity
test's text) and the first Alpaca records. Each runs through the model on the paged cache in
prefill chunks of `--chunk` tokens (`mlxpaged.bench.kv_quality`), so later chunks attend to K/V
stored at the cache's bits, and every next token is scored. Deterministic: one run says all.
Keys are quantized over per-channel scales measured on the package's calibration text (not
either scored text; `mlxpaged/kv_calibration.py`); `--no-key-scales` turns them off.

    python scripts/kv_quality.py                    # the offline Qwen2.5-Coder-0.5B, float32
    python scripts/kv_quality.py --chunk 64 --group-size 32

The bounds it checks: 8-bit within 1% of the float cache's perplexity, 4-bit within 5%.
"""

from __future__ import annotations

import argparse
import sys
import time

import mlxpaged  # noqa: F401  (first: system BLAS on Linux)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the offline Qwen2.5-Coder-0.5B-Instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--chunk", type=int, default=16, help="prefill chunk (tokens per forward pass)")
    ap.add_argument("--group-size", type=int, default=64, choices=[32, 64])
    ap.add_argument("--alpaca-records", type=int, default=12)
    ap.add_argument(
        "--no-key-scales",
        action="store_true",
        help="quantize keys without the per-channel scales from the calibration text (as before them)",
    )
    args = ap.parse_args()

    import mlx.core as mx

    from mlxpaged.bench.kv_quality import SNIPPET, alpaca_text, paged_perplexity, tokens_per_gb
    from mlxpaged.errors import MlxPagedError
    from mlxpaged.loading.loader import load
    from mlxpaged.worker.kv_cache import CacheShape

    try:
        loaded = load(args.model, args.dtype)
    except (ValueError, MlxPagedError) as e:
        sys.exit(f"error: {e}")
    tok = loaded.tokenizer
    texts = {"python snippet": SNIPPET.read_text(), "alpaca": alpaca_text(args.alpaca_records)}
    print(
        f"model {loaded.path} ({loaded.dtype}); prefill chunk {args.chunk}; K/V group size {args.group_size}; "
        f"key scales {'off' if args.no_key_scales else 'from the calibration text'}"
    )
    print(
        f"{'text':>15} | {'tokens':>6} | {'float':>8} | {'8-bit':>8} | {'8-bit / float':>13} | {'4-bit':>8} | "
        f"{'4-bit / float':>13} | seconds (float, 8, 4)"
    )
    for name, text in texts.items():
        ids = tok.encode(text)
        ppl, secs = {}, []
        for bits in (None, 8, 4):
            t = time.perf_counter()
            ppl[bits] = paged_perplexity(
                loaded,
                ids,
                kv_bits=bits,
                kv_group_size=args.group_size,
                chunk=args.chunk,
                calibrate=not args.no_key_scales,
            )
            secs.append(time.perf_counter() - t)
        print(
            f"{name:>15} | {len(ids):6d} | {ppl[None]:8.4f} | {ppl[8]:8.4f} | {ppl[8] / ppl[None]:13.5f} | "
            f"{ppl[4]:8.4f} | {ppl[4] / ppl[None]:13.5f} | {', '.join(f'{s:.1f}' for s in secs)}"
        )

    shape = CacheShape.of(loaded)
    print(
        f"\ntokens per GB (1e9 bytes) of pool, {shape.num_layers} layers x {shape.num_kv_heads} KV heads x head_dim "
        f"{shape.head_dim}, scales and biases in the pool's dtype, group {args.group_size}:"
    )
    for dtype in (mx.float16, mx.float32):
        base = tokens_per_gb(shape, None, dtype=dtype)
        row = [f"{'16' if dtype == mx.float16 else '32'}-bit {base:,.0f}"]
        row += [
            f"{b}-bit {tokens_per_gb(shape, b, args.group_size, dtype=dtype):,.0f} "
            f"({tokens_per_gb(shape, b, args.group_size, dtype=dtype) / base:.2f}x)"
            for b in (8, 4)
        ]
        print(f"  {str(dtype).split('.')[-1]:>8} pool: " + "; ".join(row))


if __name__ == "__main__":
    main()
