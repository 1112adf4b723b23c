"""How many requests run at once in a fixed KV budget: mlxpaged's engine against contiguous reservations.

The engine (tiny random model by default: the allocator does not care what the weights are) runs
requests with real ShareGPT or Alpaca (prompt, answer) lengths in 15,700 slots; the allocator is
read after every step. The same requests go through contiguous `max` (2,048-slot window),
`pow2` and `oracle` reservations at the same budget.

    python scripts/concurrency.py --trace sharegpt --num-requests 200
    python scripts/concurrency.py --model PATH        # a real model instead of the tiny one
    python scripts/concurrency.py --kv-bits 8 4       # also: 8- and 4-bit K/V in the same bytes

With `--kv-bits`, the KV memory is fixed instead of the slots: `--capacity` slots of the float16
cache, and each quantized cache gets the blocks those bytes buy (`compare_kv_bits`); the table
gives each against the float cache.

Beside the headline (running at once while others wait) it prints the preemptions, the prefill
recomputed, the mean number running and the steps to drain the queue (`mlxpaged.bench.concurrency`).
"""

from __future__ import annotations

import argparse
import sys

import mlxpaged  # noqa: F401  (first: system BLAS on Linux)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="both", choices=["sharegpt", "alpaca", "both"])
    ap.add_argument("--num-requests", type=int, default=400)
    ap.add_argument("--capacity", type=int, default=15_700, help="KV budget in token slots")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--model", default=None, help="default: a tiny random-weight Qwen2")
    ap.add_argument(
        "--kv-bits",
        type=int,
        nargs="+",
        choices=[8, 4],
        default=[],
        help="also run quantized K/V caches in the float16 cache's bytes",
    )
    ap.add_argument("--kv-group-size", type=int, default=64, choices=[32, 64])
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()

    from tqdm import tqdm

    from mlxpaged.bench.concurrency import compare, compare_kv_bits, headline, kv_table, table
    from mlxpaged.bench.models import model_label, tiny_checkpoint
    from mlxpaged.bench.report import write_json
    from mlxpaged.data import load_trace
    from mlxpaged.errors import MlxPagedError
    from mlxpaged.loading.loader import load

    try:
        # head_dim 64 (the 0.5B's): the bytes per token, and so the quantized ratios, are the real model's
        loaded = load(args.model or tiny_checkpoint(layers=1, hidden=128, heads=2, intermediate=256), "float32")
    except (ValueError, MlxPagedError) as e:
        sys.exit(f"error: {e}")
    out = {}
    for trace in ["sharegpt", "alpaca"] if args.trace == "both" else [args.trace]:
        pairs = [(p, a) for p, a in load_trace(trace) if a > 0][: args.num_requests]
        try:
            with tqdm(total=len(pairs), desc=f"{trace}: engine", unit="req", file=sys.stderr) as bar:
                rows = compare(loaded, pairs, capacity=args.capacity, block_size=args.block_size, progress=bar.update)
        except (ValueError, MlxPagedError) as e:
            sys.exit(f"error: {e}")
        print(f"\n{trace}: {len(pairs)} requests, {args.capacity} KV slots")
        print("\n".join(table(rows)))
        out[trace] = {"rows": [r.as_dict() for r in rows], "headline_vs_oracle": headline(rows)}
        if args.kv_bits:
            with tqdm(
                total=len(pairs) * (1 + len(args.kv_bits)), desc=f"{trace}: kv bits", unit="req", file=sys.stderr
            ) as bar:
                kv_rows = compare_kv_bits(
                    loaded,
                    pairs,
                    capacity=args.capacity,
                    block_size=args.block_size,
                    bits=args.kv_bits,
                    kv_group_size=args.kv_group_size,
                    progress=bar.update,
                )
            print(f"\n{trace}: the bytes of {args.capacity} float16 KV slots, K/V group {args.kv_group_size}")
            print("\n".join(kv_table(kv_rows)))
            out[trace]["kv_bits"] = [r.as_dict() for r in kv_rows]
    if args.json_out:
        payload = {
            "capacity": args.capacity,
            "block_size": args.block_size,
            "num_requests": args.num_requests,
            "kv_bits": args.kv_bits,
            "kv_group_size": args.kv_group_size,
            "deterministic": "step counts, not timings: one run says all",
            "traces": out,
        }
        path = write_json(args.json_out, "concurrency", model_label(loaded, args.model, args.model is None), payload)
        print(f"results: {path}")


if __name__ == "__main__":
    main()
