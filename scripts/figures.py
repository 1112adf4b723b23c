"""Regenerate every figure under docs/ (PNG), the ones the README shows.

The figures are the walkthrough notebook's (drawn by ``notebooks/figures_lib.py`` from the
runs of ``notebooks/engine_runs.py``), plus mlxpaged against mlx-lm from the benchmark JSON in
``docs/data/`` when it is there. Each figure's numbers are printed beside its file name.

    python scripts/figures.py                      # the offline Qwen2.5-Coder-0.5B, float32
    python scripts/figures.py --model PATH         # a checkpoint, .gguf or hub repo id
    python scripts/figures.py --tiny --out /tmp/f  # a tiny random model, seconds
    python scripts/figures.py --only data          # kernel and benchmark figures only (new JSON)

The benchmark figure reads ``docs/data/bench_decode.json`` (``scripts/bench_decode.py --json``)
and ``docs/data/bench_serving.json`` (``scripts/bench_serving.py --json``); either may be absent.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing
sys.path.insert(0, str(REPO_ROOT / "notebooks"))  # the figure code is the notebook's

import matplotlib  # noqa: E402

import mlxpaged  # noqa: E402,F401  (first: system BLAS on Linux)

matplotlib.use("Agg")
import engine_runs  # noqa: E402
import figures_lib  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

from mlxpaged.bench import waste  # noqa: E402
from mlxpaged.data import TRACE_DIR  # noqa: E402
from mlxpaged.errors import MlxPagedError  # noqa: E402

DPI = 110
GROUPS = ("tables", "engine", "data")
BENCH_KINDS = {"decode": ("throughput", "decode"), "serving": ("serving",)}  # the JSON's "kind" field
KERNEL_TABLES = [REPO_ROOT / "notebooks" / "data" / f"kernel_{k}.json" for k in ("mac", "emulator")]


def save(fig, out: Path, name: str, caption: str) -> None:
    path = out / f"{name}.png"
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    print(f"{path}: {caption}", flush=True)


def table_figures(out: Path) -> None:
    """Waste by scheme and the block-size trade-off: arithmetic on the length traces, no model."""
    pairs = {t: waste.load_pairs(TRACE_DIR / f"{t}_lengths.json") for t in figures_lib.TRACE_NAMES}
    tables = {t: waste.waste_table(p, ("max", "pow2", "oracle"), block_size=16) for t, p in pairs.items()}
    shares = "; ".join(
        f"{figures_lib.TRACE_NAMES[t]} " + " / ".join(f"{100 * r.real_share:.1f}" for r in rows)
        for t, rows in tables.items()
    )
    save(
        figures_lib.waste_figure(tables, {t: len(p) for t, p in pairs.items()}),
        out,
        "waste",
        f"real/reserved % for max / pow2 / oracle / paged-16: {shares}",
    )

    sizes = [2**i for i in range(9)]
    paged = {t: [waste.paged_row(p, bs) for bs in sizes] for t, p in pairs.items()}
    reuse = [waste.prefix_reuse(waste.SHARED_PREFIX, bs) for bs in sizes]
    at = {bs: i for i, bs in enumerate(sizes)}
    save(
        figures_lib.blocksize_figure(sizes, paged, reuse, waste.SHARED_PREFIX),
        out,
        "blocksize",
        "ShareGPT real/reserved at blocks of 1 / 16 / 256: "
        + " / ".join(f"{100 * paged['sharegpt'][at[b]].real_share:.1f}%" for b in (1, 16, 256))
        + f"; reuse of the {waste.SHARED_PREFIX}-token prefix at 16 / 64 / 128: "
        + " / ".join(str(reuse[at[b]]) for b in (16, 64, 128)),
    )


def engine_figures(loaded, out: Path) -> None:
    """The pool of two interleaved sequences, copy-on-write for n = 4, and prefix reuse."""
    pool, bs = 32, 4
    snapshots = engine_runs.interleaved(loaded, block_size=bs, num_blocks=pool, steps=40)
    shown = [min(snapshots), sorted(snapshots)[len(snapshots) // 2], max(snapshots)]
    last = snapshots[shown[-1]]
    save(
        figures_lib.pool_figure(snapshots, shown, pool, bs),
        out,
        "pool",
        f"after step {shown[-1]}: A holds {len(last['A'])} blocks, B {len(last['B'])}, "
        f"{pool - len(last['A']) - len(last['B'])} of {pool} free",
    )

    run = engine_runs.fork_n(loaded, engine_runs.cow_prompt(loaded.tokenizer, 44), n=4, max_tokens=64)
    st = run.stats
    save(
        figures_lib.fork_figure(run),
        out,
        "cow",
        f"44-token prompt, 4 samples of 64 tokens: {st['blocks_in_use_peak']} blocks at peak vs "
        f"{st['blocks_without_sharing']} without sharing, {st['cow_copies']} copy-on-write copies",
    )

    prompts = engine_runs.prefix_prompts(loaded.tokenizer, loaded.model.args.vocab_size, 96, waste.SHARED_PREFIX)
    cached = engine_runs.prefix_reuse(loaded, prompts)
    save(
        figures_lib.prefix_figure(prompts, cached, waste.SHARED_PREFIX, 16),
        out,
        "prefix",
        "prompt tokens reused of 96: " + ", ".join(f"{k} {v}" for k, v in cached.items()),
    )


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise MlxPagedError(f"{path} is not JSON: {e}") from None


def data_figures(out: Path, bench_dir: Path) -> None:
    """The kernel table (notebooks/data) and the benchmarks (docs/data), whichever exist."""
    kernel = next((p for p in KERNEL_TABLES if p.exists()), None)
    if kernel:
        doc = read_json(kernel)
        rows = doc["rows"] if isinstance(doc, dict) else doc
        worst = max(r.get("ratio", 0) for r in rows)
        save(
            figures_lib.kernel_figure(rows),
            out,
            "kernel",
            f"from {kernel.relative_to(REPO_ROOT)}"
            + (f"; bytes read at most {worst:.3f}x the minimum" if worst else ""),
        )

    sharing = bench_dir / "sharing.json"
    if sharing.is_file():
        from mlxpaged.bench.cli import draw_sharing
        from mlxpaged.bench.sharing import PAPER

        rows = read_json(sharing)["rows"]
        fig, ax = plt.subplots(figsize=(7, 4))
        draw_sharing(ax, rows, PAPER)
        save(fig, out, "sharing", f"from {sharing.name}: memory saved by sharing, {len(rows)} rows")

    found = bench_files(bench_dir)
    if not found:
        print(f"no benchmark JSON in {bench_dir} (bench_decode.json / bench_serving.json): bench figure skipped")
        return
    docs = {k: read_json(p) for k, p in found.items()}
    try:
        fig = figures_lib.bench_figure(docs.get("decode"), docs.get("serving"))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise MlxPagedError(f"cannot plot the benchmark JSON in {bench_dir}: {e}") from None
    save(fig, out, "bench", "from " + ", ".join(str(p) for p in found.values()))


def bench_files(bench_dir: Path) -> dict[str, Path]:
    """{"decode": path, "serving": path} for what is there: ``bench_<k>.json``, else the newest JSON
    whose ``kind`` says so (``mlxpaged bench`` names its files by machine, model and MLX version)."""
    found: dict[str, Path] = {}
    paths = sorted(bench_dir.glob("*.json"), key=lambda p: p.stat().st_mtime) if bench_dir.is_dir() else []
    for path in paths:  # oldest first, so the newest of a kind wins
        try:
            kind = json.loads(path.read_text()).get("kind")
        except (json.JSONDecodeError, AttributeError, OSError):
            kind = None  # read_json reports a broken bench_<k>.json below
        for k, kinds in BENCH_KINDS.items():
            if kind in kinds:
                found[k] = path
    for k in BENCH_KINDS:
        if (bench_dir / f"bench_{k}.json").is_file():
            found[k] = bench_dir / f"bench_{k}.json"
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default=None, help="checkpoint, .gguf or hub repo id (default: the offline Qwen2.5-Coder-0.5B)"
    )
    ap.add_argument("--tiny", action="store_true", help="a tiny random-weight Qwen2 (seconds; the tables are the same)")
    ap.add_argument("--dtype", default="float32", help="float32 (default), float16, bfloat16 or auto")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "docs", help="folder for the PNGs")
    ap.add_argument("--bench-dir", type=Path, default=REPO_ROOT / "docs" / "data", help="where the benchmark JSON is")
    ap.add_argument(
        "--only",
        choices=GROUPS,
        action="append",
        help="draw only these groups: tables (waste, blocksize), engine (pool, cow, prefix), "
        "data (kernel, bench); repeatable",
    )
    args = ap.parse_args(argv)
    if args.tiny and args.model:
        sys.exit("error: --tiny and --model are exclusive")
    groups = args.only or GROUPS
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        if "tables" in groups:
            table_figures(args.out)
        if "engine" in groups:
            from mlxpaged.bench.models import tiny_checkpoint
            from mlxpaged.loading.loader import load

            loaded = load(tiny_checkpoint() if args.tiny else args.model, args.dtype)
            print(f"model {engine_runs.model_label(loaded)} ({loaded.dtype})", flush=True)
            engine_figures(loaded, args.out)
        if "data" in groups:
            data_figures(args.out, args.bench_dir)
    except (MlxPagedError, OSError) as e:
        sys.exit(f"error: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
