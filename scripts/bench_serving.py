"""Serving benchmark: a ShareGPT-shaped replay through mlxpaged's `LLMEngine` and mlx-lm's `BatchGenerator`.

Requests take (prompt, answer) lengths from `mlxpaged/data/sharegpt_lengths.json` (prompts are
synthetic ids of those lengths) and arrive at `--rate` per second (0: all at once). mlxpaged runs at
a fixed KV budget (`--kv-tokens`). The first case has no shared prefix (mlxpaged's prefix cache
off); the second puts one shared system prompt in front of every request, with mlxpaged's prefix
cache on and mlx-lm given an `LRUPromptCache` holding that system prompt's KV (prefilled once,
inside the clock), as its server would. Each case runs `--repeats` times, alternating which
system goes first; ratios are mlxpaged / mlx-lm, median (min-max). The code is
`mlxpaged.bench.serving`.

    python scripts/bench_serving.py --num-requests 32 --kv-tokens 8192
    python scripts/bench_serving.py --tiny --num-requests 64
"""

from __future__ import annotations

import argparse
import sys

import mlxpaged  # noqa: F401  (first: system BLAS on Linux)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--trace", default="sharegpt", choices=["sharegpt", "alpaca"])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=0.0, help="requests per second (0: all at t=0)")
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--kv-tokens", type=int, default=8192, help="mlxpaged's KV budget in tokens")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument(
        "--system-prompt", type=int, default=256, help="shared system prompt tokens in the second case (0 skips it)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs of each case, alternating which system goes first")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()

    from mlxpaged.bench.models import load_models, model_label
    from mlxpaged.bench.report import write_json
    from mlxpaged.bench.serving import compare, load_trace, table
    from mlxpaged.errors import MlxPagedError

    try:
        loaded, ref = load_models(args.model, args.tiny, args.dtype)
        label = model_label(loaded, args.model, args.tiny)
        print(
            f"model {label} ({loaded.dtype}); {args.num_requests} {args.trace} requests at rate "
            f"{args.rate or 'inf'}; mlxpaged KV budget {args.kv_tokens} tokens; {args.repeats} repeats",
            flush=True,
        )
        settings = {
            k: getattr(args, k)
            for k in (
                "trace",
                "num_requests",
                "rate",
                "max_prompt",
                "max_output",
                "kv_tokens",
                "block_size",
                "max_num_seqs",
                "system_prompt",
                "repeats",
            )
        }
        rows = compare(loaded, ref, load_trace(args.trace), **{k: v for k, v in settings.items() if k != "trace"})
    except (ValueError, MlxPagedError) as e:
        sys.exit(f"error: {e}")
    for row in rows:
        print("\n" + "\n".join(table(row)))
    if args.json_out:
        payload = {
            "dtype": str(loaded.dtype),
            **settings,
            "timed_span": "from before the engine / generator is built to the last token, for both",
            "rows": rows,
        }
        print(f"results: {write_json(args.json_out, 'serving', label, payload)}")


if __name__ == "__main__":
    main()
