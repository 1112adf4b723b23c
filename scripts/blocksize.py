"""Print the block-size trade-off of a paged KV cache on our traces.

For block sizes 1, 2, 4, ..., 256 it prints, on each trace (``mlxpaged/data/*_lengths.json``):
real tokens as a share of reserved slots and the blocks a running request holds, both
averaged over every step of every request (the measure of ``mlxpaged/waste.py``); and how
many tokens of an 85-token shared prefix (a system prompt) a block-level prefix cache can
reuse -- full blocks only, and never the block holding the prompt's last token. Small
blocks waste less memory but mean longer block tables and less work per kernel gather;
large blocks waste the tail of every sequence and share less of a prefix.

Usage::

    python scripts/blocksize.py
    python scripts/blocksize.py --max-block 64 --shared 120 --json
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

TRACES = ("sharegpt", "alpaca")


def block_sizes(max_block: int) -> list[int]:
    """Powers of two from 1 to ``max_block``."""
    sizes, bs = [], 1
    while bs <= max_block:
        sizes.append(bs)
        bs *= 2
    return sizes


def blocksize_table(traces: dict, sizes: Sequence[int], shared: int) -> list[dict]:
    """One row per block size: per-trace share and blocks, and the prefix reuse."""
    rows = []
    for bs in sizes:
        row = {"block_size": bs}
        for name, pairs in traces.items():
            r = waste.paged_row(pairs, bs)
            row[name] = {
                "real_share": r.real_share,
                "blocks_per_request": r.blocks_per_request,
                "slots_per_request": r.slots_per_request,
            }
        # A prompt that goes on past the prefix, and one that is exactly the prefix.
        row["prefix_reuse"] = waste.prefix_reuse(shared, bs)
        row["prefix_reuse_prompt_is_prefix"] = waste.prefix_reuse(shared, bs, prompt_len=shared)
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, default=DATA_DIR, help="where the *_lengths.json traces are")
    ap.add_argument("--max-block", type=int, default=256, help="largest block size (power of two)")
    ap.add_argument("--shared", type=int, default=waste.SHARED_PREFIX, help="shared prefix length in tokens")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)

    traces = {t: waste.load_pairs(args.data_dir / f"{t}_lengths.json") for t in TRACES}
    rows = blocksize_table(traces, block_sizes(args.max_block), args.shared)
    if args.json:
        print(json.dumps({"shared_prefix": args.shared, "provenance": provenance(), "rows": rows}, indent=2))
        return 0

    print(
        "Real tokens / reserved slots and blocks per running request, averaged over every\n"
        f"step of every request; tokens of the {args.shared}-token shared prefix reusable "
        "from a prefix cache\n(full blocks only; 'whole' = the prompt is just the prefix, "
        "so its last token is recomputed).\n"
    )
    head = (
        f"{'block':>5} | {'ShareGPT real':>13} {'blocks/req':>10} | "
        f"{'Alpaca real':>11} {'blocks/req':>10} | {f'reuse of {args.shared}':>12} {'whole':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        s, a = r["sharegpt"], r["alpaca"]
        print(
            f"{r['block_size']:>5} | {100 * s['real_share']:>12.1f}% {s['blocks_per_request']:>10.1f} | "
            f"{100 * a['real_share']:>10.1f}% {a['blocks_per_request']:>10.1f} | "
            f"{r['prefix_reuse']:>12} {r['prefix_reuse_prompt_is_prefix']:>6}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
