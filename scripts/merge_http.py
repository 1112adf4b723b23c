"""One result from several `bench_http.py` runs (one per load, or more rates of a load, or an
earlier merged result plus new runs): rows concatenated, ratios and sustainable rates
recomputed, and one figure with a panel per load.

python scripts/merge_http.py RUN1.json RUN2.json ... --out docs/data/serve_http_sweep.json --bounds 1.5,2 --plot
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlxpaged  # noqa: F401  (first: OpenBLAS must load before MLX, mlxpaged/_blas.py)

# isort: split
from mlxpaged.bench.http_stats import merge, report, sustainable_line, write_figure
from mlxpaged.bench.report import write_json


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="result JSONs of bench_http.py (or of an earlier merge)")
    ap.add_argument("--out", required=True, help="the merged JSON")
    ap.add_argument("--bounds", default="", help="more latency bounds (s/token, comma-separated) to report")
    ap.add_argument("--plot", action="store_true", help="also write the figure beside it (.png)")
    a = ap.parse_args()
    try:
        bounds = tuple(float(b) for b in a.bounds.split(",") if b)
    except ValueError:
        print(f"error: --bounds must be numbers separated by commas, got {a.bounds!r}", file=sys.stderr)
        return 1
    try:
        docs = [json.loads(Path(p).read_text()) for p in a.runs]
        merged = merge(docs, bounds)
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: cannot read a run's result: {e}", file=sys.stderr)
        return 1
    except KeyError as e:
        print(f"error: not a bench_http.py result (no {e} field)", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)  # runs whose settings, commit or loads do not fit together
        return 1
    report(merged["rows"], merged["loads"], merged["bound_s_per_token"])
    for b, per_load in merged["sustainable_by_bound"].items():
        for load, sus in per_load.items():
            print(f"bound {b} s/token: {sustainable_line(load, sus)}")
    out = write_json(a.out, "serve", docs[0]["model"], {**merged, "merged_from": a.runs})
    print(f"results: {out}")
    if a.plot:
        png = write_figure(out.with_suffix(".png"), merged["per_rate"], merged["loads"], merged["bound_s_per_token"])
        print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
