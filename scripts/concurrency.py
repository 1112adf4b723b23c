"""How many requests run at once in a fixed KV budget: mlxpaged's engine against contiguous reservations.

The engine (tiny random model by default: the allocator does not care what the weights are) runs
requests with real ShareGPT or Alpaca (prompt, answer) lengths in 15,700 slots; the allocator is
read after every step. The same requests go through contiguous `max` (2,048-slot window),
`pow2` and `oracle` reservations at the same budget.

    python scripts/concurrency.py --trace sharegpt --num-requests 200
    python scripts/concurrency.py --model PATH        # a real model instead of the tiny one
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlxpaged  # noqa: F401  (first: system BLAS on Linux)

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="both", choices=["sharegpt", "alpaca", "both"])
    ap.add_argument("--num-requests", type=int, default=400)
    ap.add_argument("--capacity", type=int, default=15_700, help="KV budget in token slots")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--model", default=None, help="default: a tiny random-weight Qwen2")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()

    from tqdm import tqdm

    from mlxpaged.bench.concurrency import contiguous_concurrency, engine_concurrency
    from mlxpaged.bench.models import tiny_checkpoint
    from mlxpaged.loader import load
    from mlxpaged.waste import load_pairs

    loaded = load(args.model or tiny_checkpoint(layers=1, hidden=128, intermediate=256), "float32")
    out = {}
    for trace in (["sharegpt", "alpaca"] if args.trace == "both" else [args.trace]):
        pairs = [(p, a) for p, a in load_pairs(ROOT / "scripts" / "data" / f"{trace}_lengths.json") if a > 0]
        pairs = pairs[: args.num_requests]
        with tqdm(total=len(pairs), desc=f"{trace}: engine", unit="req", file=sys.stderr) as bar:
            paged = engine_concurrency(loaded, pairs, capacity=args.capacity, block_size=args.block_size,
                                       progress=bar.update)
        rows = [paged] + [contiguous_concurrency(pairs, s, capacity=args.capacity) for s in ("max", "pow2", "oracle")]
        print(f"\n{trace}: {len(pairs)} requests, {args.capacity} KV slots")
        print(f"{'scheme':>12} | {'real/reserved':>13} | {'running (saturated)':>19} | {'mean running':>12} | "
              f"{'peak':>5} | {'steps':>6} | {'mlxpaged / this (saturated)':>27}")
        for r in rows:
            print(f"{r.scheme:>12} | {100 * r.real_share:12.1f}% | {r.saturated_running:19.1f} | {r.mean_running:12.1f} | "
                  f"{r.peak_running:5d} | {r.steps:6d} | {paged.saturated_running / r.saturated_running:27.2f}")
        print(f"mlxpaged preemptions: {paged.preemptions}")
        out[trace] = [r.as_dict() for r in rows]
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
