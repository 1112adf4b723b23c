"""Generation throughput: mlxpaged against mlx-lm's batch generation, same model, prompts and lengths.

Batch 1, 8 and 32 (distinct Alpaca prompts, prefix caching off), then one prompt with n = 8
samples against mlx-lm's 8 requests started from one prefilled prompt cache. Each case runs
`--repeats` times, alternating which system goes first; prints the median ratio (mlxpaged /
mlx-lm; > 1 means mlxpaged is faster) with its min-max range. The clock covers building each
system (mlxpaged's KV pool included) through the last token. `mlxpaged bench throughput` runs
the same code (`mlxpaged.bench.throughput`).

    python scripts/bench_decode.py                      # the offline Qwen2.5-Coder-0.5B
    python scripts/bench_decode.py --model PATH --max-tokens 128 --batches 1,8,32 --repeats 5
    python scripts/bench_decode.py --tiny               # a tiny random model, seconds
    python scripts/bench_decode.py --tiny phi3          # a tiny random Phi-3 (head_dim 96)
    python scripts/bench_decode.py --zoo mamba --max-tokens 64 --batches 1,8 --samples 0

`--zoo TYPE` takes any mlx-lm model type the model zoo writes (`mlxpaged.testing.zoo.write_zoo`,
the tiny checkpoints tests/test_zoo.py compares against mlx-lm). The result records the load
average before and after, since the machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import mlxpaged  # noqa: F401  (first: OpenBLAS must load before MLX, mlxpaged/_blas.py)

# isort: split
import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument(
        "--tiny",
        nargs="?",
        const=True,
        default=False,
        metavar="FAMILY",
        help="a tiny random-weight checkpoint: mlxpaged's Qwen2, or FAMILY's (llama, qwen3, phi3, ...) "
        "written through mlx-lm's ModelArgs and Model",
    )
    ap.add_argument(
        "--zoo",
        default=None,
        metavar="TYPE",
        help="a tiny random-weight checkpoint of any mlx-lm model type the model zoo writes (mamba, rwkv7, ...)",
    )
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--samples", type=int, default=8, help="n for the one-prompt run (0 skips it)")
    ap.add_argument("--temp", type=float, default=0.7, help="temperature of the n-sample run")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each case, alternating which system goes first")
    ap.add_argument("--json", dest="json_out", default=None, help="write results to this file")
    args = ap.parse_args()

    from mlxpaged.bench.models import load_models, model_label
    from mlxpaged.bench.report import write_json
    from mlxpaged.bench.throughput import benchmark, parse_levels, table
    from mlxpaged.errors import MlxPagedError

    try:
        levels = parse_levels(args.batches, "--batches")
        if args.zoo:
            if args.model or args.tiny:
                raise ValueError("--zoo takes the place of --model and --tiny")
            from mlxpaged.testing.zoo import model_types, write_zoo

            if args.zoo not in model_types():
                raise ValueError(f"--zoo {args.zoo!r} is not an mlx-lm model type the zoo writes")
            folder = Path(tempfile.mkdtemp(prefix="mlxpaged-zoo-")) / args.zoo
            args.model = str(write_zoo(folder, args.zoo))
        loaded, ref = load_models(args.model, args.tiny, args.dtype)
        label = f"zoo-{args.zoo}" if args.zoo else model_label(loaded, args.model, args.tiny)
        load_before = os.getloadavg()
        print(
            f"model {label} ({loaded.dtype}), device {mx.default_device()}, mlx {mx.__version__}, "
            f"{args.max_tokens} output tokens per sequence, {args.repeats} repeats",
            flush=True,
        )
        payload = benchmark(
            loaded,
            ref,
            levels=levels,
            samples=args.samples,
            temperature=args.temp,
            max_tokens=args.max_tokens,
            repeats=args.repeats,
        )
        # 1, 5 and 15 minute load averages: timings are only comparable within one repeat.
        payload["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
    except (ValueError, MlxPagedError) as e:
        sys.exit(f"error: {e}")
    print("\n".join(table(payload["rows"])))
    print(payload["timed_span"])
    if args.json_out:
        print(f"results: {write_json(args.json_out, 'throughput', label, payload)}")


if __name__ == "__main__":
    main()
