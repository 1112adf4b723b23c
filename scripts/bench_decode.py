"""Generation throughput: mlxpaged against mlx-lm's batch generation, same model, prompts and lengths.

Batch 1, 8 and 32 (distinct Alpaca prompts), then one prompt with n = 8 samples against mlx-lm
given that prompt 8 times. Prints each ratio (mlxpaged / mlx-lm; > 1 means mlxpaged is faster).

    python scripts/bench_decode.py                      # the offline Qwen2.5-Coder-0.5B
    python scripts/bench_decode.py --model PATH --max-tokens 128 --batches 1,8,32
    python scripts/bench_decode.py --tiny               # a tiny random model, seconds
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlxpaged  # noqa: F401  (first: system BLAS on Linux)
import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tiny", action="store_true", help="use a tiny random-weight Qwen2 (for a quick check)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--samples", type=int, default=8, help="n for the one-prompt run (0 skips it)")
    ap.add_argument("--temp", type=float, default=0.7, help="temperature of the n-sample run")
    ap.add_argument("--json", dest="json_out", default=None, help="write results to this file")
    args = ap.parse_args()

    from mlxpaged.bench.models import load_models
    from mlxpaged.bench.prompts import encode_chat, load_prompts
    from mlxpaged.bench.throughput import run_mlx_lm, run_mlxpaged

    loaded, ref_model = load_models(args.model, args.tiny, args.dtype)
    print(f"model {loaded.path.name} ({loaded.dtype}), device {mx.default_device()}, mlx {mx.__version__}, "
          f"{args.max_tokens} output tokens per sequence")

    rows = []
    batches = [int(b) for b in args.batches.split(",") if b]
    prompts = encode_chat(loaded.tokenizer, load_prompts(max(batches)))
    run_mlxpaged(loaded, prompts[:2], 4)  # warm-up both
    run_mlx_lm(ref_model, prompts[:2], 4)
    cases = [(f"batch {b}", prompts[:b], 1, 0.0) for b in batches]
    if args.samples:
        cases.append((f"1 prompt, n={args.samples}", prompts[:1], args.samples, args.temp))
    print(f"{'case':>16} | {'mlxpaged tok/s':>14} | {'mlx-lm tok/s':>12} | {'ratio':>6} | {'TTFT ms (ours/theirs)':>22} | "
          f"{'ITL ms (ours/theirs)':>21} | {'peak GB above weights':>21}")
    for name, ps, n, temp in cases:
        ours = run_mlxpaged(loaded, ps, args.max_tokens, n=n, temperature=temp)
        theirs = run_mlx_lm(ref_model, ps * n, args.max_tokens, temperature=temp)
        ratio = ours.output_tps / theirs.output_tps
        print(f"{name:>16} | {ours.output_tps:14.1f} | {theirs.output_tps:12.1f} | {ratio:6.2f} | "
              f"{ours.ttft_ms_median:10.0f} / {theirs.ttft_ms_median:9.0f} | {ours.itl_ms_median:9.1f} / {theirs.itl_ms_median:9.1f} | "
              f"{ours.peak_memory_gb:9.3f} / {theirs.peak_memory_gb:9.3f}", flush=True)
        rows.append({"case": name, "mlxpaged": ours.as_dict(), "mlx_lm": theirs.as_dict(), "ratio": ratio})
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"model": str(loaded.path), "dtype": str(loaded.dtype),
                                                   "mlx": mx.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
