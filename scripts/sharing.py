"""Memory saved by sharing blocks, for parallel sampling (n = 2, 4, 6) and beam search
(width 2, 4, 6), on Alpaca and ShareGPT prompts (real text), beside the paper's §6.3 figures.

    python scripts/sharing.py                          # offline Qwen2.5-Coder-0.5B, 32 prompts each
    python scripts/sharing.py --num-prompts 32 --max-tokens 128 --json docs/data/sharing.json --resume
    python scripts/sharing.py --tiny                   # a tiny random model, seconds

The setup differs from the paper's: a 0.5B model (the paper: OPT-13B), answers capped at
`--max-tokens`, prompts as the chat template wraps them, sampling at temperature 1.
`mlxpaged bench sharing` runs the same measurement and can draw it.
"""

from __future__ import annotations

import argparse
import json
import os

import mlxpaged  # noqa: F401  (first: system BLAS on Linux)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--widths", default="2,4,6")
    ap.add_argument("--datasets", default="alpaca,sharegpt")
    ap.add_argument("--modes", default="beam,parallel")
    ap.add_argument("--json", dest="json_out", default=None, help="write the rows (and provenance) here")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in --json; run only the rest")
    args = ap.parse_args()

    from mlxpaged.bench.models import load_models
    from mlxpaged.bench.report import write_json
    from mlxpaged.bench.sharing import run, table

    loaded, _ = load_models(args.model, args.tiny, args.dtype, reference=False)
    done = []
    if args.resume and args.json_out and os.path.exists(args.json_out):
        done = json.load(open(args.json_out))["rows"]
        print(f"resuming: {len(done)} rows already in {args.json_out}")

    def on_row(rows):
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        if args.json_out:  # after every row: a long run that is stopped keeps what it measured
            write_json(args.json_out, "sharing", str(loaded.path.name), {"rows": rows})

    rows = run(
        loaded,
        args.datasets.split(","),
        args.modes.split(","),
        [int(w) for w in args.widths.split(",")],
        args.num_prompts,
        args.max_tokens,
        done=done,
        on_row=on_row,
    )
    print(table(rows))


if __name__ == "__main__":
    main()
