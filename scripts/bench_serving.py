"""Serving benchmark: a ShareGPT-shaped replay through mlxpaged's `LLMEngine` and mlx-lm's `BatchGenerator`.

Requests take (prompt, answer) lengths from `scripts/data/sharegpt_lengths.json` (prompts are
synthetic ids of those lengths) and arrive at `--rate` per second (0: all at once). mlxpaged runs at
a fixed KV budget (`--kv-tokens`); a second pair of runs puts one shared system prompt in front of
every request to show the prefix cache's saving.

    python scripts/bench_serving.py --num-requests 32 --kv-tokens 8192
    python scripts/bench_serving.py --tiny --num-requests 64
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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
    ap.add_argument("--system-prompt", type=int, default=256, help="shared system prompt tokens in the second run (0 skips it)")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()

    from mlxpaged.bench.models import load_models
    from mlxpaged.bench.serving import load_trace, make_workload, serve_mlx_lm, serve_mlxpaged
    from mlxpaged.config import EngineConfig

    loaded, ref = load_models(args.model, args.tiny, args.dtype)
    pairs = load_trace(args.trace)
    vocab = loaded.model.args.vocab_size
    config = EngineConfig(block_size=args.block_size, num_blocks=args.kv_tokens // args.block_size,
                          max_num_seqs=args.max_num_seqs)
    print(f"model {loaded.path.name} ({loaded.dtype}); {args.num_requests} {args.trace} requests at rate {args.rate or 'inf'}; "
          f"mlxpaged KV budget {args.kv_tokens} tokens")
    results = []
    runs = [("no shared prefix", 0)] + ([(f"shared {args.system_prompt}-token system prompt", args.system_prompt)]
                                        if args.system_prompt else [])
    warm = make_workload(pairs, 2, vocab=vocab, max_output=4)
    serve_mlxpaged(loaded, warm, config)
    serve_mlx_lm(ref, warm, args.max_num_seqs)
    keys = ["requests_per_s", "output_tps", "ttft_ms_median", "ttft_ms_p90", "itl_ms_median", "itl_ms_p90", "peak_memory_gb"]
    for label, sys_len in runs:
        wl = make_workload(pairs, args.num_requests, vocab=vocab, rate=args.rate, system_prompt_len=sys_len,
                           max_prompt=args.max_prompt, max_output=args.max_output)
        ours = serve_mlxpaged(loaded, wl, config).summary()
        theirs = serve_mlx_lm(ref, wl, args.max_num_seqs).summary()
        print(f"\n== {label} ==")
        print(f"{'metric':>24} | {'mlxpaged':>10} | {'mlx-lm':>10} | ratio")
        for k in keys:
            r = ours[k] / theirs[k] if theirs[k] else float("nan")
            print(f"{k:>24} | {ours[k]:10.2f} | {theirs[k]:10.2f} | {r:5.2f}")
        print(f"mlxpaged: peak running seqs {ours['running_seqs_peak']}, preemptions {ours['preemptions']}, "
              f"prefix-cache hit tokens {ours['prefix_cache_hit_tokens']}, prefill tokens computed {ours['computed_prefill_tokens']}")
        results.append({"run": label, "mlxpaged": ours, "mlx_lm": theirs})
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
