"""Every mlx-lm model type on the paged cache: one tiny checkpoint each (mlxpaged.testing.zoo),
mlxpaged's greedy tokens against mlx-lm's `generate_step` at block 16 and at block 4 with 7-token
chunks. Prints one line per type and the counts.

    python scripts/zoo_report.py [--tokens 8] [TYPE ...]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

import mlxpaged  # noqa: F401  (before mlx)
from mlxpaged.testing.zoo import model_types, verdict, write_zoo


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("types", nargs="*", help="model types (default: all)")
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()
    types = args.types or model_types()
    counts = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        for t in types:
            t0 = time.perf_counter()
            path = Path(tmp) / t
            try:
                write_zoo(path, t)
                kind, detail = verdict(path, args.tokens)
            except (Exception, SystemExit) as e:
                kind, detail = "no checkpoint", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            counts[kind] += 1
            print(f"{t:24s} {kind:15s} {time.perf_counter() - t0:5.1f}s  {detail}", flush=True)
    print(f"\n{len(types)} types: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
