"""Time to first token for a long shared prefix plus a short question: cold, warm in memory, and
after a restart from the prefix cache's disk tier (`--prefix-cache-dir`); median and range of
`--repeats` runs each, and the disk bytes per token. `mlxpaged bench prefix-disk` runs the same
code (`mlxpaged.bench.prefix_disk`).

    python scripts/bench_prefix_disk.py                    # the offline Qwen2.5-Coder-0.5B, 2,000 + 50 tokens
    python scripts/bench_prefix_disk.py --tiny --repeats 1 # a tiny random model, seconds
"""

from __future__ import annotations

import argparse
import sys

import mlxpaged  # noqa: F401  (first: OpenBLAS must load before MLX, mlxpaged/_blas.py)

# isort: split
import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tiny", action="store_true", help="use a tiny random-weight Qwen2 (for a quick check)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--question-tokens", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--store-dir", default=None, help="directory of the disk tier (default: a new temporary one)")
    ap.add_argument("--json", dest="json_out", default=None, help="write results to this file")
    args = ap.parse_args()

    from mlxpaged.bench.models import load_models, model_label
    from mlxpaged.bench.prefix_disk import benchmark, table
    from mlxpaged.bench.report import write_json
    from mlxpaged.errors import MlxPagedError

    try:
        loaded, _ = load_models(args.model, args.tiny, args.dtype, reference=False)
        label = model_label(loaded, args.model, args.tiny)
        print(
            f"model {label} ({loaded.dtype}), device {mx.default_device()}, mlx {mx.__version__}, "
            f"{args.repeats} repeats",
            flush=True,
        )
        payload = benchmark(
            loaded,
            prefix_tokens=args.prefix_tokens,
            question_tokens=args.question_tokens,
            repeats=args.repeats,
            store_dir=args.store_dir,
        )
    except (ValueError, MlxPagedError) as e:
        sys.exit(f"error: {e}")
    print("\n".join(table(payload)))
    if args.json_out:
        print(f"results: {write_json(args.json_out, 'prefix-disk', label, payload)}")


if __name__ == "__main__":
    main()
