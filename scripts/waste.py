"""Print the KV memory-waste table (the PagedAttention paper's argument) on our traces.

For each trace (``mlxpaged/data/*_lengths.json``, built by ``scripts/lengths.py``) and each
reservation scheme -- the whole window (``max``), the prompt plus a power-of-two bucket
for the answer (``pow2``), the exact final length (``oracle``) and paged blocks -- it
prints real tokens as a share of reserved slots, the tokens and slots a running request
holds on average, and how many requests run at once in the KV cache; the seed design
doc's share is printed beside ours. Every figure is averaged over the steps of each
request's life; ``mlxpaged/waste.py`` defines the measure and the schemes precisely.

Usage::

    python scripts/waste.py
    python scripts/waste.py --slots 16077 --block-size 32 --extra
    python scripts/waste.py --json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing

from mlxpaged.bench import waste  # noqa: E402
from mlxpaged.bench.report import provenance  # noqa: E402
from mlxpaged.data import TRACE_DIR as DATA_DIR  # noqa: E402

TRACES = {"sharegpt": "ShareGPT", "alpaca": "Alpaca"}


def trace_table(name: str, pairs, args) -> dict:
    """The rows for one trace, with the seed's figure attached where it has one."""
    schemes = ["max", "pow2", "oracle"] + (["pow2_total"] if args.extra else [])
    rows = waste.waste_table(pairs, schemes, args.block_size, args.window, args.slots)
    seed = waste.SEED_REAL_SHARE.get(name, {})
    out = []
    for r in rows:
        d = r.as_dict()
        key = "paged" if r.scheme.startswith("paged") else r.scheme
        # The seed's paged figure is for blocks of 16 only.
        has_seed = key in seed and (key != "paged" or args.block_size == 16)
        d["seed_real_share"] = seed[key] / 100 if has_seed else None
        out.append(d)
    n = len(pairs)
    return {
        "trace": name,
        "requests": n,
        "prompt_mean": sum(p for p, _ in pairs) / n,
        "answer_mean": sum(a for _, a in pairs) / n,
        "rows": out,
    }


def print_table(t: dict, slots: int) -> None:
    print(
        f"{TRACES.get(t['trace'], t['trace'])}: {t['requests']} requests, prompt "
        f"{t['prompt_mean']:.1f} and answer {t['answer_mean']:.1f} tokens on average"
    )
    head = (
        f"  {'scheme':<11} {'real/reserved':>13} {'seed':>7} {'real/req':>9} "
        f"{'slots/req':>10} {f'running in {slots:,}':>17}"
    )
    print(head)
    print("  " + "-" * (len(head) - 2))
    for r in t["rows"]:
        seed = f"{100 * r['seed_real_share']:.1f}%" if r["seed_real_share"] is not None else "-"
        print(
            f"  {r['scheme']:<11} {100 * r['real_share']:>12.1f}% {seed:>7} "
            f"{r['real_per_request']:>9.1f} {r['slots_per_request']:>10.1f} "
            f"{r['requests_in_flight']:>17.1f}"
        )
    print()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, default=DATA_DIR, help="where the *_lengths.json traces are")
    ap.add_argument("--trace", choices=list(TRACES), action="append", help="trace(s) to show (default: all)")
    ap.add_argument(
        "--slots",
        type=int,
        default=waste.CAPACITY_SLOTS,
        help="KV cache capacity in token slots (default 15,700: the seed's 15.7K)",
    )
    ap.add_argument("--window", type=int, default=waste.WINDOW, help="context window the max scheme reserves")
    ap.add_argument("--block-size", type=int, default=waste.BLOCK_SIZE, help="paged block size in tokens")
    ap.add_argument("--extra", action="store_true", help="also show pow2_total = next_pow2(prompt + answer)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = ap.parse_args(argv)

    tables = []
    for name in args.trace or list(TRACES):
        pairs = waste.load_pairs(args.data_dir / f"{name}_lengths.json")
        tables.append(trace_table(name, pairs, args))

    if args.json:
        print(
            json.dumps(
                {
                    "slots": args.slots,
                    "window": args.window,
                    "block_size": args.block_size,
                    "provenance": provenance(),
                    "traces": tables,
                },
                indent=2,
            )
        )
        return 0
    print(
        f"KV slots reserved vs. holding a token, averaged over every step of every request;\n"
        f"window {args.window}, paged blocks of {args.block_size}, "
        f"{args.slots:,} slots of KV cache.\n"
    )
    for t in tables:
        print_table(t, args.slots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
