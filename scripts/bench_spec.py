"""Speculative decoding (n-gram prompt lookup, and a draft model if given) on the real model:
tokens/s against mlxpaged without speculation and against mlx-lm's generate loop, acceptance
rate and mean accepted length, for the
edit workload (rewrite a ~400-token Python file with one identifier renamed) and ShareGPT, at
batch 1 and 8, `--repeats` runs each with the order of the three systems rotating
(`mlxpaged.bench.spec`; `mlxpaged bench spec` runs the same code).

    python scripts/bench_spec.py                                  # the offline Qwen2.5-Coder-0.5B
    python scripts/bench_spec.py --workloads edit --batches 1 --repeats 1 --edit-tokens 128
    python scripts/bench_spec.py --draft-layers 6                 # also a draft: the model's first 6 layers
    python scripts/bench_spec.py --tiny --edit-tokens 32 --sharegpt-tokens 16   # a smoke run
"""

from __future__ import annotations

import argparse
import sys

import mlxpaged  # noqa: F401  (first: system BLAS on Linux)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tiny", action="store_true", help="a tiny random-weight Qwen2 (a smoke run)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--workloads", default="edit,sharegpt")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--edit-tokens", type=int, default=512)
    ap.add_argument("--sharegpt-tokens", type=int, default=128)
    ap.add_argument("--draft-model", default=None, help="also measure --speculative draft with this draft model")
    ap.add_argument("--draft-layers", type=int, default=None, help="also measure a draft of the model's first N layers")
    ap.add_argument("--json", dest="json_out", default=None, help="write results to this file")
    args = ap.parse_args()

    from mlxpaged.bench.report import write_json
    from mlxpaged.bench.spec import run_cli
    from mlxpaged.errors import MlxPagedError

    try:
        payload = run_cli(
            args.model,
            args.tiny,
            args.dtype,
            args.workloads,
            args.batches,
            args.repeats,
            args.edit_tokens,
            args.sharegpt_tokens,
            echo=lambda s: print(s, flush=True),
            draft_model=args.draft_model,
            draft_layers=args.draft_layers,
        )
    except (ValueError, MlxPagedError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    if args.json_out:
        print(f"results: {write_json(args.json_out, 'spec', payload.pop('label'), payload)}")


if __name__ == "__main__":
    main()
